"""task=bench and task=bench_model: systems side by side in one world, same weights, same
routing, same tokens.

    python run.py experiment=bench                     # (make bench) naive vs occult, layers and models
    python run.py experiment=bench model=bench_comm task.iters=3 task.compare=[naive,occult,megablocks]
    python run.py task=bench 'task.compare=[naive,{name:occult,kernels:epd},{name:naive,payload:int8}]'

``task=bench`` (:func:`run_rank`): one MoE layer (``model``'s E, K, D, F;
``task.tokens_per_rank`` tokens per rank, ``task.routing``) for each system of
``task.compare``: a conf/system name, or ``{name: <conf/system name>, <option>: <value>}``
(the first is the baseline of the ratios). These tasks run no top-level ``system``: one
given on the command line is refused, and it is not hashed.
``task=bench_model`` (:func:`model_rank`): a whole model (a trained proxy) on
``task.workload`` (prefill, decode or train, the tasks' own iterations,
:mod:`occult.tasks.model`), one rank model per system from the same weights. Every
system is first checked against the single-device reference; then the systems'
iterations alternate (in reversed order every other sample), so that machine noise hits
them alike. After the timed layer iterations, more iterations replay each collective
right after itself as a plain ``all_to_all_single`` of the same split sizes
(``raw_a2a_time`` beside ``a2a_time_paired``): the harness's own overhead; for whole models the same replay gives
what the bytes alone can buy at the proxy's width (:func:`model_replay_rows`). Each system's
rows carry its own ``system``, ``impl``, ``system_options``, settings (``dispatch_mode``) and ``run_id`` (the run's
config digest and a digest of the system's config: two configs of one system are two runs);
:mod:`analysis.figures.bench` turns them into ratios.
"""
from __future__ import annotations

import copy
import json

from omegaconf import OmegaConf

from ..columns import own_settings
from ..ep import Recorder, system_config
from ..ep.measure import barrier, iterations, stopwatch
from ..ep.static import times_by_marks
from ..errors import ConfigError
from ..memory import saved_activation_bytes
from ..records import config_hash, row
from .common import comm_rows, model_parity_gate, parity_gate, routing_rows
from .layer import build_layer, make_inputs, time_iteration
from .options import task_config


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


def prepare(cfg_dict: dict) -> dict:
    """In the launching process: the typed config of every system in ``task.compare``
    (composed from its conf/system file, with the entry's options on top), checked for this
    run's shape and task; for a whole model also its checkpoint (pre-training a missing
    proxy)."""
    entries = list(cfg_dict["task"]["compare"])
    if not entries:
        raise ConfigError("task.compare is empty: name the systems to compare (conf/system names or "
                          "{name: ..., option: ...} configs), e.g. task.compare=[naive,occult]")
    m, P = cfg_dict["model"], cfg_dict["cluster"]["world_size"]
    task = task_config(cfg_dict["task"])
    systems = []
    for i, entry in enumerate(entries):
        system = compared_system(entry, i)
        config = system_config(system)
        if not config.expert_parallel and not task.whole_model:
            raise ConfigError(f"task.compare[{i}]: system {config.name!r} has no expert-parallel dispatcher "
                              "(task=bench times one MoE layer; task=bench_model times whole models)")
        try:
            config.check(num_experts=m["num_experts"], top_k=m["top_k"], world_size=P)
            config.check_task(task.name)
            if task.whole_model:
                config.check_task(task.workload)       # the task whose iterations it runs
        except ValueError as exc:
            raise ConfigError(f"task.compare[{i}]: {exc}") from exc
        systems.append(system)
    cfg_dict["compare_systems"] = systems
    if task.whole_model:
        from .model import prepare as model_prepare
        cfg_dict = model_prepare(cfg_dict)
    return cfg_dict


def _tagged(rows: list, config, base_id: str, world_size: int) -> list:
    """``rows`` with the compared system's context columns (its settings among them); its ``run_id`` ends in a digest
    of the run's config and the system's own (two configs of one system stay two runs)."""
    digest = config_hash({"run": base_id, "system": json.loads(config.options_json()), "name": config.name,
                          "target": config._target_})
    tag = {"system": config.name, "impl": config.impl_for(world_size), "system_options": config.options_json(),
           **own_settings(config), "run_id": f"{base_id}/{config.name}/{digest}"}
    return [{**r, **tag} for r in rows]


def run_rank(ctx, cfg_dict: dict) -> list:
    """On every rank: parity per system, then alternating timed iterations."""
    systems = [system_config(s) for s in cfg_dict["compare_systems"]]
    t = OmegaConf.create(cfg_dict["task"])
    layers, recs, rows = [], [], []
    first = OmegaConf.create(cfg_dict)
    for config in systems:
        layer = build_layer(ctx, first, config)
        rows.append(parity_gate(ctx, first, config, t.routing, layer.dispatcher.placement)
                    if t.check_parity else [])
        layers.append(layer)
        recs.append(Recorder(rank=ctx.rank, sync_collectives=t.sync_collectives, marks=times_by_marks(config)))
    x_TD, ids_TK, grad_TD = make_inputs(ctx, first)
    for i, layer in enumerate(layers):
        act = saved_activation_bytes(layer, x_TD.clone().requires_grad_(True), None, ids_TK)
        rows[i].append(row("activation_bytes", act, "bytes", layer=0, rank=ctx.rank))
    for sample in iterations(ctx.ep, t.warmup, t.iters):
        took = {}
        for i in turns(len(layers), sample):
            with stopwatch() as sw:
                sample_rows = time_iteration(ctx, layers[i], x_TD, ids_TK, grad_TD, recs[i], sample, True)
            took[i] = f"{systems[i].name} {sw.seconds:.1f} s"
            if sample >= 0:
                rows[i] += sample_rows
        if ctx.rank == 0:
            kind = "warm-up" if sample < 0 else f"sample {sample + 1}/{t.iters}"
            print(f"  [{first.model.name}] {kind}: {', '.join(took[i] for i in sorted(took))}", flush=True)
    base_id = f"{first.experiment_name}/bench/{first.model.name}/{first.cluster.name}/{cfg_dict.get('run_digest', '')}"
    out = []
    replayed = replay_rows(ctx, layers, recs, (x_TD, ids_TK, grad_TD), t.iters) if ctx.world_size > 1 else None
    for i, config in enumerate(systems):
        rows[i] += comm_rows(recs[i]) + routing_rows(ctx, recs[i], layers[i].dispatcher.placement)
        rows[i] += replayed[i] if replayed else []
        out += _tagged(rows[i], config, base_id, ctx.world_size)
    return out


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


def model_rank(ctx, cfg_dict: dict) -> list:
    """task=bench_model on every rank: parity per system, one rank model per system from
    the same weights, then the systems' ``task.workload`` iterations alternating."""
    from ..data.tokenizer import get_tokenizer
    from ..models.runtime import base_model, make_rank_model
    from .model import WORKLOADS, _finish, call_tokens

    cfg = OmegaConf.create(cfg_dict)
    t, m = cfg.task, cfg.model
    systems = [system_config(s) for s in cfg_dict["compare_systems"]]
    tok = get_tokenizer(cfg.pretrain.tokenizer_vocab, corpus=cfg.pretrain.corpus)
    base = base_model(cfg, m.vocab_size or tok.vocab_size, cfg.get("checkpoint"), device=ctx.device)
    works, recs, rows = [], [], []
    for config in systems:
        rows.append(parity_gate(ctx, cfg, config, "router") + model_parity_gate(ctx, cfg, config)
                    if t.check_parity and config.expert_parallel else [])
        model = make_rank_model(ctx, copy.deepcopy(base), cfg, system=config, tokens_per_rank=call_tokens(cfg))
        works.append(WORKLOADS[t.workload](ctx, cfg, tok, model))
        recs.append(Recorder(rank=ctx.rank, sync_collectives=t.sync_collectives, marks=times_by_marks(config)))
    for sample in iterations(ctx.ep, t.warmup, t.iters):
        for i in turns(len(works), sample):
            recs[i].clear()
            barrier(ctx.ep)
            rows[i] += works[i].step(recs[i], sample)
    replayed = model_replay_rows(ctx, works, t.iters) if ctx.world_size > 1 else [[] for _ in works]
    base_id = (f"{cfg.experiment_name}/bench_model/{m.name}/{t.workload}/{cfg.cluster.name}/"
               f"{cfg_dict.get('run_digest', '')}")
    out = []
    quiet = OmegaConf.merge(cfg, {"task": {"save_routing": False}})
    for i, config in enumerate(systems):
        rows_i = _finish(ctx, quiet, recs[i], rows[i], works[i].model) + replayed[i]
        out += _tagged(rows_i, config, base_id, ctx.world_size)
    return out
