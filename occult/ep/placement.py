"""Expert placement: which device hosts each expert of a layer, and in which local slot.

Shapes: E experts, P devices, e = E / P local experts per device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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
