"""task=place: a placement artifact for a world that is not here, in one process.

    python run.py task=place model=deepseek_v3_proxy cluster.world_size=64 system=occult \
        task.optimiser=swap_search task.time_limit_s=5 task.total_tokens=16384

``experiment=placement_study`` finds placements by running the expert-parallel model on P
ranks, which a world of 64 to 256 ranks cannot do here. This task reads the routing of such
a world as ``task=simulate`` does (:class:`occult.tasks.world.RoutedWorld`: the model's
routers, a routing trace or synthetic routing; ``task.layers``, ``task.total_tokens``), by
default the routers on the corpus's *training* split (a profiling set, where ``simulate``
routes the held-out text), and for every layer runs one placement optimiser
(:func:`occult.placement.optimise`: ``task.optimiser`` at ``task.load_cap``, swap_search
stopping after ``task.time_limit_s``). Synthetic routing draws another stream of the seed
than ``simulate``'s, so a placement is never judged on the tokens that made it.

Writes ``placements.json`` into the run folder (:func:`occult.placement.save_placements`, its
``meta`` naming the optimiser, cap, time limit and routing) for
``system=occult_placed system.placement_file=...``, and rows per layer (``phase`` = the
optimiser): ``ct_all`` of the contiguous placement and of the new one on the profiling
tokens, ``load_max_over_mean`` of both, ``solve_s``.

Shapes: W world tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Dict

import torch

from ..ep.accounting import ct_all
from ..ep.measure import stopwatch
from ..ep.placement import Placement
from ..errors import ConfigError
from ..placement import load_max_over_mean, optimise, save_placements
from ..records import row
from ..spec import RunSpec
from .world import one_thread, rank_routing, task_layers, world_source
from .schema import LoadCapped
from .world import RoutedWorld


@dataclass
class Config(RoutedWorld, LoadCapped):
    """task=place: a placement artifact for a world that is not here, in one process
    (:mod:`occult.tasks.place`): each MoE layer's experts grouped onto ``cluster.world_size``
    devices by ``optimiser`` (a placement optimiser, :data:`occult.placement.OPTIMISERS`) at
    ``load_cap`` (max / mean device load; null: none), swap_search stopping after
    ``time_limit_s`` per layer, from the routing of :class:`RoutedWorld` (by default the
    routers on the *training* split: a profiling set, not the held-out text simulate
    routes). Writes ``placements.json`` into the run folder, for ``system.placement_file``."""

    split: str = "train"
    optimiser: str = "swap_search"
    time_limit_s: float = 10.0
    writes_artifact: ClassVar[bool] = True      # placements.json, read by occult_placed points

    entry: ClassVar[str] = "occult.tasks.place.run"
    uses_system: ClassVar[bool] = False          # it places experts; no system runs

    def check(self) -> None:
        super().check()
        from ..placement import OPTIMISERS

        if self.optimiser not in OPTIMISERS:
            raise ConfigError(f"task.optimiser={self.optimiser!r}: allowed values are {sorted(OPTIMISERS)}")
        if self.time_limit_s <= 0:
            raise ConfigError(f"task.time_limit_s={self.time_limit_s}: must be > 0 seconds")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.optimiser != "swap_search":
            out["time_limit_s"] = "read only with task.optimiser=swap_search"
        return out


ARTIFACT = "placements.json"
# the synthetic stream a placement is made from (simulate draws stream 0)
PROFILING_STREAM = 1


def world_ids(cfg, source, layer: int) -> torch.Tensor:
    """Every simulated rank's top-k ids of ``layer``, in rank order: ``topk_ids_WK`` (host)."""
    streams = [rank_routing(cfg, source, layer, rank, "cpu", salt=PROFILING_STREAM)[0]
               for rank in range(cfg.cluster.world_size)]
    return torch.cat(streams)


def layer_rows(layer: int, optimiser: str, ids_WK: torch.Tensor, placed: Placement, seconds: float) -> list:
    """C_T and load balance of the contiguous placement and of ``placed`` on ``ids_WK``."""
    base = Placement.contiguous(placed.num_experts, placed.num_devices)
    out = [row("solve_s", seconds, "s", layer=layer, phase=optimiser)]
    for which, pl in (("contiguous", base), (optimiser, placed)):
        out += [row("ct_all", ct_all(ids_WK, pl), "devices/token", layer=layer, phase=which),
                row("load_max_over_mean", load_max_over_mean(ids_WK, pl), "ratio", layer=layer, phase=which)]
    return out


def run(ctx, spec: RunSpec) -> list:
    """Every layer's placement for the simulated world, on this one process; returns its rows."""
    with one_thread():
        return _place(ctx, spec)


def _place(ctx, spec: RunSpec) -> list:
    t, m, P = spec.task, spec.model, spec.cluster.world_size
    source = world_source(spec, salt=PROFILING_STREAM)
    placements, rows = {}, []
    for layer in task_layers(m, t.sample_layers):
        ids_WK = world_ids(spec, source, layer)
        with stopwatch() as sw:
            placements[layer] = optimise(t.optimiser, ids_WK, m.num_experts, P, load_cap=t.load_cap, seed=spec.seed,
                                         time_limit_s=t.time_limit_s)
        rows += layer_rows(layer, t.optimiser, ids_WK, placements[layer], sw.seconds)
    meta = {"task": "place", "built_by": "harness", "optimiser": t.optimiser, "load_cap": t.load_cap,
            "time_limit_s": t.time_limit_s if t.optimiser == "swap_search" else None, "model": m.name,
            "world_size": P, "routing": t.routing, "split": t.split if t.routing == "router" else None,
            "tokens": int(ids_WK.shape[0]), "seed": spec.seed}
    save_placements(Path(spec.out_dir) / ARTIFACT, placements, meta)
    return rows
