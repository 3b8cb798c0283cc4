r"""A Hydra sweeper over a union of grids, for experiments whose points are not one
Cartesian product (a figure that needs layer runs and prefill runs with
different axes, or a study that gathers several figures).

Hydra instantiates sweepers only from the ``hydra_plugins`` namespace package,
hence this module's place (found on the repository root, where ``run.py``
lives).

In an experiment config:

    hydra:
      mode: MULTIRUN
      sweeper:
        _target_: hydra_plugins.occult_sweepers.grids_sweeper.GridsSweeper
        params:
          cluster: cpu4                    # no "/": shared by every grid
          lcc/task: prefill                # "<grid>/<key>": grid "lcc" only
          lcc/task.save_routing: "true"
          ct/task: layer
          ct/model.top_k: 1,2,4,8

Each grid is the Cartesian product of the shared keys and its own keys (its
own win). A command-line argument replaces its key in the grids that name
the key, and joins every grid when no grid names it (so a reduced run such
as ``python run.py experiment=X model.top_k=2`` shrinks only the grids that
sweep top-k). Points that two grids share run once. A param set to null is
dropped (an experiment that extends another removes grids that way). A value
may refer to the point's own config with ``%{...}``: ``label: score_%{system.budget}``
becomes the override ``label=score_${system.budget}``, resolved in the point's config
(``${...}`` itself would be resolved by Hydra when it instantiates the sweeper, where
the point's keys do not exist; an escaped ``\${...}`` is resolved twice there).

It is the default sweeper of every multirun (``conf/config.yaml``): without grid
names it sweeps like Hydra's basic sweeper. A point whose overrides would name a
folder longer than the file system allows gets a shortened name with a digest. It announces the number of points to
the runner (for the progress lines: points done of all, time left) and, once the first batch
composes and before its first point, pre-trains the proxies the points load that are not cached
(:func:`occult.runner.before_sweep`). Everything
else (batching, launching, resume through ``run.py``) is Hydra's basic sweeper.
"""
from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from typing import List

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

# read by occult.runner for its progress lines (the same name there)
SWEEP_POINTS_ENV = "OCCULT_SWEEP_POINTS"
# in a param's value, a reference to the point's own config (``%{key}`` -> ``${key}``)
POINT_REF = "%{"
# a sweep point's folder is named by its overrides; names past this are cut and get a digest
MAX_FOLDER_NAME = 200


# config groups whose choice selects a typed schema (conf/config.yaml: system_schema, task_schema):
# points that choose differently may accept different keys
SCHEMA_GROUPS = ("system", "task")


def point_shape(point) -> tuple:
    """What decides whether a point's overrides compose, but for their values: the keys, and
    the choices of :data:`SCHEMA_GROUPS`."""
    keys = sorted(o.split("=", 1)[0] for o in point)
    chosen = sorted(o for o in point if o.split("=", 1)[0].lstrip("+~") in SCHEMA_GROUPS)
    return tuple(keys), tuple(chosen)


class GridsSweeper(BasicSweeper):
    """Hydra's basic sweeper, over the union of named grids (``<grid>/<key>`` params)."""

    _unprepared = None      # every point of the sweep until its set-up ran (:meth:`validate_batch_is_legal`)

    def _grids(self) -> "OrderedDict[str, dict]":
        """{grid name: {key: value}}; shared keys go into every grid (name "" when no grid is named)."""
        shared, grids = {}, OrderedDict()
        for key, value in (self.params or {}).items():
            grid, sep, name = str(key).partition("/")
            if sep and grid and name:
                grids.setdefault(grid, {})[name] = value
            else:
                shared[key] = value
        if not grids:
            grids[""] = {}
        return OrderedDict((g, {**shared, **own}) for g, own in grids.items())

    def _shared(self) -> dict:
        """Params without a grid name: shared by every grid."""
        return {k: v for k, v in (self.params or {}).items() if "/" not in str(k)}

    def _short_folder(self, point: list) -> list:
        """``point`` with a shorter ``hydra.sweep.subdir`` when its folder name (the joined
        overrides) would pass the file system's limit: the name cut, plus a digest of all of it."""
        exclude = set(self.config.hydra.job.config.override_dirname.exclude_keys) if self.config else set()
        kept = sorted(o for o in point if not o.startswith("hydra.") and o.split("=", 1)[0].lstrip("+~") not in exclude)
        name = ",".join(kept)
        if len(name) <= MAX_FOLDER_NAME or any(o.startswith("hydra.sweep.subdir=") for o in point) \
                or self._subdir_given():
            return point
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        short = re.sub(r"[^A-Za-z0-9_.,=-]", "_", name[:MAX_FOLDER_NAME - 11])
        return point + [f"hydra.sweep.subdir='{short}_{digest}'"]

    def _subdir_given(self) -> bool:
        """Whether the sweep's config names the points' folder itself (``hydra.sweep.subdir`` on the
        command line, not the override names): that name stands, however long the overrides."""
        if self.config is None:
            return False
        subdir = OmegaConf.to_container(self.config.hydra.sweep, resolve=False).get("subdir")
        return "override_dirname" not in str(subdir)

    def validate_batch_is_legal(self, batch) -> None:
        """Composes, before a batch launches, one point per shape (:func:`point_shape`: its
        override keys and its choice of the groups that pick a schema), not every point: the
        launcher composes each point again when it runs it, and a composition costs 0.3-1 s,
        which a sweep of a thousand cheap points (experiment=scale_study) paid twice. A key
        that a task or system of the sweep does not read still fails before anything runs; a
        value that fails to compose (a missing file) fails at its own point, after the points
        before it have written their results."""
        first = {}
        for point in batch:
            first.setdefault(point_shape(point), point)
        super().validate_batch_is_legal(list(first.values()))
        if self._unprepared is not None:          # the first batch composes: the sweep's set-up now
            points, self._unprepared = self._unprepared, None
            self._before_points(points)

    def _before_points(self, points: list) -> None:
        """What the sweep needs before its first point (:func:`occult.runner.before_sweep`:
        pre-training the proxies its points load that are not cached, announced and timed
        apart from the points)."""
        if self.config is None or self.hydra_context is None:
            return
        from occult.runner import before_sweep
        loader = self.hydra_context.config_loader
        before_sweep(points, lambda overrides: loader.load_sweep_config(self.config, overrides),
                     self.config.hydra.sweep.dir)

    def _parse_config(self) -> List[str]:
        return []          # the grids are expanded in split_arguments

    def split_arguments(self, overrides, max_batch_size):
        """All points of every grid (command-line overrides last), deduplicated, in batches."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        grids = self._grids()
        named = {k for g, params in grids.items() if g for k in params} - set(self._shared())
        points, seen = [], set()
        for params in grids.values():
            mine = [o for o in overrides if o.get_key_element() not in named or o.get_key_element() in params]
            grid = parser.parse_overrides([f"{k}={str(v).replace(POINT_REF, '${')}" for k, v in params.items()]) + mine
            for batch in BasicSweeper.split_arguments(grid, None):
                for point in batch:
                    key = tuple(sorted(point))
                    if key not in seen:
                        seen.add(key)
                        points.append(point)
        os.environ[SWEEP_POINTS_ENV] = str(len(points))
        points = [self._short_folder(point) for point in points]
        self._unprepared = points      # set up (pre-training) once the first batch composes: bad input first
        if max_batch_size is None or max_batch_size <= 0:
            return [points]
        return [points[i:i + max_batch_size] for i in range(0, len(points), max_batch_size)]
