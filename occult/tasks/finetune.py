"""task=finetune: Occult's modified fine-tuning and the accuracy of collaboration pruning.

From the trained proxy (its cached checkpoint, :func:`occult.tasks.model.prepare`), the
model is fine-tuned on the second text domain (``task.corpus``, ``task.split``; default
the ``pydoc`` training split) on P ranks under the configured system, with that
system's routing active in the forward pass: for ``occult_prune_*`` every token uses at
most ``system.budget`` devices, in training and in evaluation. Non-MoE weights
(embeddings, attention, norms, dense MLPs, the LM head) are frozen; the MoE modules
(routed experts, routers, shared experts) are trained for ``task.steps`` AdamW steps
(``task.lr``, linear warm-up over the first tenth, then cosine decay to a tenth;
gradients clipped to a global norm of 1 over all ranks). Gradients of replicated
weights are averaged over ranks (:func:`occult.models.runtime.sync_gradients`).

Then held-out loss, perplexity and next-token accuracy on both domains (the
pre-training corpus ``pretrain.corpus`` and ``task.corpus``, validation splits; at most
``task.tokens_per_rank`` tokens per rank and domain), computed through the same rank
model, so pruning is active there too; and C_T per MoE layer from the routing the
recorder saw during evaluation.

Baselines with the same step budget: standard fine-tuning is ``system=occult`` (no
pruning, same frozen set); no fine-tuning is ``task.steps=0``.

Rows (``rank=-1``, over all ranks): ``eval_loss``, ``eval_perplexity``,
``eval_accuracy``, ``eval_tokens`` with ``phase`` = the evaluation corpus;
``eval_remote_bytes`` (bytes sent to other ranks while evaluating, all ranks, at their
wire size) and ``eval_time`` (s, the slowest rank) with ``phase`` = the corpus;
``ct_all``, ``ct_remote`` per MoE layer and corpus; ``train_loss`` per step
(``sample`` = step, mean over ranks); ``finetune_time``, ``trainable_params``,
``frozen_params``. With ``task.timing_iters > 0``, a timed prefill of the fine-tuned model
(:func:`timing_probe`) adds the rows of ``task=prefill`` (``ttft``, ``a2a_time``,
``bytes``, ``rows``, and ``ct_all`` etc. with an empty ``phase``).

Shapes: B sequences per rank, S sequence length, V vocabulary, T tokens, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict

import torch.nn.functional as nnf
from torch import nn
from tqdm import tqdm

from ..data.batches import batch_iterator, token_ids
from ..ep import Recorder
from ..ep.measure import clock, iterations, mean_over_ranks, slowest
from ..models.ep_block import EPMoEBlock, ep_placements
from ..models.families import family_of
from ..models.runtime import sync_gradients
from ..records import row
from ..spec import RunSpec
from . import model as model_task
from .schema import Gated, HeldOut, Text, Trained, at_least, workload_task
from .training import adamw, clip_global_grad_norm, evaluate_rank_model, finetuning_schedule, rank_eval_ids


@dataclass
class Config(Gated, Text, HeldOut, Trained):
    """task=finetune: Occult's modified fine-tuning, then held-out evaluation on both
    domains (:mod:`occult.tasks.finetune`). ``tokens_per_rank``: held-out tokens per rank
    and domain (0: the whole split); ``timing_iters``: timed prefill forwards after it."""

    steps: int = 100
    tokens_per_rank: int = 4096
    timing_iters: int = 0

    entry: ClassVar[str] = "occult.tasks.finetune.run"
    prepare: ClassVar[str] = "occult.tasks.finetune.prepare"
    whole_model: ClassVar[bool] = True
    expert_parallel_only: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        for name in ("steps", "tokens_per_rank", "timing_iters"):
            at_least(name, getattr(self, name), 0)

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if not self.steps:
            out["lr"] = "not read with task.steps=0 (no fine-tuning)"
        return out


GRAD_CLIP = 1.0
FINETUNE_WEIGHT_DECAY = 0.0


def prepare(spec: RunSpec) -> RunSpec:
    """In the launching process: the checkpoint (pre-training the proxy if needed) and,
    for similarity pruning without a similarity file, the router profile."""
    from .profiling import ensure_similarity_file
    return ensure_similarity_file(model_task.prepare(spec))


def moe_modules(model: nn.Module, family) -> list:
    """The model's MoE blocks (expert-parallel or the family's own): routers, routed
    experts and shared experts live in them."""
    slots = [getattr(layer.mlp, "moe", layer.mlp) for layer in model.model.layers]    # ScMoE: inside its shortcut
    return [m for m in slots if isinstance(m, EPMoEBlock) or family.is_moe_block(m)]


def freeze_non_moe(model: nn.Module, family) -> list:
    """Freezes every weight outside the MoE blocks and unfreezes the blocks' weights;
    returns the trainable parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = []
    for block in moe_modules(model, family):
        for p in block.parameters():
            p.requires_grad_(True)
            trainable.append(p)
    if not trainable:
        raise ValueError("task=finetune: the model has no MoE blocks to train")
    return trainable


def finetune(ctx, model: nn.Module, family, batches, steps: int, lr: float, progress: bool = False) -> list:
    """``steps`` AdamW steps on the MoE weights (the rest frozen); returns this rank's
    training losses. Every rank must run the same number of steps."""
    trainable = freeze_non_moe(model, family)
    model.train()
    # fine-tuning's recipe (occult.tasks.training: why it differs from pre-training's)
    opt, sched = adamw(trainable, lr, FINETUNE_WEIGHT_DECAY, finetuning_schedule(steps))
    losses = []
    bar = tqdm(range(steps), desc="finetune", disable=not progress, mininterval=5.0)
    for _ in bar:
        x_BS, y_BS = (b.to(ctx.device) for b in next(batches))
        logits_BSV = model(input_ids=x_BS).logits
        loss = nnf.cross_entropy(logits_BSV.flatten(0, 1), y_BS.flatten())
        loss.backward()
        sync_gradients(ctx, model)
        clip_global_grad_norm(ctx, model, GRAD_CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def timing_probe(ctx, cfg, tok, model) -> list:
    """``task.timing_iters`` timed prefill forwards of the fine-tuned model (after one
    warm-up; :class:`occult.tasks.model.PrefillWorkload`, ``task.batch_size`` sequences per
    rank), then the last one's collectives and routing: the rows the benchmarks and the
    cost model read (``ttft``, ``a2a_time``, ``bytes``, ``tokens``)."""
    from .model import PrefillWorkload
    from .common import comm_rows, routing_rows

    work = PrefillWorkload(ctx, cfg.replace(task=workload_task(cfg.task, "prefill")), tok, model)
    rec = Recorder(rank=ctx.rank)
    rows = []
    for sample in iterations(ctx.ep, 1, cfg.task.timing_iters, before=rec.clear):
        rows += work.step(rec, sample)
    return rows + comm_rows(rec) + routing_rows(ctx, rec, ep_placements(model))


def eval_corpora(cfg) -> list:
    """The evaluation domains: the pre-training corpus and the fine-tuning corpus."""
    return list(dict.fromkeys([cfg.pretrain.corpus, cfg.task.corpus]))


def run(ctx, spec: RunSpec) -> list:
    """task=finetune on one rank: fine-tune the MoE weights, then evaluate both domains."""
    t = spec.task
    fam = family_of(spec.model.family)
    model, tok, rows = model_task.setup(ctx, spec, t.call_tokens())
    placements = ep_placements(model)
    if not placements:
        raise ValueError(f"task=finetune runs on an expert-parallel system; system={spec.system.name} has no "
                         "expert-parallel MoE blocks")
    train_ids = token_ids(t.corpus, t.split, tok)
    batches = batch_iterator(train_ids, t.batch_size, t.seq_len, seed=spec.seed * 1000 + ctx.rank + 1)
    t0 = clock()
    losses = finetune(ctx, model, fam, batches, t.steps, t.lr, progress=ctx.rank == 0) if t.steps else []
    took = slowest(ctx.ep, clock() - t0)
    losses = mean_over_ranks(ctx.ep, losses)
    results = {}
    for corpus in eval_corpora(spec):
        ids_N = rank_eval_ids(ctx, token_ids(corpus, "validation", tok), t.seq_len, t.tokens_per_rank)
        results[corpus] = evaluate_rank_model(ctx, model, ids_N, t.seq_len, placements)
        if ctx.rank == 0:
            r = results[corpus]
            print(f"eval {corpus}: loss {r['loss']:.4f} ppl {r['perplexity']:.2f} acc {r['accuracy']:.4f} "
                  f"C_T {sum(r['ct_all'].values()) / len(r['ct_all']):.3f} "
                  f"remote {r['remote_bytes'] / max(r['tokens'], 1):.0f} B/token", flush=True)
    if t.timing_iters:
        rows += timing_probe(ctx, spec, tok, model)
    if ctx.rank != 0:
        return rows
    trainable = sum(p.numel() for block in moe_modules(model, fam) for p in block.parameters())
    total = sum(p.numel() for p in model.parameters())
    rows += [row("finetune_time", took, "s"), row("trainable_params", trainable, "params", rank=0),
             row("frozen_params", total - trainable, "params", rank=0)]
    rows += [row("train_loss", v, "nats/token", sample=i) for i, v in enumerate(losses)]
    for corpus, r in results.items():
        rows += [row("eval_loss", r["loss"], "nats/token", phase=corpus),
                 row("eval_perplexity", r["perplexity"], "ratio", phase=corpus),
                 row("eval_accuracy", r["accuracy"], "ratio", phase=corpus),
                 row("eval_tokens", r["tokens"], "tokens", phase=corpus),
                 row("eval_remote_bytes", r["remote_bytes"], "bytes", phase=corpus),
                 row("eval_time", r["seconds"], "s", phase=corpus)]
        for layer in sorted(r["ct_all"]):
            rows += [row("ct_all", r["ct_all"][layer], "devices/token", layer=layer, phase=corpus),
                     row("ct_remote", r["ct_remote"][layer], "devices/token", layer=layer, phase=corpus)]
    return rows
