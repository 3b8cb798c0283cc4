"""Placement artifacts and weights in placement order.

A placement artifact is one JSON file with each MoE layer's expert groups,
device by device (format :data:`ARTIFACT_FORMAT`), what built it (``built_by``: the
harness's optimisers name themselves, ``impl: harness``; EPLB's slot artifacts are
:mod:`occult.placement.eplb`'s), and free-form ``meta``
(optimiser, load cap, C_T before and after, ...): what
``experiment=placement_study`` writes and ``system.placement_file`` reads.
:func:`apply_placement_to_weights` permutes fused expert weights and router
rows into a placement's order, so that the permuted model runs with the
contiguous placement and expert ids renamed by :func:`placed_expert_ids`.

Shapes: T tokens, K top-k, E experts, D hidden.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..ep.placement import Placement

# ---------------------------------------------------------------------------
# per-layer placement artifacts
# ---------------------------------------------------------------------------

ARTIFACT_FORMAT = "occult-placements/v1"


def built_by_harness(meta: dict) -> dict:
    """What built a placement of the harness's own optimisers: their names (``meta``'s
    ``optimiser``, or each layer's), ``impl: harness``."""
    names = {meta["optimiser"]} if "optimiser" in meta else {
        v.get("optimiser") for v in (meta.get("layers") or {}).values() if isinstance(v, dict)} - {None}
    return {"name": ", ".join(sorted(names)) or "unnamed", "impl": "harness"}


def save_placements(path, placements: dict[int, Placement], meta: dict, built_by: Optional[dict] = None) -> None:
    """Writes ``{layer: Placement}`` and ``meta`` (JSON-serialisable: optimiser, load cap,
    C_T before/after, ...) as one JSON file: each layer's groups, device by device, and
    ``built_by`` (what built it: name and impl; default :func:`built_by_harness`)."""
    doc = {"format": ARTIFACT_FORMAT,
           "built_by": built_by or built_by_harness(meta),
           "meta": meta,
           "layers": {str(int(layer)): pl.groups() for layer, pl in sorted(placements.items())}}
    try:
        text = json.dumps(doc, indent=1)
    except TypeError as err:
        raise ValueError(f"save_placements({path}): meta is not JSON-serialisable: {err}") from err
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _groups_error(groups) -> Optional[str]:
    """Why ``groups`` is not a valid equal partition of range(E), or None."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) for g in groups):
        return "groups must be a non-empty list of lists of expert ids"
    flat = [x for g in groups for x in g]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
        return "expert ids must be integers"
    if len({len(g) for g in groups}) != 1:
        return f"devices must host equally many experts, got sizes {[len(g) for g in groups]}"
    if sorted(flat) != list(range(len(flat))):
        return f"groups must cover experts 0..{len(flat) - 1} exactly once"
    return None


def load_placements(path) -> tuple[dict[int, Placement], dict]:
    """Reads an artifact written by :func:`save_placements`: ``({layer: Placement}, meta)``.

    Raises ``ValueError`` naming the file (and the layer) when the artifact is malformed.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a JSON placement artifact: {err}") from err
    if not isinstance(doc, dict) or doc.get("format") != ARTIFACT_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: format must be {ARTIFACT_FORMAT!r}, got {got!r}")
    layers, meta = doc.get("layers"), doc.get("meta", {})
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: 'layers' must be a non-empty object {{layer: groups}}")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: 'meta' must be an object")
    placements: dict[int, Placement] = {}
    shape = None
    for key, groups in layers.items():
        if not key.isdigit():
            raise ValueError(f"{path}: layer {key!r}: layer keys must be non-negative integers")
        err = _groups_error(groups)
        if err is not None:
            raise ValueError(f"{path}: layer {key}: {err}")
        layer_shape = (sum(len(g) for g in groups), len(groups))
        if shape is not None and layer_shape != shape:
            raise ValueError(f"{path}: layer {key}: {layer_shape[0]} experts on {layer_shape[1]} devices, "
                             f"other layers have {shape[0]} on {shape[1]}")
        shape = layer_shape
        placements[int(key)] = Placement.from_groups(groups)
    return placements, meta


# ---------------------------------------------------------------------------
# moving weights into placement order
# ---------------------------------------------------------------------------


def _inverse_order(placement: Placement) -> torch.Tensor:
    """Position of each global expert in placement order: shape [E]."""
    order_E = placement.global_order()
    inv_E = torch.empty_like(order_E)
    inv_E[order_E] = torch.arange(order_E.numel(), device=order_E.device)
    return inv_E


def placed_expert_ids(topk_ids_TK: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Expert ids renamed to their row in placement order: [T, K] -> [T, K].

    After :func:`apply_placement_to_weights`, expert ``g`` of the original model is
    expert ``placed_expert_ids(g)`` of the permuted one, and the permuted model's
    placement is contiguous.
    """
    return _inverse_order(placement).to(topk_ids_TK.device)[topk_ids_TK]


def _permute_rows(tensor_E: torch.Tensor, index_E: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor_E[index_E]`` along dim 0, checking that dim 0 has E rows."""
    if tensor_E.shape[0] != index_E.numel():
        raise ValueError(f"{name}: dim 0 has {tensor_E.shape[0]} rows, the placement has "
                         f"{index_E.numel()} experts")
    return tensor_E.index_select(0, index_E.to(tensor_E.device))


def apply_placement_to_weights(expert_weights: dict, router_weight_ED: Optional[torch.Tensor],
                               placement: Placement, inverse: bool = False
                               ) -> tuple[dict, Optional[torch.Tensor]]:
    """Permutes fused expert weights ({name: [E, ...]}) and router rows [E, D] into placement
    order, so that row i holds expert ``placement.global_order()[i]``; ``inverse=True``
    undoes it. Returns new tensors ``(expert_weights, router_weight_ED)``.

    The permuted model computes the same function with expert ids renamed by
    :func:`placed_expert_ids`, and its placement is ``Placement.contiguous(E, P)``.
    """
    index_E = _inverse_order(placement) if inverse else placement.global_order()
    moved = {name: _permute_rows(w, index_E, f"expert_weights[{name!r}]") for name, w in expert_weights.items()}
    router = None if router_weight_ED is None else _permute_rows(router_weight_ED, index_E, "router_weight_ED")
    return moved, router
