"""Whole-model tasks on every system: prefill, decode and train.

Every rank serves its own sequences (the batch is per rank); under expert
parallelism the MoE layers exchange tokens, everything else is replicated.
Before timing, a short parity check compares the system's layer with the
single-device reference (task.check_parity) and, where the run changes what the
model computes beyond one layer (micro-batches, a shortcut model, migration, an
overlapped gradient sync), the whole model under that schedule with the
single-device model. Times are kept per rank and per sample; over-all-ranks
figures (``rank=-1``) use the slowest rank.

Shapes: B sequences per rank, S sequence length, V vocabulary, N new tokens.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as nnf
from omegaconf import OmegaConf

from ..data.batches import batch_iterator, eval_batches, token_ids
from ..data.tokenizer import get_tokenizer
from ..ep import Recorder, system_config
from ..ep.accounting import recording
from ..ep.measure import clock, iterations, slowest
from ..ep.static import dynamic_calls, times_by_marks
from ..models.grad_sync import GradSync
from ..models.runtime import base_model, forward_micro_batches, make_rank_model, micro_batches
from ..records import row
from .common import (comm_rows, model_parity_gate, parity_gate, routing_rows, step_span_rows, step_traffic_rows,
                     timing_rows)


def prepare(cfg_dict: dict) -> dict:
    """In the launching process: the checkpoint every rank loads (pre-training a proxy
    first when its cached checkpoint is missing, which ``setup_done`` then records: the
    sweep's time-left estimate leaves such a point out)."""
    cfg = OmegaConf.create(cfg_dict)
    m = cfg.model
    if m.path:
        cfg_dict["checkpoint"] = str(m.path)
    elif m.proxy and m.init == "trained":
        from .pretrain import ensure_trained, is_trained
        if not is_trained(cfg):
            cfg_dict.setdefault("setup_done", []).append(f"pre-trained {m.name}")
        cfg_dict["checkpoint"] = str(ensure_trained(cfg))
    else:
        cfg_dict["checkpoint"] = None
    return cfg_dict


def setup(ctx, cfg, tokens_per_call: int):
    """This rank's model (eval mode), tokenizer and the parity rows. ``tokens_per_call``: the
    most tokens one rank's layer call holds in the task's work (what a system with fixed
    buffers is sized by; each task knows it from its own fields, e.g. :func:`call_tokens`)."""
    tok = get_tokenizer(cfg.pretrain.tokenizer_vocab, corpus=cfg.pretrain.corpus)
    vocab = cfg.model.vocab_size or tok.vocab_size
    rows = []
    full = base_model(cfg, vocab, cfg.get("checkpoint"), device=ctx.device)
    placements = task_placements(ctx, cfg, full, tok)
    if cfg.task.check_parity and system_config(cfg.system).expert_parallel:
        first = min(placements) if placements else None
        rows += parity_gate(ctx, cfg, cfg.system, "router", placements.get(first))
        rows += model_parity_gate(ctx, cfg, cfg.system, placements or None, model_runner(ctx, cfg))
    model = make_rank_model(ctx, full, cfg, placements or None, tokens_per_rank=tokens_per_call)
    return model.eval(), tok, rows


def model_runner(ctx, cfg):
    """What runs the rank model in this task, beyond the model itself (sequence migration's
    wrapper, :func:`run_workload`), as a function of the rank model; None for the model."""
    if not cfg.task.get("migration"):
        return None
    from .migration import MigratingModel
    return lambda model: MigratingModel(ctx, model, _placements(cfg, ctx, model))


def call_tokens(cfg) -> int:
    """The tokens one rank's layer call holds in the timed work of a task with ``batch_size``
    and ``seq_len`` (what a system with fixed buffers is sized by): a decode step's B (its
    prompt runs dynamic), else B S."""
    t = cfg.task
    return t.batch_size if t.get("workload", t.name) == "decode" else t.batch_size * t.seq_len


def task_placements(ctx, cfg, model, tok) -> dict:
    """``{layer: SlotPlacement}`` from ``task.placement`` ({} for the system's own): EPLB's,
    from the expert loads of the single-device ``model``'s routers on a profiling set (random
    windows of the train split, seed + 1, four times a step's tokens over all ranks; every rank
    computes the same), the artifact written by rank 0 to the run folder; or an artifact's."""
    t = getattr(cfg.task, "placement", "contiguous")
    if t == "contiguous":
        return {}
    from ..placement.eplb import load_slot_placements, save_slot_placements
    from .layer import expert_groups, slot_placements_of
    if t not in ("eplb", "eplb_affinity"):
        return load_slot_placements(t)[0]
    from ..models.families import family_of
    from .profiling import route_text

    n = 4 * cfg.task.batch_size * cfg.task.seq_len * ctx.world_size
    on_host = model if next(model.parameters()).device.type == "cpu" else copy.deepcopy(model).to("cpu")
    routed = route_text(on_host, family_of(cfg.model.family), token_ids(cfg.task.corpus, "train", tok), n,
                        cfg.task.seq_len, cfg.seed + 1)
    E = cfg.model.num_experts
    ids = {layer: ids_NK for layer, (ids_NK, _, _) in routed.items()}
    loads = {layer: torch.bincount(ids_NK.flatten(), minlength=E).double() for layer, ids_NK in ids.items()}
    placements, built_by = slot_placements_of(cfg.task, ids, loads, ctx, expert_groups(cfg.model))
    if ctx.rank == 0:
        save_slot_placements(Path(cfg.get("out_dir_resolved") or ".") / f"placement_{t}.json", placements,
                             built_by, {"profiling": f"the model's routers on {n} tokens of the train split "
                                        f"of {cfg.task.corpus}, seed {cfg.seed + 1}",
                                        "load_LE": {str(k): v.tolist() for k, v in loads.items()},
                                        "num_redundant": cfg.task.num_redundant})
    return placements


def rank_batch(ctx, cfg, tok, batch_size: int, seq_len: int, index: int = 0) -> torch.Tensor:
    """Held-out sequences for this rank, on its device: eval windows, rank r takes its own block."""
    ids_N = token_ids(cfg.task.corpus, cfg.task.split, tok)
    need = (index * ctx.world_size + ctx.rank + 1) * batch_size
    batches = eval_batches(ids_N, need, seq_len)
    x_BS = next(batches)[0]
    if x_BS.shape[0] < need:
        raise ValueError(f"task.batch_size={batch_size} x {ctx.world_size} ranks x task.seq_len={seq_len} "
                         f"needs more held-out text than the {cfg.task.split} split has")
    return x_BS[need - batch_size:need].to(ctx.device)


def _finish(ctx, cfg, rec: Recorder, rows: list, model) -> list:
    """The last timed iteration's collectives and routing (and the trace, when asked)."""
    rows += comm_rows(rec) + routing_rows(ctx, rec, _placements(cfg, ctx, model))
    if cfg.task.save_routing:
        from .traces import write_trace
        write_trace(ctx, rec, Path(cfg.get("out_dir_resolved") or "."))
    return rows


def _placements(cfg, ctx, model) -> dict:
    """{layer: placement} of the model's EP blocks (contiguous for a model without them)."""
    from ..ep import Placement
    from ..models.ep_block import ep_placements
    found = ep_placements(model)
    contiguous = Placement.contiguous(cfg.model.num_experts, ctx.world_size)
    return {layer: found.get(layer, contiguous) for layer in range(cfg.model.num_layers)}


def _iterations(ctx, t, rec: Recorder):
    """Warm-up then timed iterations, each started together on every rank with a cleared
    recorder: yields the sample index (negative during warm-up)."""
    return iterations(ctx.ep, t.warmup, t.iters, before=rec.clear)


class Workload:
    """One whole-model task's timed iteration on one rank model (the task and the benchmark
    both run it): ``step(rec, sample)`` runs an iteration and returns its rows (none
    during warm-up, ``sample < 0``)."""

    phase = ""

    def __init__(self, ctx, cfg, tok, model):
        self.ctx, self.cfg, self.model = ctx, cfg, model
        # micro-batches co-executed as strands (task.microbatches; a task without the field: 1)
        self.microbatches = int(cfg.task.get("microbatches", 1))

    def forward(self, inputs: list) -> list:
        """The model on each micro-batch's ``inputs`` (co-executed when there are several)."""
        return forward_micro_batches(self.model, self.ctx.device, inputs)

    def step(self, rec: Recorder, sample: int) -> list:
        raise TypeError(f"{type(self).__name__} runs no iteration")


class PrefillWorkload(Workload):
    """task=prefill: one forward over B prompts of S tokens; time to first token."""

    phase = "prefill"

    def __init__(self, ctx, cfg, tok, model):
        super().__init__(ctx, cfg, tok, model.eval())
        self.x_BS = rank_batch(ctx, cfg, tok, cfg.task.batch_size, cfg.task.seq_len)
        self.x_mBS = micro_batches(self.x_BS, self.microbatches)

    def step(self, rec, sample):
        ctx, t = self.ctx, self.cfg.task
        t0 = clock()
        with torch.no_grad(), recording(rec):
            for out in self.forward([{"input_ids": x, "use_cache": False} for x in self.x_mBS]):
                out.logits[:, -1].argmax(-1)
        took = clock() - t0
        worst = slowest(ctx.ep, took)
        if sample < 0:
            return []
        rows = timing_rows(rec, sample)
        rows.append(row("time", took * 1e3, "ms", rank=ctx.rank, phase="prefill", direction="forward",
                        sample=sample))
        if ctx.rank == 0:
            rows.append(row("ttft", worst * 1e3, "ms", phase="prefill", sample=sample))
            rows.append(row("tokens_per_s", t.batch_size * t.seq_len * ctx.world_size / worst, "tokens/s",
                            phase="prefill", sample=sample))
        return rows


class DecodeWorkload(PrefillWorkload):
    """task=decode: greedy generation of N tokens with a KV cache after a prompt. The prompt
    runs the dynamic dispatch; the steps a system's ``dispatch_mode`` (static: fixed buffers
    of B tokens per rank, :mod:`occult.ep.static`; with ``task.cuda_graph``, each MoE block's
    step captured once and replayed, :mod:`occult.ep.graphs`)."""

    phase = "decode"

    def __init__(self, ctx, cfg, tok, model):
        super().__init__(ctx, cfg, tok, model)
        if cfg.task.get("cuda_graph", False):
            from ..ep.graphs import graph_blocks
            from ..models.ep_block import EPMoEBlock
            graph_blocks(self.model, EPMoEBlock)

    def step(self, rec, sample):
        ctx, t, model = self.ctx, self.cfg.task, self.model
        steps = []
        with torch.no_grad(), recording(rec):
            t0 = clock()
            with dynamic_calls():
                outs = self.forward([{"input_ids": x, "use_cache": True} for x in self.x_mBS])
            ttft = clock() - t0
            prompt_events, prompt_spans = len(rec.comm), len(rec.spans)
            for _ in range(t.new_tokens):
                ts = clock()
                outs = self.forward([{"input_ids": out.logits[:, -1].argmax(-1, keepdim=True), "cache": out.cache,
                                      "use_cache": True} for out in outs])
                steps.append(clock() - ts)
        worst = torch.tensor(slowest(ctx.ep, steps + [ttft]), dtype=torch.float64, device="cpu")
        if sample < 0:
            return []
        rows = timing_rows(rec, sample)
        rec.settle()           # the steps' valid rows, read after the steps
        rows += step_traffic_rows(rec.comm[prompt_events:], t.new_tokens, ctx.rank, sample)
        rows += step_span_rows(rec.spans[prompt_spans:], t.new_tokens, ctx.rank, sample)
        # one sample per generated token: sample = iteration * N + step
        rows += [row("time", s * 1e3, "ms", rank=ctx.rank, phase="decode_step", sample=sample * t.new_tokens + k)
                 for k, s in enumerate(steps)]
        if ctx.rank == 0:
            per_token = worst[:-1]
            rows += [row("token_latency", s * 1e3, "ms", phase="decode", sample=sample * t.new_tokens + k)
                     for k, s in enumerate(per_token.tolist())]
            rows.append(row("ttft", worst[-1].item() * 1e3, "ms", phase="decode", sample=sample))
            rows.append(row("tokens_per_s", t.batch_size * ctx.world_size * t.new_tokens / per_token.sum().item(),
                            "tokens/s", phase="decode", sample=sample))
        return rows


class TrainWorkload(Workload):
    """task=train: forward, backward, gradient synchronisation and an AdamW step."""

    phase = "train"

    def __init__(self, ctx, cfg, tok, model):
        super().__init__(ctx, cfg, tok, model.train())
        t = cfg.task
        self.opt = torch.optim.AdamW(model.parameters(), lr=t.lr)
        ids_N = token_ids(t.corpus, "train", tok)
        self.batches = batch_iterator(ids_N, t.batch_size, t.seq_len, seed=cfg.seed * 1000 + ctx.rank)
        self.sync = GradSync(ctx, model, t.get("grad_sync", "end"))

    def step(self, rec, sample):
        ctx, t, model = self.ctx, self.cfg.task, self.model
        x_BS, y_BS = (b.to(ctx.device) for b in next(self.batches))
        t0 = clock()
        with recording(rec):
            ys = micro_batches(y_BS, self.microbatches)
            outs = self.forward([{"input_ids": x} for x in micro_batches(x_BS, self.microbatches)])
            # each micro-batch's mean loss weighted by its share of the batch: their sum is the batch's mean
            losses = [nnf.cross_entropy(out.logits.flatten(0, 1), y.flatten()) * (y.numel() / y_BS.numel())
                      for out, y in zip(outs, ys)]
            synced = self.sync.backward(losses, rec)
        loss = sum(l.detach() for l in losses)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        took = clock() - t0
        worst = slowest(ctx.ep, took)
        if sample < 0:
            return []
        rows = timing_rows(rec, sample)
        rows.append(row("time", took * 1e3, "ms", rank=ctx.rank, phase="train_step", sample=sample))
        rows.append(row("loss", loss.item(), "nats/token", rank=ctx.rank, sample=sample))
        # the gradient all-reduce's calls (task.grad_sync), and how many started before the backward ended
        rows += [row(f"grad_sync_{k}", v, "calls", rank=ctx.rank, sample=sample) for k, v in synced.items()]
        if ctx.rank == 0:
            rows.append(row("step_time", worst * 1e3, "ms", phase="train", sample=sample))
            rows.append(row("tokens_per_s", t.batch_size * t.seq_len * ctx.world_size / worst, "tokens/s",
                            phase="train", sample=sample))
        return rows


WORKLOADS = {"prefill": PrefillWorkload, "decode": DecodeWorkload, "train": TrainWorkload}


def run_workload(ctx, cfg_dict: dict, workload: str) -> list:
    """A whole-model task on this rank: the parity gate, the rank model, warm-up and timed
    iterations of ``workload``, then the last iteration's collectives and routing."""
    cfg = OmegaConf.create(cfg_dict)
    model, tok, rows = setup(ctx, cfg, call_tokens(cfg))
    runner = model_runner(ctx, cfg)
    if runner is not None:
        model = runner(model)
    work = WORKLOADS[workload](ctx, cfg, tok, model)
    rec = Recorder(rank=ctx.rank, sync_collectives=cfg.task.sync_collectives,
                   marks=times_by_marks(system_config(cfg.system)))
    for sample in _iterations(ctx, cfg.task, rec):
        rows += work.step(rec, sample)
    return _finish(ctx, cfg, rec, rows, model)


def prefill_rank(ctx, cfg_dict: dict) -> list:
    """task=prefill: one forward over B prompts of S tokens; time to first token."""
    return run_workload(ctx, cfg_dict, "prefill")


def decode_rank(ctx, cfg_dict: dict) -> list:
    """task=decode: greedy generation of N tokens with a KV cache after a prompt."""
    return run_workload(ctx, cfg_dict, "decode")


def train_rank(ctx, cfg_dict: dict) -> list:
    """task=train: forward, backward, gradient synchronisation and an AdamW step."""
    return run_workload(ctx, cfg_dict, "train")
