"""The placement-file option every placed system shares: a placement artifact (the JSON of
:func:`occult.placement.save_placements`) named by ``system.placement_file``, read once per
process and checked at validation against the run's experts and world size.

:class:`PlacementFileConfig` is the options mixin (Occult's placed and pruned variants,
ExFlow); :func:`file_key` is the cache key of any file a system option names.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from ..ep.placement import Placement
from ..ep.system import SystemConfig
from .artifacts import load_placements

# (resolved path, size, mtime_ns) -> ({layer: Placement}, meta)
_PLACEMENT_CACHE: dict = {}


def file_key(path, field: str) -> tuple:
    """Cache key of a file; raises ``ValueError`` naming ``system.<field>`` if it is missing."""
    if path is None or str(path) == "":
        raise ValueError(f"system.{field} is not set: give the path of the file (see conf/system)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"system.{field}={str(path)!r}: no such file")
    st = p.stat()
    return (str(p.resolve()), st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------
# placement artifacts
# ---------------------------------------------------------------------------


def read_placement_artifact(path) -> tuple[dict, dict]:
    """``({layer: Placement}, meta)`` of a placement artifact, read once per process.

    Raises ``ValueError`` naming ``system.placement_file`` when it is missing or malformed.
    """
    key = file_key(path, "placement_file")
    if key not in _PLACEMENT_CACHE:
        try:
            _PLACEMENT_CACHE[key] = load_placements(key[0])
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"system.placement_file={str(path)!r} is not a placement artifact "
                             f"(occult.placement.save_placements): {exc}") from exc
    return _PLACEMENT_CACHE[key]


def check_placement_artifact(path, num_experts: int, world_size: int) -> None:
    """Raises ``ValueError`` naming ``system.placement_file`` unless the artifact places
    ``num_experts`` experts on ``world_size`` devices."""
    placements, _ = read_placement_artifact(path)
    first = next(iter(placements.values()))
    if (first.num_experts, first.num_devices) != (num_experts, world_size):
        raise ValueError(
            f"system.placement_file={str(path)!r} places {first.num_experts} experts on "
            f"{first.num_devices} devices; this run has model.num_experts={num_experts} on "
            f"world size {world_size} (cluster). Make an artifact for this shape "
            f"(experiment=placement_study with this model and cluster)")


def artifact_layer_placement(path, layer: int, num_experts: int, world_size: int) -> Placement:
    """Layer ``layer``'s placement from the artifact at ``path`` (checked against E and P)."""
    check_placement_artifact(path, num_experts, world_size)
    placements, _ = read_placement_artifact(path)
    if layer not in placements:
        raise ValueError(f"system.placement_file={str(path)!r} has no placement for MoE layer {layer}; "
                         f"it has layers {sorted(placements)}")
    return placements[layer]


@dataclass
class PlacementFileConfig(SystemConfig):
    """Options mixin of any system that places its experts from a placement artifact
    (``placement_file``: the JSON of :func:`occult.placement.save_placements`; null:
    contiguous, unless the config sets ``placement_required``)."""

    placement_file: Optional[str] = None
    placement_required: ClassVar[bool] = False

    def layer_placement(self, layer: int, num_experts: int, world_size: int) -> Placement:
        if self.placement_file is None and not self.placement_required:
            return Placement.contiguous(num_experts, world_size)
        return artifact_layer_placement(self.placement_file, layer, num_experts, world_size)

    def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
        super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
        if self.placement_file is None and not self.placement_required:
            return
        if self.placement_file is None:
            raise ValueError(f"system.placement_file is not set: system '{self.name}' places experts from "
                             "a placement artifact (write one with experiment=placement_study, or "
                             "occult.placement.save_placements)")
        check_placement_artifact(self.placement_file, num_experts, world_size)
