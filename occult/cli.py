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
            return f"{key}: unknown key{tail}"
        what = str(cause).splitlines()[0]
        value = getattr(cause, "value", None)
        shown = f"={value!r}" if value is not None else ""
        return f"{key}{shown}: {what}"
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


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
            def again():
                raise exc
            return original(again)

    hydra_utils.run_and_report = report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original
