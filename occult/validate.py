"""Config validation before any process starts: errors name the field and the allowed values."""
from __future__ import annotations

import importlib
import inspect
import os
import warnings
from pathlib import Path

from .synthetic import ROUTINGS

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """An impossible configuration, found before any rank starts."""


def import_object(path: str):
    """``'pkg.mod.Name'`` -> the object."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def system_options(system: dict) -> dict:
    """The system's own options: every key but ``name`` and ``_target_``."""
    return {k: v for k, v in system.items() if k not in ("name", "_target_")}


def system_class(system: dict):
    """Imports the dispatcher class of a system config, with a clear error."""
    name, target = system.get("name"), system.get("_target_")
    if not name or not target:
        raise ConfigError(f"system: needs 'name' and '_target_'; available systems: {available('system')}")
    try:
        cls = import_object(target)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"system={name}: cannot import {target!r} ({exc}); "
                          f"available systems: {available('system')}") from exc
    params = inspect.signature(cls.__init__).parameters
    allowed = [p for p in params if p not in ("self", "ep", "placement")]
    for key in system_options(system):
        if key not in allowed:
            raise ConfigError(f"system.{key}: unknown option of system '{name}'; allowed: {allowed}")
    return cls


def _expert_parallel_systems() -> list[str]:
    import yaml
    out = []
    for name in available("system"):
        target = (yaml.safe_load((CONF_DIR / "system" / f"{name}.yaml").read_text()) or {}).get("_target_", "")
        try:
            if getattr(import_object(target), "expert_parallel", True):
                out.append(name)
        except (ImportError, AttributeError, ValueError):
            continue
    return out


def _models_with_family() -> list[str]:
    import yaml
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")
                  if (yaml.safe_load(p.read_text()) or {}).get("family"))


def validate(cfg) -> list[str]:
    """Raises :class:`ConfigError` for impossible runs; returns warnings (also issued)."""
    m, t, c = cfg.model, cfg.task, cfg.cluster
    if c.get("simulated", False):
        runnable = [n for n in available("cluster") if not n.startswith("sim_")]
        raise ConfigError(f"cluster={c.name} is a projection profile (cluster.simulated=true), not a cluster "
                          f"to run on: use it with python -m analysis.project RUN_DIRS --cluster {c.name}. "
                          f"Clusters that run: {runnable}")
    E, K, P = m.num_experts, m.top_k, c.world_size
    if E < 1:
        raise ConfigError(f"model.num_experts={E}: must be at least 1")
    if not 1 <= K <= E:
        raise ConfigError(f"model.top_k={K}: allowed values are 1..model.num_experts={E}")
    if P < 1:
        raise ConfigError(f"cluster.world_size={P}: must be at least 1")
    if t.routing not in ROUTINGS:
        raise ConfigError(f"task.routing={t.routing!r}: allowed values are {list(ROUTINGS)}")
    if t.tokens_per_rank < 0:
        raise ConfigError(f"task.tokens_per_rank={t.tokens_per_rank}: must be >= 0")
    if t.iters < 1 or t.warmup < 0:
        raise ConfigError(f"task.iters={t.iters}, task.warmup={t.warmup}: need iters >= 1, warmup >= 0")
    if c.backend not in ("gloo", "nccl"):
        raise ConfigError(f"cluster.backend={c.backend!r}: allowed values are ['gloo', 'nccl']")
    try:
        import_object(t.entry)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"task.entry={t.entry!r} cannot be imported ({exc}); "
                          f"available tasks: {available('task')}") from exc
    cls = system_class(dict(cfg.system))
    if t.get("expert_parallel_only", False) and not getattr(cls, "expert_parallel", True):
        raise ConfigError(f"system={cfg.system.name} has no expert-parallel dispatcher; task={t.name} needs "
                          f"one. Expert-parallel systems: {_expert_parallel_systems()}")
    if t.get("whole_model", False) and not m.get("family"):
        raise ConfigError(f"task={t.name} runs a whole model; model={m.name} has no model.family "
                          f"(a layer-only config). Models with a family: {_models_with_family()}")
    try:
        cls.check_config(num_experts=E, top_k=K, world_size=P, **system_options(dict(cfg.system)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    notes = []
    cores = os.cpu_count() or 1
    if P > cores and c.backend == "gloo":
        notes.append(f"cluster.world_size={P} is more than this machine's {cores} cores: "
                     "ranks will share cores, so times are slower and noisier (not an error)")
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return notes
