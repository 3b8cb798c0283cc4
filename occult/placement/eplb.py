"""EPLB, DeepSeek's expert-parallelism load balancer, the real library, and the slot
placements it builds.

``eplb`` (DeepSeek's ``eplb.py`` from deepseek-ai/EPLB at commit
d52c72d5b2f2fb4c41afbf8eb21366820239913d, MIT, packaged unmodified as the wheel
``eplb==0.0.0+d52c72d`` that ``make venv`` installs from ../shared/wheels) is imported
lazily, here only. From the expert loads of a profiling set it returns, per layer,
``phy2log`` (physical slot -> logical expert), ``log2phy`` and ``logcnt``:
``rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_gpus)``,
hierarchical (groups packed to nodes, then GPUs) when the groups divide over the nodes,
else global. The groups are the model's expert groups (``model.n_group``, the groups its
router limits a token to; DeepSeek-V3's serving passes them), else one group: EPLB's
global policy, which may put any expert's copies on any node. (Never the nodes themselves:
one group per node pins each group of E / nodes experts to its node, and node packing then
has nothing to move.) EPLB balances load only; co-activation (C_T) is not its concern.

A slot placement artifact (format :data:`SLOT_FORMAT`, one JSON file) holds every layer's
slots (``expert_S``, ``device_S``), the world it is for, and ``built_by`` (what built it:
``{"name": "eplb", "impl": "library", "source": ...}``), with free-form ``meta`` (the
profiling set, the loads).

Shapes: L layers, E logical experts, S = E + num_redundant physical slots, P devices.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..ep.placement import SlotPlacement

SLOT_FORMAT = "occult-slots/v1"
EPLB_SOURCE = "deepseek-ai/EPLB@d52c72d5b2f2fb4c41afbf8eb21366820239913d (eplb.py, MIT)"
EPLB_PIN = "eplb==0.0.0+d52c72d"


def num_redundant_error(num_redundant: int, num_experts: int, world_size: int) -> str:
    """Why EPLB cannot place ``num_redundant`` extra copies of E experts on P devices (one
    line naming ``task.num_redundant``), or "" when it can."""
    S = num_experts + num_redundant
    allowed = [r for r in range(0, num_experts + 1) if (num_experts + r) % world_size == 0][:4]
    if num_redundant < 0:
        return f"task.num_redundant={num_redundant}: must be >= 0 (redundant experts: extra physical slots)"
    if S % world_size:
        return (f"task.num_redundant={num_redundant}: EPLB needs the physical count E + num_redundant = {S} "
                f"divisible by the {world_size} GPUs; allowed values include {allowed} (E/8 = "
                f"{num_experts // 8}, E/4 = {num_experts // 4} where they divide)")
    return ""


def _eplb():
    try:
        import eplb
    except ImportError as exc:      # the wheel is installed by make venv
        raise ImportError(f"task.placement=eplb needs DeepSeek's EPLB ({EPLB_PIN}, installed by make venv "
                          "from ../shared/wheels)") from exc
    return eplb


def eplb_groups(num_groups: int, num_experts: int, num_nodes: int) -> int:
    """The expert groups EPLB is given: the model's ``num_groups`` (``model.n_group``) when
    they split E and divide over the nodes (its hierarchical policy), else 1 (its global
    policy)."""
    G = int(num_groups or 1)
    return G if G > 1 and num_experts % G == 0 and G % num_nodes == 0 else 1


def eplb_rebalance(load_LE: torch.Tensor, num_slots: int, num_devices: int, devices_per_node: int = 0,
                   num_groups: int = 1):
    """EPLB's ``rebalance_experts`` on the loads ``load_LE`` for ``num_slots`` physical slots on
    ``num_devices`` GPUs (``devices_per_node``: 0, one node), with the model's expert groups
    ``num_groups`` (``model.n_group``; :func:`eplb_groups`). Returns ``(phy2log_LS,
    log2phy_LEX, logcnt_LE)`` as the library returns them."""
    E = load_LE.shape[1]
    nodes = num_devices // devices_per_node if devices_per_node else 1
    groups = eplb_groups(num_groups, E, nodes)
    return _eplb().rebalance_experts(load_LE.double().cpu(), num_slots, groups, nodes, num_devices)


def eplb_placements(load_by_layer: dict, num_redundant: int, num_devices: int,
                    devices_per_node: int = 0, num_groups: int = 1) -> dict:
    """``{layer: SlotPlacement}`` built by EPLB from ``{layer: load_E}`` (pairs per expert on
    the profiling set) with ``num_redundant`` extra slots (``num_groups``: the model's expert
    groups, :func:`eplb_rebalance`)."""
    layers = sorted(load_by_layer)
    load_LE = torch.stack([torch.as_tensor(load_by_layer[layer], dtype=torch.float64, device="cpu")
                           for layer in layers])
    E = load_LE.shape[1]
    err = num_redundant_error(num_redundant, E, num_devices)
    if err:
        raise ValueError(err)
    phy2log_LS, _, logcnt_LE = eplb_rebalance(load_LE, E + num_redundant, num_devices, devices_per_node,
                                                num_groups)
    out = {}
    for i, layer in enumerate(layers):
        pl = SlotPlacement.from_phy2log(phy2log_LS[i], num_devices, E)
        if not torch.equal(pl.copies_E(), logcnt_LE[i].long()):     # the library's own count of copies
            raise AssertionError(f"EPLB layer {layer}: logcnt disagrees with phy2log")
        out[layer] = pl
    return out


def built_by_eplb() -> dict:
    """The ``built_by`` of an EPLB artifact: the library and where it comes from."""
    return {"name": "eplb", "impl": "library", "source": EPLB_SOURCE, "package": EPLB_PIN}


def save_slot_placements(path, placements: dict, built_by: dict, meta: dict) -> Path:
    """Writes ``{layer: SlotPlacement}`` as a slot placement artifact."""
    first = next(iter(placements.values()))
    doc = {"format": SLOT_FORMAT, "built_by": built_by, "num_devices": first.num_devices,
           "num_experts": first.num_experts, "num_slots": first.num_slots, "meta": meta,
           "layers": {str(int(layer)): {"expert_S": pl.expert_S.tolist(), "device_S": pl.device_S.tolist()}
                      for layer, pl in sorted(placements.items())}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


def load_slot_placements(path) -> tuple[dict, dict]:
    """Reads a slot placement artifact: ``({layer: SlotPlacement}, doc without its layers)``.
    Raises ``ValueError`` naming the file when it is malformed."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable slot placement artifact: {err}") from err
    if not isinstance(doc, dict) or doc.get("format") != SLOT_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: format must be {SLOT_FORMAT!r}, got {got!r}")
    try:
        P, E = int(doc["num_devices"]), int(doc["num_experts"])
        placements = {int(k): SlotPlacement(torch.tensor(v["expert_S"], dtype=torch.long, device="cpu"),
                                            torch.tensor(v["device_S"], dtype=torch.long, device="cpu"), P, E)
                      for k, v in doc["layers"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{path}: malformed slot placement artifact: {err}") from err
    if not placements:
        raise ValueError(f"{path}: no layers")
    return placements, {k: v for k, v in doc.items() if k != "layers"}
