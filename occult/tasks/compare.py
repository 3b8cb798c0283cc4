"""Systems side by side in one world (task=bench: one MoE layer, :mod:`occult.tasks.bench`;
task=bench_model: whole models, :mod:`occult.tasks.bench_model`): the same weights, routing
and tokens for every system of ``task.compare`` (a conf/system name, or ``{name: <conf/system
name>, <option>: <value>}``; the first is the baseline of the ratios). These tasks run no
top-level ``system``: one given on the command line is refused, and it is not hashed.

Here what both share: the compared systems' typed configs (:func:`prepare`, in the launching
process), the order of their turns (reversed every other sample, so that machine noise hits
them alike), the replay of each collective right after itself as a plain
``all_to_all_single`` of the same split sizes (``raw_a2a_time`` beside ``a2a_time_paired``:
the harness's own overhead; for whole models what the bytes alone can buy at the proxy's
width), and the tag of each system's rows: its own ``system``, ``impl``, ``system_options``,
settings (``dispatch_mode``) and ``run_id`` (the run's config digest and a digest of the
system's config: two configs of one system are two runs); :mod:`analysis.figures.bench`
turns them into ratios.
"""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from ..columns import own_settings
from ..ep import Recorder, system_config
from ..ep.measure import barrier
from ..errors import ConfigError
from ..records import config_hash, row
from ..spec import RunSpec
from .one_layer import time_iteration


def compared_system(entry, index: int) -> dict:
    """One entry of ``task.compare`` as a system's dict: a conf/system name, or a dict with
    ``name`` (the conf/system file it starts from) and options on top of it."""
    from hydra import compose
    from hydra.errors import MissingConfigException

    where = f"task.compare[{index}]"
    if isinstance(entry, str):
        name, options = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
        name, options = entry["name"], {k: v for k, v in entry.items() if k != "name"}
    else:
        raise ConfigError(f"{where}={entry!r}: each compared system is a conf/system name or "
                          "{name: <conf/system name>, <option>: <value>, ...}")
    try:
        composed = compose(config_name="config", overrides=[f"system={name}"])
    except MissingConfigException as exc:
        raise ConfigError(f"{where}: no system {name!r}; available: {exc.options}") from exc
    system = {**OmegaConf.to_container(composed.system, resolve=True), **options}
    try:
        system_config(system)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return system


def prepare(spec: RunSpec) -> RunSpec:
    """In the launching process: the typed config of every system in ``task.compare``
    (composed from its conf/system file, with the entry's options on top), checked for this
    run's shape and task; for a whole model also its checkpoint (pre-training a missing
    proxy)."""
    task, m, P = spec.task, spec.model, spec.cluster.world_size
    if not task.compare:
        raise ConfigError("task.compare is empty: name the systems to compare (conf/system names or "
                          "{name: ..., option: ...} configs), e.g. task.compare=[naive,occult]")
    systems = []
    for i, entry in enumerate(task.compare):
        config = system_config(compared_system(entry, i))
        if not config.expert_parallel and not task.whole_model:
            raise ConfigError(f"task.compare[{i}]: system {config.name!r} has no expert-parallel dispatcher "
                              "(task=bench times one MoE layer; task=bench_model times whole models)")
        try:
            config.check(num_experts=m.num_experts, top_k=m.top_k, world_size=P)
            config.check_task(task.name)
            if task.whole_model:
                config.check_task(task.workload)       # the task whose iterations it runs
        except ValueError as exc:
            raise ConfigError(f"task.compare[{i}]: {exc}") from exc
        systems.append(config)
    spec = spec.replace(compared=tuple(systems))
    if task.whole_model:
        from .model import prepare as model_prepare
        spec = model_prepare(spec)
    return spec


def tagged(rows: list, config, base_id: str, world_size: int) -> list:
    """``rows`` with the compared system's context columns (its settings among them); its
    ``run_id`` ends in a digest of the run's config and the system's own (two configs of one
    system stay two runs)."""
    digest = config_hash({"run": base_id, "system": json.loads(config.options_json()), "name": config.name,
                          "target": config._target_})
    tag = {"system": config.name, "impl": config.impl_for(world_size), "system_options": config.options_json(),
           **own_settings(config), "run_id": f"{base_id}/{config.name}/{digest}"}
    return [{**r, **tag} for r in rows]


def turns(n: int, sample: int) -> list:
    """The order in which ``n`` systems run in ``sample``: as listed in warm-up and even
    samples, reversed in odd ones, so that no system always runs right after another's
    iteration (whose heap and cache state it would always inherit)."""
    order = list(range(n))
    return order[::-1] if sample >= 0 and sample % 2 else order


def replay_rows(ctx, layers: list, recs: list, inputs: tuple, reps: int) -> list:
    """``reps`` more iterations of every system with each collective replayed right after
    itself as a plain ``all_to_all_single`` of the same split sizes
    (:attr:`occult.ep.Recorder.raw_replay`): per system, ``a2a_time_paired`` (the
    harness's collective) and ``raw_a2a_time`` rows of the same events. Not timed
    samples of the layer (their layer times are dropped)."""
    out = [[] for _ in layers]
    x_TD, ids_TK, grad_TD = inputs
    for sample in range(reps):
        for i, layer in enumerate(layers):
            rec = Recorder(rank=ctx.rank, sync_collectives=True, raw_replay=True)
            time_iteration(ctx, layer, x_TD, ids_TK, grad_TD, rec, sample, True)
            out[i] += _replayed(ctx, rec, sample)
    return out


def model_replay_rows(ctx, works: list, reps: int) -> list:
    """:func:`replay_rows` for whole models: ``reps`` more iterations of each system's
    workload, every collective timed after a barrier and replayed as a plain
    ``all_to_all_single`` of its split sizes. What the bytes alone can buy at the proxy's
    width: the report's ``a2a_only_ratio``. Not timed samples of the workload."""
    out = [[] for _ in works]
    for sample in range(reps):
        for i, work in enumerate(works):
            rec = Recorder(rank=ctx.rank, sync_collectives=True, raw_replay=True)
            barrier(ctx.ep)
            work.step(rec, sample)
            out[i] += _replayed(ctx, rec, sample)
    return out


def _replayed(ctx, rec: Recorder, sample: int) -> list:
    """``a2a_time_paired`` and ``raw_a2a_time`` rows of each all-to-all a replaying
    recorder logged (the other kinds of collective are not replayed: no rows)."""
    rows = []
    for ev in rec.comm:
        if ev.raw_seconds < 0:
            continue
        where = dict(layer=ev.layer, rank=ctx.rank, phase=ev.phase, direction=ev.direction, sample=sample)
        rows += [row("a2a_time_paired", ev.seconds * 1e3, "ms", **where),
                 row("raw_a2a_time", ev.raw_seconds * 1e3, "ms", **where)]
    return rows
