"""A model on one rank: building it for the configured system, running micro-batches
as co-executed strands, and (from :mod:`occult.models.grad_sync`) data-parallel gradient
synchronisation for its replicated weights.

Under expert parallelism each rank holds its own experts (their gradients arrive
through the backward all-to-alls) and a replica of everything else (whose
gradients are averaged over ranks). Both are scaled so that a step equals a
step on the concatenated batch of all ranks.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import nn

from ..ep import system_config
from ..ep.strands import co_execute
from ..schemas import ModelConf, typed
from .build import hf_config, init_model, load_checkpoint, to_expert_parallel
from .families import family_of, gate_rule
from .grad_sync import expert_parameters, sync_gradients  # noqa: F401 - the task modules' names for them


def base_model(cfg, vocab_size: int, checkpoint: Optional[str] = None, device="cpu") -> nn.Module:
    """The full single-device model: from ``checkpoint`` (a local folder), or seeded random
    (built on the host), then on ``device`` in ``model.dtype``."""
    m = typed(ModelConf, cfg.model)
    fam = family_of(m.family)
    if checkpoint:
        model = load_checkpoint(fam, checkpoint)
    else:
        model = init_model(fam, hf_config(m, vocab_size), cfg.seed)
    return model.to(device=device, dtype=getattr(torch, m.dtype))


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


def micro_batches(x_BS: torch.Tensor, n: int) -> list:
    """The rows of ``x_BS`` cut into ``n`` micro-batches of sizes that differ by at most one."""
    return list(torch.tensor_split(x_BS, n))


def forward_micro_batches(model: nn.Module, device, inputs: list) -> list:
    """``model(**kwargs)`` for each ``kwargs`` of ``inputs`` (one per micro-batch), the calls
    co-executed as strands when there are several (:mod:`occult.ep.strands`: one micro-batch's
    collectives in flight while another computes, layer by layer). Only the forward
    co-executes: a training step then runs each micro-batch's backward in turn
    (:meth:`occult.models.grad_sync.GradSync.backward`). On CUDA the autograd engine runs
    every backward node of a device on one thread that the strands' backward calls would
    share, so a strand handing its turn over inside it would stop that thread for all of
    them; and one backward call over every micro-batch would order their collectives by
    sequence numbers that are kept per thread, not by the schedule."""
    return co_execute([partial(model, **kwargs) for kwargs in inputs], device)
