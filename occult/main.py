"""The Hydra entry point of ``run.py`` and of the ``occult-bench`` command (the same thing).

    occult-bench system=naive task=layer cluster=cpu4        # = python run.py system=naive ...

:func:`console` registers the config schemas (those of the folders a command line adds
with ``hydra.searchpath`` too), runs :func:`main` under the one-line error reports of
:mod:`occult.cli`, and exits non-zero when a sweep point failed.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .config import CONF_DIR


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    """One run, or one point of a sweep."""
    from .runner import run_or_record_failure

    hc = HydraConfig.get()
    out_dir = cfg.out_dir or hc.runtime.output_dir
    run_or_record_failure(cfg, out_dir, multirun=hc.mode == RunMode.MULTIRUN,
                          overrides=hc.job.override_dirname, cli_overrides=tuple(hc.overrides.task))


def console() -> None:
    """``run.py`` / ``occult-bench``: the command line's run or sweep."""
    from .cli import one_line_config_errors, sweeps_compose_per_point
    from .config import register, searchpath_dirs
    from .runner import FAILED_POINTS

    register(searchpath_dirs(sys.argv[1:]))
    with one_line_config_errors(), sweeps_compose_per_point():
        main()
    sys.exit(1 if FAILED_POINTS else 0)
