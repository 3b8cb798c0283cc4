"""The links and compute of a machine for a world of P ranks, and the arithmetic on them.

A :class:`Link` is one world size's latencies, bandwidths and matmul throughput (seconds,
bytes/s, FLOP/s), made from a profile's nominal numbers and efficiencies
(:func:`link_from_fields`) or from a calibration's measured points
(:func:`calibration_links`); :func:`pipeline_seconds` is PipeMoE's pipeline model on one.
The profiles that hold those numbers (``conf/profile/*.yaml``) are read in
:mod:`occult.ep.profiles`.
"""
from __future__ import annotations

from dataclasses import dataclass

ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Link:
    """One world size's links and compute on a profile (seconds, bytes/s, FLOP/s)."""

    intra_latency_s: float
    intra_Bps: float
    inter_latency_s: float = 0.0
    inter_Bps: float = float("inf")
    devices_per_node: int = 0          # 0: all ranks in one node
    flops: float = float("inf")        # achieved matmul FLOP/s per device
    expert_call_s: float = 0.0         # overhead per local expert per pass (measured on the CPU)
    memory_Bps: float = float("inf")   # device memory bandwidth (inf: experts are compute-bound)
    intra_message_s: float = 0.0       # per message (peer with a non-empty block) within a node
    inter_message_s: float = 0.0       # per message across nodes
    overlap: bool = True               # NVLink and NIC concurrently (max of their times), else in series (sum)

    @property
    def slowest_Bps(self) -> float:
        """The bandwidth of the slowest link a rank uses (inter-node when there are nodes)."""
        return min(self.intra_Bps, self.inter_Bps)

    @property
    def latency_s(self) -> float:
        """The latency of a collective that may cross nodes."""
        return max(self.intra_latency_s, self.inter_latency_s)


def link_from_fields(c: dict) -> Link:
    """A GPU profile's fixed links: nominal numbers times the profile's efficiencies (NVLink's
    and the NIC's own where the profile gives them, else ``link_efficiency``). ``c``: every
    field of a profile, its defaults filled in (:func:`occult.ep.profiles.checked_fields`);
    a field at 0 is one the profile does not state."""
    eff, ceff = float(c["link_efficiency"]), float(c["compute_efficiency"])
    intra_eff = float(c["intra_node_efficiency"]) or eff
    inter_eff = float(c["inter_node_efficiency"]) or eff
    inter = float(c["inter_node_GBps"]) * int(c["nics_per_node"])
    per_node = int(c["devices_per_node"])
    inter_share = inter / per_node if per_node and inter else 0.0
    return Link(intra_latency_s=float(c["intra_node_latency_us"]) * 1e-6,
                intra_Bps=float(c["intra_node_GBps"]) * 1e9 * intra_eff,
                inter_latency_s=float(c["inter_node_latency_us"]) * 1e-6,
                inter_Bps=inter_share * 1e9 * inter_eff if inter_share else float("inf"),
                devices_per_node=per_node,
                flops=float(c["device_TFLOPs"]) * 1e12 * ceff or float("inf"),
                memory_Bps=float(c["memory_GBps"]) * 1e9 or float("inf"),
                intra_message_s=float(c["intra_node_message_us"]) * 1e-6,
                inter_message_s=float(c["inter_node_message_us"]) * 1e-6,
                overlap=bool(c["overlap_links"]))


def calibration_links(points: list) -> dict:
    """A measured profile's links per world size: ``{P: Link}`` from its calibration points."""
    return {int(p["world_size"]): Link(intra_latency_s=float(p["latency_us"]) * 1e-6, intra_Bps=float(p["GBps"]) * 1e9,
                                       flops=float(p["TFLOPs"]) * 1e12,
                                       expert_call_s=float(p.get("expert_call_us", 0.0)) * 1e-6)
            for p in points or []}


def pipeline_seconds(dispatch_s: float, experts_s: float, combine_s: float, degree: int) -> float:
    """A layer cut into ``degree`` chunks, each chunk's dispatch, experts and combine taking
    the given seconds, when chunk i's experts overlap the other chunks' collectives. Both
    collectives share the link, so the steady state is paced by the slower of dispatch +
    combine and the experts (the pipeline model of PipeMoE):

        T(r) = d + e + c + (r - 1) * max(d + c, e)
    """
    d, e, c = dispatch_s, experts_s, combine_s
    return d + e + c + (degree - 1) * max(d + c, e)
