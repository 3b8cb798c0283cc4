"""A model on one rank: building it for the configured system, and data-parallel
gradient synchronisation for its replicated weights.

Under expert parallelism each rank holds its own experts (their gradients arrive
through the backward all-to-alls) and a replica of everything else (whose
gradients are averaged over ranks). Both are scaled so that a step equals a
step on the concatenated batch of all ranks.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..ep import system_config
from ..ep.replicas import sum_replica_gradients
from .build import hf_config, init_model, load_checkpoint, to_expert_parallel
from .ep_block import EPMoEBlock
from .families import family_of, gate_rule


def base_model(cfg, vocab_size: int, checkpoint: Optional[str] = None, device="cpu") -> nn.Module:
    """The full single-device model: from ``checkpoint`` (a local folder), or seeded random
    (built on the host), then on ``device`` in ``model.dtype``."""
    fam = family_of(cfg.model.family)
    if checkpoint:
        model = load_checkpoint(fam, checkpoint)
    else:
        model = init_model(fam, hf_config(cfg.model, vocab_size), cfg.seed)
    return model.to(device=device, dtype=getattr(torch, cfg.model.get("dtype", "float32")))


def make_rank_model(ctx, model: nn.Module, cfg, placements: Optional[dict] = None, system=None,
                    tokens_per_rank: int = 0) -> nn.Module:
    """Turns the full model into this rank's model for ``system`` (default ``cfg.system``;
    in place): each MoE block becomes an expert-parallel block with the system built for
    its layer (``placements``: {layer: Placement} overriding the system's); a system that
    builds no dispatcher (the reference) leaves the model as it is. ``tokens_per_rank``: the
    tokens a rank's layer call holds (what a system with fixed buffers is sized by; 0: none)."""
    config = system_config(cfg.system if system is None else system)
    if tokens_per_rank:
        config = config.sized(tokens_per_rank)
    if not config.expert_parallel:
        return model
    E = cfg.model.num_experts

    def dispatcher(layer_idx: int):
        return config.build(ctx.ep, layer_idx, E, (placements or {}).get(layer_idx))

    return to_expert_parallel(model, family_of(cfg.model.family), dispatcher, gate_rule(cfg.model))


def expert_parameters(model: nn.Module) -> set:
    """ids of the parameters that belong to this rank's routed experts."""
    return {id(p) for m in model.modules() if isinstance(m, EPMoEBlock)
            for p in m.experts.parameters()}


def sync_gradients(ctx, model: nn.Module) -> None:
    """Sums each copied expert's gradient over its copies (a slot placement's, :mod:`occult.ep.replicas`),
    averages replicated weights' gradients over ranks (one all-reduce) and scales the
    experts' by 1/P, so that the step is the step of the mean loss over all ranks."""
    for block in model.modules():          # a replicated expert's gradient: the sum over its copies
        if isinstance(block, EPMoEBlock):
            sum_replica_gradients(block.experts, block.dispatcher.placement, ctx.ep)
    P = ctx.world_size
    if P == 1:
        return
    experts = expert_parameters(model)
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ctx.ep.group)
    flat /= P
    offset = 0
    for p in replicated:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n
    for p in model.parameters():
        if id(p) in experts and p.grad is not None:
            p.grad /= P
