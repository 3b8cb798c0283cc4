"""Affinity-aware EPLB packing: EPLB's replica counts, slots packed onto GPUs with a bonus for
co-activation.

EPLB (:mod:`occult.placement.eplb`) decides how many copies each expert gets from the loads
of a profiling set, then packs the slots onto GPUs by load alone. This packing keeps EPLB's
counts (the library's ``logcnt``) and packs again, greedily: slots in decreasing load (an
expert's load split evenly over its copies), each onto the GPU with free slots that maximises

    score(g) = affinity_weight x co(x, g) - load(g) / mean load

where ``co(x, g)`` is the share of expert x's profiling tokens that also chose an expert
already on GPU g (from the co-activation counts, :func:`occult.placement.coactivation.coactivation`),
and ``load(g)`` the GPU's load after taking the slot. Two copies of one expert never share a
GPU while another GPU has room (a copy on a second GPU is what a replica rule can choose).
``affinity_weight`` 0 is load-only packing (a longest-processing-time greedy; EPLB's own packing
is its balanced packing, which differs in ties); the default, :data:`AFFINITY_WEIGHT`, is ours
(the bonus of a GPU holding all of a token's other experts is then a quarter of the mean
GPU load: enough to group co-activated experts, small enough that load still decides between
GPUs that differ by more than a few slots' load).

Shapes: E logical experts, S physical slots, P GPUs, e = S / P slots per GPU.
"""
from __future__ import annotations

import torch

from ..ep.placement import SlotPlacement
from .eplb import eplb_rebalance, num_redundant_error

AFFINITY_WEIGHT = 0.25


def affinity_slots(load_E: torch.Tensor, co_EE: torch.Tensor, copies_E: torch.Tensor, num_devices: int,
                   affinity_weight: float = AFFINITY_WEIGHT) -> SlotPlacement:
    """One layer's slots packed by load with the co-activation bonus: ``load_E`` pairs per
    expert, ``co_EE`` co-activation counts (diagonal: loads), ``copies_E`` copies per expert
    (sum S, divisible by P). On the host."""
    E, P = load_E.numel(), num_devices
    copies = copies_E.long().cpu()
    S = int(copies.sum())
    if S % P:
        raise ValueError(f"affinity packing: {S} slots do not split over {P} GPUs")
    e = S // P
    co = co_EE.double().cpu().clone()
    co.fill_diagonal_(0)
    share_EE = co / load_E.double().cpu().clamp_min(1).unsqueeze(1)        # share of x's tokens with y
    slot_expert = torch.repeat_interleave(torch.arange(E), copies)
    slot_load = (load_E.double().cpu() / copies.clamp_min(1))[slot_expert]
    order = torch.argsort(slot_load, descending=True, stable=True).tolist()
    mean = float(load_E.sum()) / P if float(load_E.sum()) > 0 else 1.0
    load_P = torch.zeros(P, dtype=torch.float64)
    free_P = torch.full((P,), e, dtype=torch.long)
    held_PE = torch.zeros(P, E, dtype=torch.bool)
    expert_S, device_S = [], []
    for s in order:
        x = int(slot_expert[s])
        co_P = (held_PE.double() @ share_EE[x]).clamp(max=1.0)
        score_P = affinity_weight * co_P - (load_P + slot_load[s]) / mean
        open_P = free_P > 0
        fresh_P = open_P & ~held_PE[:, x]
        allowed = fresh_P if bool(fresh_P.any()) else open_P
        score_P = torch.where(allowed, score_P, torch.full_like(score_P, float("-inf")))
        g = int(torch.argmax(score_P))
        load_P[g] += slot_load[s]
        free_P[g] -= 1
        held_PE[g, x] = True
        expert_S.append(x)
        device_S.append(g)
    # slot ids grouped by GPU (slot s on GPU s // e, as EPLB's), each GPU's experts in slot order
    by_gpu = sorted(range(S), key=lambda i: (device_S[i], expert_S[i]))
    return SlotPlacement(torch.tensor([expert_S[i] for i in by_gpu], dtype=torch.long),
                         torch.tensor([device_S[i] for i in by_gpu], dtype=torch.long), P, E)


def affinity_placements(ids_by_layer: dict, num_experts: int, num_redundant: int, num_devices: int,
                        devices_per_node: int = 0, affinity_weight: float = AFFINITY_WEIGHT,
                        num_groups: int = 1) -> dict:
    """``{layer: SlotPlacement}`` from ``{layer: profiling top-k ids [N, K]}``: EPLB's replica
    counts for ``num_redundant`` extra slots (the real library's ``logcnt``, with the model's
    expert groups ``num_groups``: :func:`occult.placement.eplb.eplb_rebalance`), packed by
    :func:`affinity_slots` (over every GPU, whatever its node)."""
    from .coactivation import coactivation

    err = num_redundant_error(num_redundant, num_experts, num_devices)
    if err:
        raise ValueError(err)
    layers = sorted(ids_by_layer)
    load_LE = torch.stack([torch.bincount(ids_by_layer[layer].flatten().cpu(), minlength=num_experts).double()
                           for layer in layers])
    _, _, logcnt_LE = eplb_rebalance(load_LE, num_experts + num_redundant, num_devices, devices_per_node,
                                  num_groups)
    return {layer: affinity_slots(load_LE[i], coactivation(ids_by_layer[layer].cpu(), num_experts),
                                  logcnt_LE[i], num_devices, affinity_weight)
            for i, layer in enumerate(layers)}


def built_by_affinity(affinity_weight: float) -> dict:
    """The ``built_by`` of an affinity-aware EPLB artifact."""
    from .eplb import EPLB_PIN, EPLB_SOURCE
    return {"name": "eplb_affinity", "impl": "harness", "affinity_weight": affinity_weight,
            "counts_from": {"name": "eplb", "impl": "library", "source": EPLB_SOURCE, "package": EPLB_PIN}}
