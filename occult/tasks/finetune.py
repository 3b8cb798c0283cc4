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
``ct_all``, ``ct_remote`` per MoE layer and corpus; ``train_loss`` per step
(``sample`` = step, mean over ranks); ``finetune_time``, ``trainable_params``,
``frozen_params``.

Shapes: B sequences per rank, S sequence length, V vocabulary, T tokens, K top-k.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from ..data.batches import batch_iterator, eval_batches, num_eval_windows, token_ids
from ..ep import Recorder, devices_per_token
from ..ep.accounting import recording
from ..ep.measure import clock, slowest
from ..models.ep_block import EPMoEBlock
from ..models.families import family_of
from ..models.runtime import expert_parameters, sync_gradients
from ..records import row
from . import model as model_task

EVAL_WINDOWS_PER_BATCH = 8       # held-out windows per forward call
GRAD_CLIP = 1.0


def prepare(cfg_dict: dict) -> dict:
    """In the launching process: the checkpoint (pre-training the proxy if needed) and,
    for similarity pruning without a similarity file, the router profile."""
    from .profiling import ensure_similarity_file
    return ensure_similarity_file(model_task.prepare(cfg_dict))


def moe_modules(model: nn.Module, family) -> list:
    """The model's MoE blocks (expert-parallel or the family's own): routers, routed
    experts and shared experts live in them."""
    return [layer.mlp for layer in model.model.layers
            if isinstance(layer.mlp, EPMoEBlock) or family.is_moe_block(layer.mlp)]


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


def clip_global_grad_norm(ctx, model: nn.Module, max_norm: float) -> float:
    """Clips all gradients to a global L2 norm over every rank's weights (replicated
    weights counted once, each rank's experts added up); the same scale on every rank,
    so replicas stay identical. Returns the norm before clipping."""
    experts = expert_parameters(model)
    grads = [(id(p) in experts, p.grad) for p in model.parameters() if p.grad is not None]
    sq = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for is_expert, g in grads:
        sq[int(is_expert)] += g.detach().double().pow(2).sum()
    if ctx.world_size > 1:
        expert_sq = sq[1:].clone()
        dist.all_reduce(expert_sq, group=ctx.ep.group)
        sq[1] = expert_sq[0]
    norm = float(sq.sum().sqrt())
    if norm > max_norm:
        for _, g in grads:
            g.mul_(max_norm / (norm + 1e-12))
    return norm


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to 0.1."""
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def finetune(ctx, model: nn.Module, family, batches, steps: int, lr: float, progress: bool = False) -> list:
    """``steps`` AdamW steps on the MoE weights (the rest frozen); returns this rank's
    training losses. Every rank must run the same number of steps."""
    trainable = freeze_non_moe(model, family)
    model.train()
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
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


@torch.no_grad()
def evaluate_rank_model(ctx, model: nn.Module, ids_N: torch.Tensor, seq_len: int, placements: dict) -> dict:
    """Held-out loss / perplexity / next-token accuracy over all ranks' windows of
    ``ids_N`` (this rank's block), through the rank model (pruning active), and C_T per
    MoE layer from the recorded routing. ``placements``: {layer: Placement}."""
    model.eval()
    rec = Recorder(rank=ctx.rank)
    total, correct, n = 0.0, 0, 0
    with recording(rec):
        for x_BS, y_BS in eval_batches(ids_N, EVAL_WINDOWS_PER_BATCH, seq_len):
            x_BS, y_BS = x_BS.to(ctx.device), y_BS.to(ctx.device)
            logits_BSV = model(input_ids=x_BS).logits
            total += nnf.cross_entropy(logits_BSV.flatten(0, 1).float(), y_BS.flatten(), reduction="sum").item()
            correct += (logits_BSV.argmax(-1) == y_BS).sum().item()
            n += y_BS.numel()
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
    if ctx.world_size > 1:
        dist.all_reduce(sums, group=ctx.ep.group)
    total, correct, n = sums[-1].tolist()
    loss = total / max(n, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / max(n, 1.0),
            "tokens": int(n),
            "ct_all": {layer: float(sums[i, 0] / sums[i, 2]) for i, layer in enumerate(layers)},
            "ct_remote": {layer: float(sums[i, 1] / sums[i, 2]) for i, layer in enumerate(layers)}}


def _placements(model: nn.Module) -> dict:
    """{layer: Placement} of the model's expert-parallel blocks."""
    return {m.layer_idx: m.dispatcher.placement for m in model.modules() if isinstance(m, EPMoEBlock)}


def _mean_over_ranks(ctx, values: list) -> list:
    """Element-wise mean of a list of floats over ranks (every rank has the same length)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1 and t.numel():
        dist.all_reduce(t, group=ctx.ep.group)
        t /= ctx.world_size
    return t.tolist()


def eval_corpora(cfg) -> list:
    """The evaluation domains: the pre-training corpus and the fine-tuning corpus."""
    return list(dict.fromkeys([cfg.pretrain.corpus, cfg.task.corpus]))


def run_rank(ctx, cfg_dict: dict) -> list:
    """task=finetune on one rank: fine-tune the MoE weights, then evaluate both domains."""
    cfg = OmegaConf.create(cfg_dict)
    t = cfg.task
    fam = family_of(cfg.model.family)
    model, tok, rows = model_task.setup(ctx, cfg)
    placements = _placements(model)
    if not placements:
        raise ValueError(f"task=finetune runs on an expert-parallel system; system={cfg.system.name} has no "
                         "expert-parallel MoE blocks")
    train_ids = token_ids(t.corpus, t.split, tok)
    batches = batch_iterator(train_ids, t.batch_size, t.seq_len, seed=cfg.seed * 1000 + ctx.rank + 1)
    t0 = clock()
    losses = finetune(ctx, model, fam, batches, t.steps, t.lr, progress=ctx.rank == 0) if t.steps else []
    took = slowest(ctx.ep, clock() - t0)
    losses = _mean_over_ranks(ctx, losses)
    results = {}
    for corpus in eval_corpora(cfg):
        ids_N = rank_eval_ids(ctx, token_ids(corpus, "validation", tok), t.seq_len, t.tokens_per_rank)
        results[corpus] = evaluate_rank_model(ctx, model, ids_N, t.seq_len, placements)
        if ctx.rank == 0:
            r = results[corpus]
            print(f"eval {corpus}: loss {r['loss']:.4f} ppl {r['perplexity']:.2f} acc {r['accuracy']:.4f} "
                  f"C_T {sum(r['ct_all'].values()) / len(r['ct_all']):.3f}", flush=True)
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
                 row("eval_tokens", r["tokens"], "tokens", phase=corpus)]
        for layer in sorted(r["ct_all"]):
            rows += [row("ct_all", r["ct_all"][layer], "devices/token", layer=layer, phase=corpus),
                     row("ct_remote", r["ct_remote"][layer], "devices/token", layer=layer, phase=corpus)]
    return rows
