"""One line for a config that does not compose: the field and the allowed values.

Hydra reports a config that fails to compose (a misspelt key, a wrong type, an unknown
option of a group) in several lines. :func:`one_line_config_errors` makes ``run.py``
print one line instead, ``error: <field>: <what> ...; allowed: ...``, append the full
traceback to ``runs/config_errors.log`` and exit with status 2. With
``HYDRA_FULL_ERROR=1`` Hydra's own full report is kept.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

ERROR_LOG = Path(__file__).resolve().parent.parent / "runs" / "config_errors.log"


def _allowed(cause) -> list:
    """The keys allowed where ``cause`` (an OmegaConf error) happened."""
    object_type = getattr(cause, "object_type", None)
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    parent = getattr(cause, "parent_node", None)
    try:
        return [str(k) for k in parent.keys()] if parent is not None else []
    except Exception:  # noqa: BLE001 - a node without keys
        return []


def _task_of(cause):
    """The task schema (a TaskConf subclass) where ``cause`` happened, or None."""
    from .tasks.options import TaskConf

    object_type = getattr(cause, "object_type", None)
    return object_type if isinstance(object_type, type) and issubclass(object_type, TaskConf) else None


def _node_name(cause) -> str:
    """The ``name`` of the config node where ``cause`` happened ("?" when it has none)."""
    try:
        return str(cause.parent_node["name"])
    except Exception:  # noqa: BLE001 - a node without a name
        return "?"


def describe(exc: BaseException) -> str:
    """One line for a composition error."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(exc, MissingConfigException):
        missing = exc.missing_cfg_file or ""
        group, _, choice = missing.rpartition("/")
        options = ", ".join(exc.options or [])
        hint = ""
        if group == "cluster" and choice.startswith("sim_"):
            hint = (f"; {choice} is a projection profile (conf/profile), not a world to run on: "
                    f"python -m analysis.project RUN_DIRS --profile {choice}")
        if group:
            return f"{group}={choice}: no such option; available: {options}{hint}"
        return str(exc).splitlines()[0]
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    key = getattr(cause, "full_key", None)
    if isinstance(cause, OmegaConfBaseException) and key:
        allowed = _allowed(cause)
        tail = f"; allowed: {', '.join(allowed)}" if allowed else ""
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            task = _task_of(cause)
            if task is not None:
                fields = ", ".join(task.option_names())
                return f"{key}: task={_node_name(cause)} does not read it; its fields: {fields}"
            return f"{key}: unknown key{tail}"
        what = str(cause).splitlines()[0]
        value = getattr(cause, "value", None)
        shown = f"={value!r}" if value is not None else ""
        return f"{key}{shown}: {what}"
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def config_error_in(exc: BaseException):
    """The :class:`occult.errors.ConfigError` that ``exc`` was raised from or while handling
    (e.g. a capability query's, wrapped by OmegaConf's resolution), or None."""
    from .errors import ConfigError

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _log_chain(exc: BaseException) -> Path:
    ERROR_LOG.parent.mkdir(parents=True, exist_ok=True)
    with ERROR_LOG.open("a") as f:
        f.write(f"--- {datetime.now().isoformat(timespec='seconds')} run.py {' '.join(sys.argv[1:])}\n")
        f.write("".join(traceback.format_exception(exc)))
    return ERROR_LOG


@contextmanager
def one_line_config_errors():
    """Within the block, Hydra's composition errors are one line (see the module docstring)."""
    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException, OverrideParseException

    original = hydra_utils.run_and_report

    def report(func):
        try:
            return func()
        except (ConfigCompositionException, OverrideParseException) as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            path = _log_chain(exc)
            sys.stderr.write(f"error: {describe(exc)} (traceback: {path})\n")
            sys.exit(2)
        except Exception as exc:  # noqa: BLE001 - everything else as Hydra reports it
            cause = config_error_in(exc)
            if cause is not None and os.environ.get("HYDRA_FULL_ERROR") != "1":
                path = _log_chain(exc)
                sys.stderr.write(f"error: {cause} (traceback: {path})\n")
                sys.exit(2)

            def again():
                raise exc
            return original(again)

    hydra_utils.run_and_report = report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original


def _swept_groups(overrides) -> set:
    """The config groups a multirun's command line sweeps (``task=prefill,decode`` -> task)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    return {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}


@contextmanager
def sweeps_compose_per_point():
    """Within the block, a multirun's first composition (the one Hydra makes before the
    sweep, for its own settings, with every swept group at its default) skips the
    command line's options of a swept group: ``-m task=prefill,decode task.new_tokens=4``
    would otherwise fail there, on ``task=layer``, which has no ``new_tokens``. Each point
    is composed with all of them, strictly (so a point whose task does not read an option
    fails with that option named, and the other points run)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.types import RunMode

    original_load = ConfigLoaderImpl._load_configuration_impl
    original_apply = ConfigLoaderImpl._apply_overrides_to_config

    def load(self, config_name, overrides, run_mode, *args, **kwargs):
        swept = _swept_groups(overrides) if run_mode == RunMode.MULTIRUN else set()
        if not swept:
            return original_load(self, config_name, overrides, run_mode, *args, **kwargs)

        def apply(config_overrides, cfg):
            kept = [o for o in config_overrides if o.key_or_group.split(".", 1)[0] not in swept]
            return original_apply(kept, cfg)

        ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply)
        try:
            return original_load(self, config_name, overrides, run_mode, *args, **kwargs)
        finally:
            ConfigLoaderImpl._apply_overrides_to_config = staticmethod(original_apply)

    ConfigLoaderImpl._load_configuration_impl = load
    try:
        yield
    finally:
        ConfigLoaderImpl._load_configuration_impl = original_load
