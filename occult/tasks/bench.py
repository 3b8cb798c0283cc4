"""task=bench: systems side by side in one world, same weights, same routing, same tokens.

    python run.py experiment=bench                     # (make bench) naive vs occult, two layer shapes
    python run.py experiment=bench model=bench_comm task.iters=3 task.compare=[naive,occult,megablocks]

One MoE layer (``model``'s E, K, D, F; ``task.tokens_per_rank`` tokens per rank,
``task.routing``) for each system named in ``task.compare`` (conf/system names; the
first is the baseline of the ratios). Every system is first checked against the
single-device reference; then the systems' iterations alternate, so that machine noise
hits them alike. Each system's rows carry its own ``system``, ``impl``,
``system_options`` and ``run_id``; :func:`analysis.bench.bench_report` turns them into
ratios (remote bytes, all-to-all time per phase and pass, layer time forward and
forward+backward, the share of layer time in a system's own index work) and the
activation memory each keeps for backward.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from ..ep import Recorder, system_config
from ..errors import ConfigError
from ..ep.measure import iterations, stopwatch
from ..memory import saved_activation_bytes
from ..records import row
from .common import comm_rows, parity_gate, routing_rows
from .layer import build_layer, make_inputs, time_iteration


def prepare(cfg_dict: dict) -> dict:
    """In the launching process: the typed config of every system in ``task.compare``
    (composed from its conf/system file), checked for this run's shape."""
    from hydra import compose
    from hydra.errors import MissingConfigException

    names = list(cfg_dict["task"]["compare"])
    if not names:
        raise ConfigError("task.compare is empty: name the systems to compare (conf/system names), "
                          "e.g. task.compare=[naive,occult]")
    m, P = cfg_dict["model"], cfg_dict["cluster"]["world_size"]
    systems = []
    for name in names:
        try:
            composed = compose(config_name="config", overrides=[f"system={name}"])
        except MissingConfigException as exc:
            raise ConfigError(f"task.compare: no system {name!r}; available: {exc.options}") from exc
        config = system_config(composed.system)
        if not config.expert_parallel:
            raise ConfigError(f"task.compare: system {name!r} has no expert-parallel dispatcher "
                              "(task=bench times one MoE layer)")
        try:
            config.check(num_experts=m["num_experts"], top_k=m["top_k"], world_size=P)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        systems.append(OmegaConf.to_container(composed.system, resolve=True))
    cfg_dict["compare_systems"] = systems
    return cfg_dict


def _tagged(rows: list, config, base_id: str, world_size: int) -> list:
    """``rows`` with the compared system's context columns."""
    tag = {"system": config.name, "impl": config.impl_for(world_size), "system_options": config.options_json(),
           "run_id": f"{base_id}/{config.name}"}
    return [{**r, **tag} for r in rows]


def run_rank(ctx, cfg_dict: dict) -> list:
    """On every rank: parity per system, then alternating timed iterations."""
    systems = [system_config(s) for s in cfg_dict["compare_systems"]]
    t = OmegaConf.create(cfg_dict["task"])
    layers, recs, rows = [], [], []
    first = OmegaConf.create(cfg_dict)
    m = first.model
    for config in systems:
        layer = build_layer(ctx, first, config)
        rows.append(parity_gate(ctx, config, m.num_experts, m.top_k, t.routing, layer.dispatcher.placement)
                    if t.check_parity else [])
        layers.append(layer)
        recs.append(Recorder(rank=ctx.rank, sync_collectives=t.sync_collectives))
    x_TD, ids_TK, grad_TD = make_inputs(ctx, first)
    for i, layer in enumerate(layers):
        act = saved_activation_bytes(layer, x_TD.clone().requires_grad_(True), None, ids_TK)
        rows[i].append(row("activation_bytes", act, "bytes", layer=0, rank=ctx.rank))
    for sample in iterations(ctx.ep, t.warmup, t.iters):
        took = []
        for i, layer in enumerate(layers):
            with stopwatch() as sw:
                sample_rows = time_iteration(ctx, layer, x_TD, ids_TK, grad_TD, recs[i], sample, True)
            took.append(f"{systems[i].name} {sw.seconds:.1f} s")
            if sample >= 0:
                rows[i] += sample_rows
        if ctx.rank == 0:
            kind = "warm-up" if sample < 0 else f"sample {sample + 1}/{t.iters}"
            print(f"  [{first.model.name}] {kind}: {', '.join(took)}", flush=True)
    base_id = f"{first.experiment_name}/bench/{first.model.name}/{first.cluster.name}"
    out = []
    for i, config in enumerate(systems):
        rows[i] += comm_rows(recs[i]) + routing_rows(ctx, recs[i], layers[i].dispatcher.placement)
        out += _tagged(rows[i], config, base_id, ctx.world_size)
    return out
