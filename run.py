"""occult-bench entry point (Hydra).

    python run.py system=naive task=layer cluster=cpu4            # one run
    python run.py -m system=naive cluster=cpu2,cpu4 model.top_k=2,8   # a sweep
    python run.py experiment=fig1_latency                         # a declared sweep (resumable)
    python run.py cluster=gpu4 ...                                # 4 local GPUs, NCCL
    torchrun --standalone --nproc-per-node 8 run.py -m cluster=gpu8 system=naive,occult ...
    python run.py -m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=8 ...   # Slurm

Each run writes results.parquet / results.csv (rank 0, atomically) into its
Hydra output folder under runs/. An invalid config stops with one line that
names the field and the allowed values (the full traceback goes to the run's
log, or with HYDRA_FULL_ERROR=1 to the screen).
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from occult.runner import run_or_record_failure

    hc = HydraConfig.get()
    out_dir = cfg.out_dir or hc.runtime.output_dir
    run_or_record_failure(cfg, out_dir, multirun=hc.mode == RunMode.MULTIRUN,
                          overrides=hc.job.override_dirname, cli_overrides=tuple(hc.overrides.task))


if __name__ == "__main__":
    from occult.cli import one_line_config_errors, sweeps_compose_per_point
    from occult.config import register, searchpath_dirs

    register(searchpath_dirs(sys.argv[1:]))
    with one_line_config_errors(), sweeps_compose_per_point():
        main()
    from occult.runner import FAILED_POINTS

    sys.exit(1 if FAILED_POINTS else 0)
