"""What pre-training and fine-tuning share: the optimiser and its learning-rate schedule,
the global gradient clip over ranks, and held-out evaluation (one process, or a rank
model over every rank).

Both recipes are AdamW (betas 0.9, 0.95) with a linear warm-up and a cosine decay to a
tenth of the peak rate, and both evaluate held-out text as the summed next-token loss
over every target and the argmax's accuracy. They differ where their starting points do,
and the difference is kept (:func:`pretraining_schedule`, :func:`finetuning_schedule`):

* **pre-training** (:mod:`occult.tasks.pretrain`) starts from random weights and trains
  every weight: a warm-up over the first twentieth of the steps, as a ramp on a cosine
  that runs from step 0, and weight decay 0.01 on every weight. It made the cached
  proxies that every result rests on: changing it re-trains them (a new cache key) and
  every figure built on them.
* **fine-tuning** (:mod:`occult.tasks.finetune`) starts from the trained proxy with
  fresh AdamW moments and moves only the MoE weights, on a second domain, for a hundred
  steps: a longer warm-up (the first tenth), the cosine starting after it, and no weight
  decay, which would pull the trained experts and routers toward zero whatever the data
  and so differ between the pruned and the standard fine-tuning that the study compares.

Shapes: B sequences, S sequence length, V vocabulary, T tokens, K top-k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf
from torch import nn

from ..data.batches import eval_batches, num_eval_windows
from ..ep import Recorder, devices_per_token
from ..ep.accounting import recording
from ..ep.measure import clock, slowest, sum_over_ranks
from ..models.runtime import expert_parameters

BETAS = (0.9, 0.95)
EVAL_WINDOWS_PER_BATCH = 8       # held-out windows per forward call of a rank model


@dataclass(frozen=True)
class Schedule:
    """A linear warm-up over ``warmup`` steps and a cosine decay to ``floor`` of the peak
    rate at step ``steps``. ``overlap``: the cosine runs from step 0, scaled by the warm-up's
    ramp (pre-training); else it starts when the warm-up ends (fine-tuning)."""

    steps: int
    warmup: int
    overlap: bool
    floor: float = 0.1

    def factor(self, step: int) -> float:
        """The learning rate of ``step`` over the peak."""
        if self.overlap:
            ramp = min(1.0, (step + 1) / self.warmup)
            return ramp * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * min(step, self.steps) / self.steps)))
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def pretraining_schedule(steps: int) -> Schedule:
    """Pre-training's: a warm-up over the first twentieth of ``steps`` on a cosine from step 0."""
    return Schedule(steps, max(1, steps // 20), overlap=True)


def finetuning_schedule(steps: int) -> Schedule:
    """Fine-tuning's: a warm-up over the first tenth of ``steps``, then the cosine."""
    return Schedule(steps, max(1, steps // 10), overlap=False)


def adamw(params, lr: float, weight_decay: float, schedule: Schedule):
    """``(optimizer, scheduler)``: AdamW with :data:`BETAS` and ``schedule`` (stepped once
    per optimiser step)."""
    opt = torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)


def clip_global_grad_norm(ctx, model: nn.Module, max_norm: float) -> float:
    """Clips all gradients to a global L2 norm over every rank's weights (replicated
    weights counted once, each rank's experts added up); the same scale on every rank,
    so replicas stay identical. Returns the norm before clipping."""
    experts = expert_parameters(model)
    grads = [(id(p) in experts, p.grad) for p in model.parameters() if p.grad is not None]
    sq = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for is_expert, g in grads:
        sq[int(is_expert)] += g.detach().double().pow(2).sum()
    sq[1:] = sum_over_ranks(ctx.ep, sq[1:].clone())
    norm = float(sq.sum().sqrt())
    if norm > max_norm:
        for _, g in grads:
            g.mul_(max_norm / (norm + 1e-12))
    return norm


def _scores(total: float, correct: float, n: float) -> dict:
    """Loss (nats/token), perplexity and accuracy of summed held-out figures."""
    loss = total / max(n, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "accuracy": correct / max(n, 1), "tokens": int(n)}


def _heldout_sums(model: nn.Module, batches, device) -> tuple:
    """(summed next-token loss, correct argmaxes, targets) of ``model`` over ``batches``."""
    total, correct, n = 0.0, 0, 0
    for x_BS, y_BS in batches:
        x_BS, y_BS = x_BS.to(device), y_BS.to(device)
        logits_BSV = model(input_ids=x_BS).logits
        total += nnf.cross_entropy(logits_BSV.flatten(0, 1).float(), y_BS.flatten(), reduction="sum").item()
        correct += (logits_BSV.argmax(-1) == y_BS).sum().item()
        n += y_BS.numel()
    return total, correct, n


@torch.no_grad()
def evaluate(model: nn.Module, ids_N: torch.Tensor, batch_size: int, seq_len: int, max_batches: int = 0) -> dict:
    """Held-out loss (nats/token), perplexity and next-token accuracy of a one-process
    model over the eval windows of ``ids_N`` (the first ``max_batches`` batches; 0: all)."""
    was_training = model.training
    model.eval()
    batches = eval_batches(ids_N, batch_size, seq_len)
    if max_batches:
        batches = (b for i, b in zip(range(max_batches), batches))
    device = next(model.parameters()).device
    out = _scores(*_heldout_sums(model, batches, device))
    model.train(was_training)
    return out


def rank_eval_ids(ctx, ids_N: torch.Tensor, seq_len: int, tokens_per_rank: int) -> torch.Tensor:
    """This rank's block of held-out windows: every rank gets the same number of windows
    (at most ``tokens_per_rank // seq_len``), so all ranks make the same forward calls."""
    per_rank = num_eval_windows(ids_N.numel(), seq_len) // ctx.world_size
    if tokens_per_rank > 0:
        per_rank = min(per_rank, max(1, tokens_per_rank // seq_len))
    if per_rank < 1:
        raise ValueError(f"task.seq_len={seq_len}: the held-out split has too few tokens for one "
                         f"window per rank on {ctx.world_size} ranks")
    start = ctx.rank * per_rank * seq_len
    return ids_N[start:start + per_rank * seq_len + 1]


def remote_bytes(rec: Recorder, rank: int) -> float:
    """Bytes this rank sent to other ranks in the recorder's collectives (as they crossed:
    compressed payloads at their wire size)."""
    return float(sum(n * ev.row_bytes for ev in rec.comm for dst, n in enumerate(ev.rows_P) if dst != rank))


@torch.no_grad()
def evaluate_rank_model(ctx, model: nn.Module, ids_N: torch.Tensor, seq_len: int, placements: dict) -> dict:
    """Held-out loss / perplexity / next-token accuracy over all ranks' windows of
    ``ids_N`` (this rank's block), through the rank model (pruning active), the bytes sent
    to other ranks, the slowest rank's seconds, and C_T per MoE layer from the recorded
    routing. ``placements``: {layer: Placement}."""
    model.eval()
    rec = Recorder(rank=ctx.rank)
    t0 = clock()
    with recording(rec):
        total, correct, n = _heldout_sums(model, eval_batches(ids_N, EVAL_WINDOWS_PER_BATCH, seq_len), ctx.device)
    seconds = slowest(ctx.ep, clock() - t0)
    remote = sum_over_ranks(ctx.ep, torch.tensor([remote_bytes(rec, ctx.rank)], dtype=torch.float64,
                                                 device=ctx.device))
    layers = sorted({layer for layer, *_ in rec.routing})
    # per layer: distinct devices (all), distinct remote devices, tokens
    sums = torch.zeros(len(layers) + 1, 3, dtype=torch.float64, device=ctx.device)
    sums[-1] = torch.tensor([total, correct, n], dtype=torch.float64, device=ctx.device)
    for i, layer in enumerate(layers):
        ids_TK = torch.cat([ids for li, ids, *_ in rec.routing if li == layer])
        hits_T = devices_per_token(ids_TK, placements[layer])
        home_local_T = (placements[layer].device_E[ids_TK] == ctx.rank).any(dim=1)
        sums[i] = torch.tensor([float(hits_T.sum()), float((hits_T - home_local_T.long()).sum()),
                                float(ids_TK.shape[0])], dtype=torch.float64, device=ctx.device)
    sums = sum_over_ranks(ctx.ep, sums)
    return {**_scores(*sums[-1].tolist()), "remote_bytes": float(remote.item()), "seconds": seconds,
            "ct_all": {layer: float(sums[i, 0] / sums[i, 2]) for i, layer in enumerate(layers)},
            "ct_remote": {layer: float(sums[i, 1] / sums[i, 2]) for i, layer in enumerate(layers)}}
