"""Links and compute of a machine, from a projection profile (``conf/profile/*.yaml``).

The cost model (:mod:`analysis.costmodel`) projects measured runs onto these numbers;
systems whose schedule is decided by a cost rule at run time (FasterMoE's shadowing,
PipeMoE's pipeline degree) read the same numbers for the machine they assume
(a system option naming a profile). Only the fields are read here; the profile's
schema is :class:`occult.config.ProfileConf`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

PROFILE_DIR = Path(__file__).resolve().parents[2] / "conf" / "profile"


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

    @property
    def slowest_Bps(self) -> float:
        """The bandwidth of the slowest link a rank uses (inter-node when there are nodes)."""
        return min(self.intra_Bps, self.inter_Bps)

    @property
    def latency_s(self) -> float:
        """The latency of a collective that may cross nodes."""
        return max(self.intra_latency_s, self.inter_latency_s)


def link_from_fields(c: dict) -> Link:
    """A GPU profile's fixed links: nominal numbers times the profile's efficiencies."""
    eff, ceff = float(c.get("link_efficiency", 1.0)), float(c.get("compute_efficiency", 1.0))
    inter = float(c.get("inter_node_GBps", 0.0)) * int(c.get("nics_per_node", 0) or 0)
    per_node = int(c.get("devices_per_node", 0) or 0)
    inter_share = inter / per_node if per_node and inter else 0.0
    return Link(intra_latency_s=float(c.get("intra_node_latency_us", 0.0)) * 1e-6,
                intra_Bps=float(c["intra_node_GBps"]) * 1e9 * eff,
                inter_latency_s=float(c.get("inter_node_latency_us", 0.0)) * 1e-6,
                inter_Bps=inter_share * 1e9 * eff if inter_share else float("inf"),
                devices_per_node=per_node,
                flops=float(c.get("device_TFLOPs", 0.0)) * 1e12 * ceff or float("inf"),
                memory_Bps=float(c.get("memory_GBps", 0.0)) * 1e9 or float("inf"))


def calibration_links(points: list) -> dict:
    """A measured profile's links per world size: ``{P: Link}`` from its calibration points."""
    return {int(p["world_size"]): Link(intra_latency_s=float(p["latency_us"]) * 1e-6, intra_Bps=float(p["GBps"]) * 1e9,
                                       flops=float(p["TFLOPs"]) * 1e12,
                                       expert_call_s=float(p.get("expert_call_us", 0.0)) * 1e-6)
            for p in points or []}


def profile_fields(name_or_path: str) -> dict:
    """The fields of a profile: ``sim_a6000x4`` (from conf/profile) or a YAML path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no profile {name_or_path!r}; profiles: {names}")
    return yaml.safe_load(path.read_text()) or {}


def link_at(name_or_path: str, world_size: int) -> Link:
    """The links and compute a profile gives a world of ``world_size`` ranks (a measured
    profile: its calibration at that size; a fixed one: its links, whatever the size)."""
    c = profile_fields(name_or_path)
    calibrated = calibration_links(c.get("calibration"))
    if calibrated:
        if world_size not in calibrated:
            raise ValueError(f"profile {name_or_path!r} is calibrated for world sizes {sorted(calibrated)}, "
                             f"not {world_size}")
        return calibrated[world_size]
    try:
        return link_from_fields(c)
    except KeyError as exc:
        raise ValueError(f"profile {name_or_path!r} has no {exc.args[0]!r} (a fixed profile needs intra_node_GBps; "
                         f"a measured one, calibration points)") from None


def pipeline_seconds(dispatch_s: float, experts_s: float, combine_s: float, degree: int) -> float:
    """A layer cut into ``degree`` chunks, each chunk's dispatch, experts and combine taking
    the given seconds, when chunk i's experts overlap the other chunks' collectives. Both
    collectives share the link, so the steady state is paced by the slower of dispatch +
    combine and the experts (the pipeline model of PipeMoE):

        T(r) = d + e + c + (r - 1) * max(d + c, e)
    """
    d, e, c = dispatch_s, experts_s, combine_s
    return d + e + c + (degree - 1) * max(d + c, e)
