"""Projection profiles (``conf/profile/*.yaml``): the one reader, and the links and
compute a profile gives a world of P ranks (:mod:`occult.ep.links`).

Everything that reads a profile reads it here, through its schema (:class:`ProfileConf`,
so a misspelt field is a one-line error naming it): the cost model (:mod:`analysis.projection`
projects measured runs onto these numbers), the systems whose schedule a cost rule decides
at run time (FasterMoE's shadowing, PipeMoE's pipeline degree: a system option naming a
profile, read for the machine they assume), and ``make gpu-check`` (a measured profile from
a datasheet one). A profile is named (``sim_a6000x4``, from ``conf/profile``) or a path to a
YAML file (a measured one written into a run folder, e.g. by ``experiment=calibrate``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .. import CONF_DIR
from .links import ELEMENT_BYTES, Link, calibration_links, link_from_fields

PROFILE_DIR = CONF_DIR / "profile"


@dataclass
class ProfileConf:
    """A projection profile (``conf/profile``): a cluster that is not here, for the cost
    model. Bandwidths in GB/s per device and direction."""
    name: str = MISSING
    world_size: int = 0                 # devices (0: per calibrated world size, or each of world_sizes)
    world_sizes: List[int] = field(default_factory=list)   # the world sizes fixed links hold for (nodes of
                                                           # devices_per_node; [] : world_size alone)
    backend: str = "nccl"
    devices_per_node: int = 0           # 0: every device in one node
    intra_node_GBps: float = 0.0        # device <-> device within a node (nominal)
    intra_node_latency_us: float = 0.0  # per all-to-all call within a node
    inter_node_GBps: float = 0.0        # one NIC, per direction (nominal)
    nics_per_node: int = 0              # NICs a node's devices share for inter-node traffic
    inter_node_latency_us: float = 0.0  # per all-to-all call that crosses nodes
    device_TFLOPs: float = 0.0          # dense matmul peak per device at `dtype`
    memory_GBps: float = 0.0            # device memory bandwidth (0: experts modelled compute-bound)
    memory_GB: float = 0.0              # device memory capacity (0: not stated; the advisor's fit check)
    dtype: str = "bfloat16"             # element type of projected activations (bfloat16, float32)
    link_efficiency: float = 1.0        # achieved / nominal bandwidth (an assumption unless measured)
    intra_node_efficiency: float = 0.0  # achieved / nominal NVLink bandwidth (0: link_efficiency)
    inter_node_efficiency: float = 0.0  # achieved / nominal NIC bandwidth (0: link_efficiency)
    intra_node_message_us: float = 0.0  # per message (a peer sent a non-empty block) within a node
    inter_node_message_us: float = 0.0  # per message across nodes
    intra_node_transport: str = ""      # the links' names, keys of fitted parameters (nvlink4, cx7_ib, efa)
    inter_node_transport: str = ""
    overlap_links: bool = True          # a rank's NVLink and NIC bytes move concurrently (false: in series)
    compute_efficiency: float = 1.0     # achieved / peak matmul throughput (idem)
    source: str = ""                    # where the numbers come from
    calibration: List[Any] = field(default_factory=list)   # measured points per world size (CPU)


@dataclass(frozen=True)
class Profile:
    """A projection profile as the cost model and the cost rules use it."""

    name: str
    world_size: int                     # 0: any world size in ``calibration``
    dtype: str
    link: Optional[Link] = None         # fixed links (GPU profiles)
    calibration: dict = field(default_factory=dict)   # {P: Link} (this machine)
    source: str = ""
    world_sizes: tuple = ()             # fixed links for each of these world sizes (nodes of a fixed size)
    memory_GB: float = 0.0              # device memory capacity (0: not stated)

    def sizes(self) -> list:
        """The world sizes the profile has links for."""
        return sorted(self.calibration) if self.calibration else sorted(self.world_sizes or [self.world_size])

    def covers(self, world_size: int) -> bool:
        """Whether the profile has links for a world of ``world_size`` ranks."""
        return world_size in self.sizes()

    def at(self, world_size: int) -> Link:
        """The links and compute for a run of ``world_size`` ranks (raises if the profile has none)."""
        if self.calibration:
            if world_size not in self.calibration:
                raise ValueError(f"profile={self.name}: calibrated for world sizes {sorted(self.calibration)}, "
                                 f"not {world_size} (rerun python run.py experiment=calibrate "
                                 f"hydra.sweeper.params.cluster=cpu{world_size},...)")
            return self.calibration[world_size]
        if not self.covers(world_size):
            raise ValueError(f"profile={self.name} has links for world sizes {self.sizes()}; a run measured at "
                             f"world_size={world_size} has another per-peer byte pattern. Project runs "
                             f"measured with cluster.world_size="
                             f"{self.sizes()[0] if len(self.sizes()) == 1 else self.sizes()}")
        return self.link

    @property
    def element_bytes(self) -> int:
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"profile={self.name}: dtype={self.dtype!r}; allowed values {sorted(ELEMENT_BYTES)}")
        return ELEMENT_BYTES[self.dtype]


def checked_fields(c: dict) -> dict:
    """A profile's fields merged into :class:`ProfileConf` (defaults filled in); a
    misspelt or mistyped field is a one-line ``ValueError`` naming it."""
    name = (c or {}).get("name", "?")
    try:
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ProfileConf), c or {}))
    except OmegaConfBaseException as exc:
        raise ValueError(f"profile={name}: {str(exc).splitlines()[0]} "
                         "(fields: see occult.ep.profiles.ProfileConf)") from exc


def profile_from_dict(c: dict) -> Profile:
    """A :class:`Profile` from a profile config's fields (checked by :func:`checked_fields`)."""
    c = checked_fields(c)
    name = c["name"]
    calibration = calibration_links(c["calibration"])
    if not calibration and not c["intra_node_GBps"]:
        raise ValueError(f"profile={name}: needs intra_node_GBps (GB/s) or a calibration list")
    sizes = tuple(int(p) for p in c["world_sizes"])
    per_node = int(c["devices_per_node"])
    if sizes and (calibration or any(p < 1 or (per_node and p > per_node and p % per_node) for p in sizes)):
        raise ValueError(f"profile={name}: world_sizes={list(sizes)}: allowed values are positive world sizes "
                         f"that fill whole nodes of devices_per_node={per_node}, for a profile of fixed links "
                         "(not a calibration list)")
    return Profile(name=name, world_size=int(c["world_size"]), dtype=c["dtype"],
                   link=None if calibration else link_from_fields(c), calibration=calibration,
                   source=c["source"], world_sizes=sizes, memory_GB=float(c["memory_GB"]))


def available_profiles() -> list[str]:
    """The profiles under conf/profile, by name."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_path(name_or_path) -> Path:
    """``sim_a6000x4`` -> conf/profile/sim_a6000x4.yaml; a path (with a suffix) as it is."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no profile {str(name_or_path)!r} ({path}); profiles: {available_profiles()}")
    return path


# (resolved path, size, mtime_ns) -> a profile's checked fields: systems read their profile
# once per layer they build (shadow, pipelined), and a read costs 20 ms
_FIELDS_CACHE: dict = {}


def profile_fields(name_or_path) -> dict:
    """A profile's fields, checked against :class:`ProfileConf` (defaults filled in), read
    once per process and file version."""
    path = profile_path(name_or_path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FIELDS_CACHE:
        _FIELDS_CACHE[key] = checked_fields(OmegaConf.to_container(OmegaConf.load(path)))
    return copy.deepcopy(_FIELDS_CACHE[key])


def load_profile(name_or_path) -> Profile:
    """``sim_a6000x4`` (from conf/profile) or a path to a profile YAML."""
    return profile_from_dict(profile_fields(name_or_path))


def link_at(name_or_path, world_size: int) -> Link:
    """The links and compute a profile gives a world of ``world_size`` ranks (a measured
    profile: its calibration at that size; a fixed one: its links, whatever the size)."""
    profile = load_profile(name_or_path)
    return profile.at(world_size) if profile.calibration else profile.link
