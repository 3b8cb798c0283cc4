"""Expert placement: which device hosts each expert of a layer, and in which local slot.

Two kinds: :class:`Placement` (equal groups of logical experts, one copy each; replicating
systems add per-batch shadows) and :class:`SlotPlacement` (physical slots, EPLB's layout:
copies of hot experts, unequal numbers of logical experts per device). Both answer
``pair_local`` (the device and local slot that serve each (token, k) pair) and
``local_experts`` (the logical expert of each of a device's local slots), which is all a
dispatcher that sorts pairs by destination needs.

Shapes: E experts, P devices, e = E / P local experts per device (S / P slots for a slot
placement), T tokens, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

import torch

from .replica_rules import choose_slots, first_slots, on_device


@dataclass(frozen=True)
class Placement:
    """Expert -> (device, local slot) for one MoE layer.

    ``device_E[i]`` is the device of global expert ``i`` and ``slot_E[i]`` its
    index among that device's local experts. Groups are equal-sized: every
    device hosts exactly ``E // P`` experts.

    ``replicas_EP`` (optional, bool [E, P]): devices that also hold a copy of an expert
    for this batch (a replicating system's shadows, FasterMoE / Lina style). The expert's
    own device and slot stay where ``device_E``/``slot_E`` say (its weights, optimiser
    state and gradients live there); only systems that replicate read this, every other
    one sees the placement it always did.
    """

    device_E: torch.Tensor
    slot_E: torch.Tensor
    num_devices: int
    replicas_EP: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        E, P = self.device_E.numel(), self.num_devices
        if P < 1 or E % P:
            raise ValueError(f"placement: {E} experts do not split into {P} equal groups")
        counts = torch.bincount(self.device_E, minlength=P)
        if counts.numel() != P or not bool((counts == E // P).all()):
            raise ValueError(f"placement: devices must host {E // P} experts each, got {counts.tolist()}")
        key = self.device_E * (E // P) + self.slot_E
        if not torch.equal(torch.sort(key).values, torch.arange(E, device=key.device)):
            raise ValueError("placement: (device, slot) pairs must be distinct and slots in [0, E/P)")
        if self.replicas_EP is not None and tuple(self.replicas_EP.shape) != (E, P):
            raise ValueError(f"placement: replicas_EP must be [E, P] = [{E}, {P}], got {tuple(self.replicas_EP.shape)}")

    @property
    def num_experts(self) -> int:
        return self.device_E.numel()

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_devices

    def local_experts(self, device: int) -> torch.Tensor:
        """Global ids of ``device``'s experts, ordered by local slot: shape [e]."""
        ids_e = torch.nonzero(self.device_E == device).flatten()
        return ids_e[torch.argsort(self.slot_E[ids_e])]

    def global_order(self) -> torch.Tensor:
        """Global expert ids ordered by (device, slot): shape [E]. Row i of a
        contiguous, placement-ordered weight tensor holds expert ``global_order()[i]``."""
        return torch.argsort(self.device_E * self.num_local + self.slot_E)

    def to(self, device) -> "Placement":
        """The same placement with its tensors on ``device`` (a rank's device)."""
        device = torch.device(device)
        if self.device_E.device == device:
            return self
        replicas = None if self.replicas_EP is None else self.replicas_EP.to(device)
        return Placement(self.device_E.to(device), self.slot_E.to(device), self.num_devices, replicas)

    def with_replicas(self, replicated_E: torch.Tensor) -> "Placement":
        """This placement with every expert flagged in ``replicated_E`` (bool [E]) copied
        onto every device (a shadowed expert)."""
        P = self.num_devices
        replicas_EP = replicated_E.bool().unsqueeze(1).expand(-1, P).clone()
        return Placement(self.device_E, self.slot_E, P, replicas_EP)

    @staticmethod
    def contiguous(num_experts: int, num_devices: int) -> "Placement":
        """Expert i on device i // e, slot i % e (the default; on the host, see :meth:`to`)."""
        e = num_experts // max(num_devices, 1)
        ids = torch.arange(num_experts, device="cpu")
        return Placement(ids // max(e, 1), ids % max(e, 1), num_devices)

    def is_contiguous(self) -> bool:
        """Whether this is :meth:`contiguous`: expert i on device i // e, slot i % e (the layout
        libraries with a dense [E, C, D] buffer assume: block i goes to device i // e)."""
        ids = torch.arange(self.num_experts, device=self.device_E.device)
        return (torch.equal(self.device_E, ids // self.num_local)
                and torch.equal(self.slot_E, ids % self.num_local))

    @staticmethod
    def from_groups(groups: list[list[int]]) -> "Placement":
        """Device p hosts ``groups[p]`` in that slot order."""
        E = sum(len(g) for g in groups)
        device_E = torch.full((E,), -1, dtype=torch.long, device="cpu")
        slot_E = torch.full((E,), -1, dtype=torch.long, device="cpu")
        for p, group in enumerate(groups):
            idx = torch.tensor(group, dtype=torch.long, device="cpu")
            device_E[idx] = p
            slot_E[idx] = torch.arange(len(group), device="cpu")
        if bool((device_E < 0).any()):
            raise ValueError("placement: groups must cover every expert exactly once")
        return Placement(device_E, slot_E, len(groups))

    def groups(self) -> list[list[int]]:
        return [self.local_experts(p).tolist() for p in range(self.num_devices)]

    def pair_local(self, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device and local slot of each (token, k) pair: two [T, K] tensors (a dropped pair,
        id -1, reads expert 0's; callers mask it). ``home_T`` is unused (one copy per expert)."""
        ids_TK = topk_ids_TK.clamp_min(0)
        return self.device_E[ids_TK], self.slot_E[ids_TK]

    def pair_devices(self, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Device of each (token, k) pair: [T, K]."""
        return self.pair_local(topk_ids_TK, home_T)[0]


@dataclass(frozen=True)
class SlotPlacement:
    """Physical slots of one MoE layer: which logical expert each slot holds, on which device
    (EPLB's layout: a hot expert may have several copies, on one device or several, and
    devices hold unequal numbers of logical experts).

    Shapes: S physical slots, E logical experts, P devices, e = S / P slots per device.
    ``expert_S[s]`` is the logical expert in slot s, ``device_S[s]`` its device; every
    device holds exactly e slots, every expert at least one, and a device's local slots are
    its slots in increasing s (EPLB's slot s is on device s // e: :meth:`from_phy2log`).

    Which copy serves a pair is ``replica_policy`` (:mod:`occult.ep.replica_rules`; ``slack``
    is the ``collaborative`` rule's): by default the static ``round_robin`` rule of vLLM and
    SGLang: the i-th pair of expert x sent by one rank (counted in token-major (token, k)
    order) goes to copy ``i mod copies(x)`` (copies in slot order). A system with replica
    options binds its rule when it is built. ``replicas_EP`` is always None (no per-batch
    shadows on a slot placement).

    The placement is static, so its tables (copies per expert, each expert's slots, each
    slot's local index, each expert's first slot per device) are computed once, on the host,
    when it is built, and move with it (:meth:`to`): a replica rule decided on the device
    reads them there, with no host read and no shape that depends on them
    (``dispatch_mode=static``, :mod:`occult.ep.static`).
    """

    expert_S: torch.Tensor
    device_S: torch.Tensor
    num_devices: int
    num_experts: int
    replicas_EP: Optional[torch.Tensor] = None
    replica_policy: str = "round_robin"
    slack: float = 0.1
    # the tables (None: computed from the slots when the placement is built)
    tables: Optional[dict] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        S, P, E = self.expert_S.numel(), self.num_devices, self.num_experts
        if self.device_S.numel() != S:
            raise ValueError(f"slot placement: expert_S has {S} slots, device_S {self.device_S.numel()}")
        if P < 1 or S % P:
            raise ValueError(f"slot placement: {S} physical slots do not split equally over {P} devices")
        if S and (int(self.device_S.min()) < 0 or int(self.device_S.max()) >= P):
            raise ValueError(f"slot placement: devices must be in [0, {P})")
        counts = torch.bincount(self.device_S, minlength=P)
        if not bool((counts == S // P).all()):
            raise ValueError(f"slot placement: devices must hold {S // P} slots each, got {counts.tolist()}")
        if S and (int(self.expert_S.min()) < 0 or int(self.expert_S.max()) >= E):
            raise ValueError(f"slot placement: experts must be in [0, {E})")
        missing = (torch.bincount(self.expert_S, minlength=E) == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(f"slot placement: experts {missing} have no slot")
        if self.tables is None:
            object.__setattr__(self, "tables", self._tables())

    def _tables(self) -> dict:
        """The placement's tables (the class docstring), from its slots (where they are: the
        host when it is built)."""
        E, S, P = self.num_experts, self.num_slots, self.num_devices
        arange_S = torch.arange(S, device=self.expert_S.device)
        copies_E = torch.bincount(self.expert_S, minlength=E)
        order_S = torch.argsort(self.device_S * S + arange_S)
        local_S = torch.empty_like(order_S)
        local_S[order_S] = arange_S % (S // P)
        order_S = torch.argsort(self.expert_S * S + arange_S)
        start_E = torch.cumsum(copies_E, 0) - copies_E
        rank_S = arange_S - start_E[self.expert_S[order_S]]
        table_EC = torch.full((E, int(copies_E.max()) if S else 0), -1, dtype=torch.long, device=order_S.device)
        table_EC[self.expert_S[order_S], rank_S] = order_S
        return {"copies_E": copies_E, "local_S": local_S, "table_EC": table_EC,
                "first_EP": first_slots(self.expert_S, self.device_S, E, P)}

    @property
    def num_slots(self) -> int:
        return self.expert_S.numel()

    @property
    def num_local(self) -> int:
        """Slots per device (e): the local experts a device runs, copies included."""
        return self.num_slots // self.num_devices

    def copies_E(self) -> torch.Tensor:
        """Copies of each logical expert: [E] (long)."""
        return self.tables["copies_E"]

    def local_slot_S(self) -> torch.Tensor:
        """Each slot's index among its device's slots: [S]."""
        return self.tables["local_S"]

    def first_slot_EP(self) -> torch.Tensor:
        """The first slot of expert x on device p, -1 where p holds no copy: [E, P]."""
        return self.tables["first_EP"]

    def local_slots(self, device: int) -> torch.Tensor:
        """Slot ids of ``device`` in local order: [e]."""
        return torch.nonzero(self.device_S == device).flatten()

    def local_experts(self, device: int) -> torch.Tensor:
        """The logical expert of each of ``device``'s slots, in local order: [e] (an expert
        with two copies there appears twice)."""
        return self.expert_S[self.local_slots(device)]

    def copy_table_EC(self) -> torch.Tensor:
        """Slots of each expert in slot order, padded with -1: [E, max copies]."""
        return self.tables["table_EC"]

    def pair_slots(self, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The slot that serves each (token, k) pair by this placement's replica rule
        (:mod:`occult.ep.replica_rules`): [T, K] (-1 for a dropped pair). ``home_T``: each
        token's sending rank when the pairs of several ranks are concatenated (each rank
        decides its own pairs; default: one rank, rank 0)."""
        return choose_slots(self, topk_ids_TK, home_T, self.replica_policy, self.slack)

    def with_rule(self, replica_policy: str, slack: float = 0.1) -> "SlotPlacement":
        """The same slots with another replica rule."""
        return replace(self, replica_policy=replica_policy, slack=slack)

    def pair_local(self, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device and local slot of the copy that serves each pair (:meth:`pair_slots`): two
        [T, K] tensors (a dropped pair reads slot 0's; callers mask it)."""
        slot_TK = self.pair_slots(topk_ids_TK, home_T).clamp_min(0)
        dev = slot_TK.device
        return on_device(self.device_S, dev)[slot_TK], on_device(self.local_slot_S(), dev)[slot_TK]

    def pair_devices(self, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Device of the copy that serves each pair: [T, K]."""
        return self.pair_local(topk_ids_TK, home_T)[0]

    def to(self, device) -> "SlotPlacement":
        """The same placement with its tensors, tables included, on ``device``."""
        device = torch.device(device)
        if self.expert_S.device == device:
            return self
        return replace(self, expert_S=self.expert_S.to(device), device_S=self.device_S.to(device),
                       tables={k: t.to(device) for k, t in self.tables.items()})

    def is_contiguous(self) -> bool:
        """Whether this is the contiguous placement (one copy each, expert i in slot i)."""
        return (self.num_slots == self.num_experts
                and torch.equal(self.expert_S, torch.arange(self.num_slots, device=self.expert_S.device)))

    @staticmethod
    def from_phy2log(phy2log_S, num_devices: int, num_experts: int) -> "SlotPlacement":
        """EPLB's ``phy2log`` row of one layer (slot -> logical expert; slot s on device
        s // (S / P)), on the host."""
        expert_S = torch.as_tensor(phy2log_S, dtype=torch.long, device="cpu").flatten()
        S = expert_S.numel()
        if num_devices < 1 or S % num_devices:
            raise ValueError(f"slot placement: {S} physical slots do not split equally over {num_devices} devices")
        device_S = torch.arange(S, device="cpu") // (S // num_devices)
        return SlotPlacement(expert_S, device_S, num_devices, num_experts)

    def groups(self) -> list[list[int]]:
        """Each device's logical experts per local slot (copies repeated)."""
        return [self.local_experts(p).tolist() for p in range(self.num_devices)]


AnyPlacement = Union[Placement, SlotPlacement]
