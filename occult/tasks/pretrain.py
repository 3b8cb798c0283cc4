"""task=pretrain: train a CPU proxy on Shakespeare so that its routing is a trained
router's, then cache the checkpoint for every later task.

Tiny MoE models trained briefly collapse their routers (many experts never
chosen); a load-balancing loss (Switch-style: E * sum_e f_e * p_e per MoE layer)
keeps every expert in use. The run reports, per MoE layer on held-out text, the
experts never chosen and the busiest expert's load over the mean.

Reproducible: the same config and seed give the same checkpoint bit for bit on one
machine. The tokenizer's training, the batches (a seeded generator) and the weights'
initialisation are deterministic; what varied between two pre-trainings of one config
(4.778 and 4.810 nats, README) was the CPU thread count of the training process, which
orders the float sums of every matmul: measured here, 20 steps of the OLMoE proxy at 1
thread twice gave identical checkpoints, at 2 threads another one. The thread count is
therefore a setting, ``pretrain.threads`` (part of the cache key), set for the training
and restored after. Another CPU (other vector instructions) may still round differently.

Shapes: B batch, S sequence, V vocabulary, T tokens, E experts, K top-k.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch
import torch.nn.functional as nnf
from tqdm import tqdm

from ..data.batches import batch_iterator, token_ids, unigram_loss
from ..data.tokenizer import get_tokenizer
from ..models.build import RouterTap, hf_config, init_model, moe_blocks, save_checkpoint
from ..models.families import family_of, gate_rule
from ..records import row
from ..schemas import ModelConf, PretrainConf, field_default, plain, typed
from ..spec import RunSpec
from .schema import TaskConf
from .training import adamw, evaluate, pretraining_schedule


@dataclass
class Config(TaskConf):
    """task=pretrain: pre-train a CPU proxy (one process; its settings are the top-level
    ``pretrain`` fields) and cache it (:mod:`occult.tasks.pretrain`)."""

    entry: ClassVar[str] = "occult.tasks.pretrain.run"
    whole_model: ClassVar[bool] = True
    uses_system: ClassVar[bool] = False


PRETRAIN_VERSION = 1
PRETRAIN_WEIGHT_DECAY = 0.01
ROOT = Path(__file__).resolve().parents[2]
ARCH_FIELDS = ("family", "num_experts", "top_k", "hidden_size", "expert_ffn_size", "norm_topk_prob",
               "num_layers", "num_heads", "num_shared_experts", "shared_expert_ffn_size", "dense_ffn_size",
               "first_k_dense", "max_position", "hf_overrides")
# fields added after the first proxies were cached: in the key only where they differ from
# their defaults (declared in the model's and the pre-training's schemas), so that the cached
# proxies keep their keys
LATER_ARCH_FIELDS = ("scoring_func", "routed_scaling_factor", "n_group", "topk_group", "balance_loss", "balance_coef",
                     "bias_update_speed")
TRAIN_FIELDS = ("steps", "lr", "batch_size", "seq_len", "balance_coef", "tokenizer_vocab", "corpus", "threads")
# training fields added later, in the key only where they differ from their defaults
LATER_TRAIN_FIELDS = ("eval_batches",)


def proxy_dir(cfg) -> Path:
    """Where the proxy trained with these settings is cached (a hash of them names it)."""
    m, t = plain(typed(ModelConf, cfg.model)), plain(typed(PretrainConf, cfg.pretrain))
    arch = {k: m[k] for k in ARCH_FIELDS}
    arch.update({k: m[k] for k in LATER_ARCH_FIELDS if m[k] != field_default(ModelConf, k)})
    train = {k: t[k] for k in TRAIN_FIELDS}
    train.update({k: t[k] for k in LATER_TRAIN_FIELDS if t[k] != field_default(PretrainConf, k)})
    key = json.dumps({"arch": arch, "train": train,
                      "seed": cfg.seed, "version": PRETRAIN_VERSION}, sort_keys=True)
    return ROOT / "runs" / "cache" / "proxies" / f"{m['name']}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def balance_loss(calls, num_experts: int) -> torch.Tensor:
    """Mean over MoE layers of E * sum_e f_e * p_e (f: share of top-k picks, p: mean router prob)."""
    losses = []
    for logits_TE, ids_TK, _ in calls:
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        f_E = torch.bincount(ids_TK.flatten(), minlength=num_experts).float() / ids_TK.numel()
        losses.append(num_experts * (f_E * probs_TE.mean(0)).sum())
    return torch.stack(losses).mean()


def sequence_balance_loss(calls, rule, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, mean over MoE layers and sequences:
    sum_e f_e P_e per sequence, f_e = E / (K S) * (picks of e in the sequence), P_e the
    sequence's mean of the normalised scores s_e / sum_j s_j."""
    losses = []
    for logits_TE, ids_TK, _ in calls:          # RouterTap's (logits, ids, weights)
        T, E = logits_TE.shape
        K, S = ids_TK.shape[1], T // batch
        s_TE = rule.scores(logits_TE)
        p_BE = (s_TE / s_TE.sum(-1, keepdim=True)).view(batch, S, E).mean(1)
        picks_BE = torch.zeros(batch, E, device=ids_TK.device).scatter_add_(
            1, ids_TK.reshape(batch, S * K), torch.ones(batch, S * K, device=ids_TK.device))
        losses.append((picks_BE * (E / (K * S)) * p_BE).sum(-1).mean())
    return torch.stack(losses).mean()


@torch.no_grad()
def update_correction_bias(model, family, calls, speed: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: each MoE router's
    correction bias moves by ``speed`` towards balance (down for an expert chosen more
    often than the mean in the step, up for one chosen less)."""
    blocks = [block for _, _, block in moe_blocks(model, family)]
    for block, (_, ids_TK, _) in zip(blocks, calls):
        bias_E = block.gate.e_score_correction_bias
        load_E = torch.bincount(ids_TK.flatten(), minlength=bias_E.numel()).float()
        bias_E += speed * torch.sign(load_E.mean() - load_E)


def expert_load(model, family, ids_N, batch_size: int, seq_len: int, max_batches: int) -> list:
    """Per MoE layer on held-out text: (layer, experts never chosen, busiest load / mean load)."""
    tap = RouterTap(model, family)
    evaluate(model, ids_N, batch_size, seq_len, max_batches)
    tap.remove()
    layers = [i for i, _, _ in moe_blocks(model, family)]
    E = moe_blocks(model, family)[0][2].gate.weight.shape[0]
    counts = {i: torch.zeros(E, device="cpu") for i in layers}
    for j, (_, ids_TK, _) in enumerate(tap.calls):
        counts[layers[j % len(layers)]] += torch.bincount(ids_TK.flatten(), minlength=E).float()
    return [(i, int((c == 0).sum()), float(c.max() / c.mean())) for i, c in counts.items()]


def pretrain(cfg, out_dir: Path, progress: bool = True) -> dict:
    """Trains the proxy of ``cfg.model`` with ``cfg.pretrain``; writes the checkpoint,
    metrics (occult.json) and loss curve into ``out_dir``; returns the metrics."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.pretrain.threads)
    try:
        return _pretrain(cfg, out_dir, progress)
    finally:
        torch.set_num_threads(threads)


def _pretrain(cfg, out_dir: Path, progress: bool) -> dict:
    m, t = typed(ModelConf, cfg.model), typed(PretrainConf, cfg.pretrain)
    fam = family_of(m.family)
    tok = get_tokenizer(t.tokenizer_vocab, corpus=t.corpus)
    train_ids, val_ids = token_ids(t.corpus, "train", tok), token_ids(t.corpus, "validation", tok)
    model = init_model(fam, hf_config(m, tok.vocab_size), cfg.seed).train()
    # pre-training's recipe (occult.tasks.training: why it differs from fine-tuning's)
    opt, sched = adamw(model.parameters(), t.lr, PRETRAIN_WEIGHT_DECAY, pretraining_schedule(t.steps))
    tap = RouterTap(model, fam)
    # the model's balancing
    balance, bias_speed = m.balance_loss, m.bias_update_speed
    rule, coef = gate_rule(m), t.balance_coef if m.balance_coef is None else m.balance_coef
    curve, t0 = [], time.perf_counter()
    bar = tqdm(batch_iterator(train_ids, t.batch_size, t.seq_len, cfg.seed, t.steps), total=t.steps,
               desc=f"pretrain {m.name}", disable=not progress, mininterval=2.0)
    for step, (x_BS, y_BS) in enumerate(bar):
        tap.calls.clear()
        logits = model(input_ids=x_BS).logits
        lm = nnf.cross_entropy(logits.flatten(0, 1), y_BS.flatten())
        bal = sequence_balance_loss(tap.calls, rule, x_BS.shape[0]) if balance == "sequence" else \
            balance_loss(tap.calls, m.num_experts)
        (lm + coef * bal).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if bias_speed:
            update_correction_bias(model, fam, tap.calls, bias_speed)
        point = {"step": step + 1, "train_loss": lm.item(), "balance_loss": bal.item()}
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            point["val_loss"] = evaluate(model, val_ids, 16, t.seq_len, max_batches=8)["loss"]
        curve.append(point)
        bar.set_postfix(loss=f"{lm.item():.3f}", bal=f"{bal.item():.2f}")
    tap.remove()
    wall = time.perf_counter() - t0
    held_out = evaluate(model, val_ids, 16, t.seq_len, max_batches=t.eval_batches or 0)
    loads = expert_load(model, fam, val_ids, 16, t.seq_len, max_batches=t.eval_batches or 0)
    metrics = {"model": m.name, "steps": t.steps, "wall_s": wall, "val": held_out,
               "unigram_val_loss": unigram_loss(train_ids, val_ids, tok.vocab_size),
               "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": tok.vocab_size, "threads": torch.get_num_threads(),
               "expert_load": [{"layer": i, "never_chosen": z, "max_over_mean": r} for i, z, r in loads],
               "curve": curve}
    save_checkpoint(model.eval(), out_dir, metrics)
    _plot_curve(curve, out_dir / "loss_curve.png", m.name)
    return metrics


def _plot_curve(curve: list, path: Path, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([p["step"] for p in curve], [p["train_loss"] for p in curve], label="train", lw=0.8)
    ev = [p for p in curve if "val_loss" in p]
    if ev:
        ax.plot([p["step"] for p in ev], [p["val_loss"] for p in ev], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"pre-training {name}")
    ax.legend()
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def is_trained(cfg) -> bool:
    """Whether the proxy of ``cfg.model`` trained with ``cfg.pretrain`` is in the cache."""
    return (proxy_dir(cfg) / "model.safetensors").is_file()


def expected_minutes(cfg) -> Optional[float]:
    """Minutes a pre-training of ``cfg.model`` should take here, from the recorded wall time
    of the cached proxies of the same model name (scaled to ``pretrain.steps``); None when
    there is none."""
    rates = []
    for meta in sorted(proxy_dir(cfg).parent.glob(f"{cfg.model.name}-*/occult.json")):
        try:
            m = json.loads(meta.read_text())
            rates.append(m["wall_s"] / max(m["steps"], 1))
        except (OSError, ValueError, KeyError):
            continue
    return sum(rates) / len(rates) * cfg.pretrain.steps / 60 if rates else None


def announce(cfg) -> str:
    """The line said before a missing proxy is pre-trained: which checkpoint is missing,
    its cache key, the expected time, and how to keep a trained router instead."""
    out = proxy_dir(cfg)
    minutes = expected_minutes(cfg)
    took = (f"about {minutes:.0f} min here (from the cached proxies of {cfg.model.name})" if minutes is not None
            else f"several minutes on 2 cores ({cfg.pretrain.steps} steps)")
    return (f"pre-training model={cfg.model.name} (top_k={cfg.model.top_k}, E={cfg.model.num_experts}): no trained "
            f"checkpoint for this architecture and pretrain settings in {out.parent} (cache key {out.name}); "
            f"expected {took}; it is cached for every later run. To keep the trained proxy and take fewer "
            f"experts per token from its router instead, save its routing (task.save_routing=true) and take "
            f"the top-k of the router logits, as experiment=fig3_lcc does")


def ensure_trained(cfg, progress: bool = True) -> Path:
    """The cached trained proxy of ``cfg.model`` (pre-trains it first when missing, saying so).
    Another process pre-training the same proxy holds its lock file (``<cache key>.lock``)
    until the checkpoint is in the cache: this one waits for it and reads it."""
    import fcntl

    out = proxy_dir(cfg)
    if is_trained(cfg):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_trained(cfg):
            return out
        logging.getLogger("occult").warning(announce(cfg))
        tmp = out.with_name(out.name + ".partial")
        pretrain(cfg, tmp, progress)
        tmp.rename(out)
    return out


def run(ctx, spec: RunSpec) -> list:
    """task=pretrain (one process): trains (or finds) the proxy; rows with its figures."""
    if ctx.world_size != 1:
        raise ValueError(f"task=pretrain trains on one process; use cluster=cpu1 (got world size {ctx.world_size})")
    path = ensure_trained(spec)
    metrics = json.loads((path / "occult.json").read_text())
    rows = [row("val_loss", metrics["val"]["loss"], "nats/token", rank=0),
            row("val_perplexity", metrics["val"]["perplexity"], "ratio", rank=0),
            row("val_accuracy", metrics["val"]["accuracy"], "ratio", rank=0),
            row("unigram_val_loss", metrics["unigram_val_loss"], "nats/token", rank=0),
            row("wall_time", metrics["wall_s"], "s", rank=0),
            row("parameters", metrics["parameters"], "params", rank=0)]
    for ld in metrics["expert_load"]:
        rows.append(row("experts_never_chosen", ld["never_chosen"], "experts", layer=ld["layer"], rank=0))
        rows.append(row("expert_load_max_over_mean", ld["max_over_mean"], "ratio", layer=ld["layer"], rank=0))
    for p in metrics["curve"]:
        rows.append(row("train_loss", p["train_loss"], "nats/token", rank=0, sample=p["step"]))
    print(f"proxy checkpoint: {path}", flush=True)
    return rows
