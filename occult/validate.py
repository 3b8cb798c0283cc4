"""Config validation before any process starts: errors name the field and the allowed values.

Composition already refused misspelt keys and wrong types (the schemas in
:mod:`occult.config`); this refuses values that compose but cannot run.
"""
from __future__ import annotations

import os
from typing import Sequence

from .config import CONF_DIR, read_conf
from .ep import import_object, system_config
from .errors import ConfigError
from .tasks.schema import check_task

__all__ = ["ConfigError", "available", "validate"]

DTYPES = ("float32", "float64", "bfloat16")
BACKENDS = ("gloo", "nccl")


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _expert_parallel_systems() -> list[str]:
    out = []
    for name in available("system"):
        try:
            if read_conf("system", name).expert_parallel:
                out.append(name)
        except ConfigError:
            continue
    return out


def _models_with_family() -> list[str]:
    return [name for name in available("model") if read_conf("model", name).family]


def _at_least(field: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{field}={value}: must be at least {low}")


def _check_model(m) -> None:
    E, K = m.num_experts, m.top_k
    _at_least("model.num_experts", E, 1)
    if not 1 <= K <= E:
        raise ConfigError(f"model.top_k={K}: allowed values are 1..model.num_experts={E}")
    for field in ("hidden_size", "expert_ffn_size", "num_layers", "num_heads"):
        _at_least(f"model.{field}", m[field], 1)
    if m.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={m.dtype!r}: allowed values are {list(DTYPES)}")
    if not 0 <= m.first_k_dense < m.num_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense}: allowed values are 0..model.num_layers-1="
                          f"{m.num_layers - 1} (at least one MoE layer)")
    if m.init not in ("trained", "random"):
        raise ConfigError(f"model.init={m.init!r}: allowed values are ['trained', 'random']")
    _check_router(m)
    from .models.families import family_of
    from .models.shortcut import shortcut_error
    if m.family and family_of(m.family).shortcut and shortcut_error(m.num_layers, m.first_k_dense):
        raise ConfigError(shortcut_error(m.num_layers, m.first_k_dense))


def _check_router(m) -> None:
    """The gate rule is one the family's router computes and can route K experts; the
    pre-training balance fields are ones the router has."""
    from .models.families import FAMILIES, check_gate_rule, family_of
    if m.family and m.family not in FAMILIES:
        raise ConfigError(f"model.family={m.family!r}: allowed values are {sorted(FAMILIES)}")
    try:
        check_gate_rule(m)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if m.balance_loss not in ("switch", "sequence"):
        raise ConfigError(f"model.balance_loss={m.balance_loss!r}: allowed values are ['switch', 'sequence']")
    if m.bias_update_speed and not (m.family and family_of(m.family).correction_bias):
        with_bias = sorted(n for n, f in FAMILIES.items() if f.correction_bias)
        raise ConfigError(f"model.bias_update_speed={m.bias_update_speed}: model.family={m.family!r} has no "
                          f"correction bias to move; families with one: {with_bias} (else 0)")


def _check_task(task_cfg):
    """The task's typed options after its checks (:func:`occult.tasks.schema.check_task`),
    with its rank function and set-up importable."""
    task = check_task(task_cfg)
    for what in ("entry", "prepare"):
        path = getattr(task, what)
        if not path:
            continue
        try:
            import_object(path)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"task={task.name}: its {what} {path!r} cannot be imported ({exc}); "
                              f"available tasks: {available('task')}") from exc
    return task


def _check_world(c, t) -> None:
    """The world the run asks for exists: a launcher's world of that size, and one GPU per
    local rank under NCCL (a task that simulates its world runs in one process: one GPU)."""
    from .dist import job_world

    world = job_world()
    if world is not None and t.one_process:
        raise ConfigError(f"task={t.name} runs in one process (it simulates cluster.world_size={c.world_size} "
                          f"ranks); run it without {world.kind}")
    if world is not None and world.world_size != c.world_size:
        raise ConfigError(f"cluster.world_size={c.world_size} but this {world.kind} job has {world.world_size} "
                          f"ranks: set cluster.world_size={world.world_size} (or start {c.world_size} ranks)")
    if c.backend != "nccl":
        return
    import torch

    local = world.local_world_size if world is not None else 1 if t.one_process else c.world_size
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < local:
        why = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else f"it has {have}"
        runnable = [n for n in available("cluster") if not n.startswith("gpu")]
        raise ConfigError(f"cluster={c.name} (backend nccl) needs {local} CUDA GPU(s) on this machine, one per "
                          f"rank; {why}. Clusters that run here: {runnable}")


def _check_system(cfg, t) -> None:
    """The top-level system exists, takes its options, has what the task needs and can run
    the model's shape on the world."""
    m, P = cfg.model, cfg.cluster.world_size
    try:
        system = system_config(cfg.system)
    except ConfigError as exc:
        if str(exc).startswith("system."):      # an option of a known system
            raise
        raise ConfigError(f"{exc}; available systems: {available('system')}") from exc
    if t.expert_parallel_only and not system.expert_parallel:
        raise ConfigError(f"system={system.name} has no expert-parallel dispatcher; task={t.name} needs "
                          f"one. Expert-parallel systems: {_expert_parallel_systems()}")
    try:
        system.check(num_experts=m.num_experts, top_k=m.top_k, world_size=P)
        system.check_task(t.name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _refuse_system(t, overrides: Sequence[str]) -> None:
    """A task that runs no top-level system refuses one set on the command line."""
    given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "system"]
    if given:
        instead = (" name the systems to compare in task.compare=[...] (conf/system names or "
                   "{name: ..., option: ...} configs)" if "compare" in t.option_names() else "")
        raise ConfigError(f"{given[0]}: task={t.name} does not run the top-level system (it is not "
                          f"hashed either);{instead or ' leave system unset'}")


def _replica_notes(cfg, t) -> list[str]:
    """A replica rule on a placement without copies: a note (the rule has nothing to choose)."""
    if not t.uses_system:
        return []
    from .ep import system_config
    config = system_config(cfg.system)
    if not config.slot_placements:
        return []
    note = config.replica_note(t.has_copies())
    return [note] if note else []


def validate(cfg, overrides: Sequence[str] = ()) -> list[str]:
    """Raises :class:`ConfigError` for impossible runs; returns notes on runs that work but
    are worth knowing about (the runner logs them). ``overrides``: the run's command-line
    overrides (a task that runs no top-level ``system`` refuses one)."""
    m, c = cfg.model, cfg.cluster
    _check_model(m)
    t = _check_task(cfg.task)
    P = c.world_size
    _at_least("cluster.world_size", P, 1)
    G = c.devices_per_node
    if G < 0 or (G and P % G):
        divisors = [d for d in range(1, P + 1) if P % d == 0]
        raise ConfigError(f"cluster.devices_per_node={G}: allowed values are 0 (one node) or a divisor of "
                          f"cluster.world_size={P}: {divisors}")
    if c.backend not in BACKENDS:
        raise ConfigError(f"cluster.backend={c.backend!r}: allowed values are {list(BACKENDS)}")
    _check_world(c, t)
    if t.uses_system:
        _check_system(cfg, t)
    else:
        _refuse_system(t, overrides)
    t.check_run(cfg)
    if t.whole_model and not m.family:
        raise ConfigError(f"task={t.name} runs a whole model; model={m.name} has no model.family "
                          f"(a layer-only config). Models with a family: {_models_with_family()}")
    if t.whole_model:
        from .models.families import family_of
        refusal = family_of(m.family).whole_model_refusal
        if refusal:
            raise ConfigError(f"task={t.name} runs a whole model; model.family={m.family} is refused: {refusal}")
    if t.whole_model and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    notes = _replica_notes(cfg, t)
    cores = os.cpu_count() or 1
    if P > cores and c.backend == "gloo" and not t.one_process:
        notes.append(f"cluster.world_size={P} is more than this machine's {cores} cores: "
                     "ranks will share cores, so times are slower and noisier (not an error)")
    return notes
