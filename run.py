"""occult-bench entry point (Hydra).

    python run.py system=naive task=layer cluster=cpu4            # one run
    python run.py -m system=naive cluster=cpu2,cpu4 model.top_k=2,8   # a sweep
    torchrun --nproc-per-node 8 run.py cluster=gpu8 ...            # GPUs, NCCL

Each run writes results.parquet / results.csv (rank 0, atomically) into its
Hydra output folder under runs/.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from occult.config import register

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from occult.runner import run_or_record_failure

    hc = HydraConfig.get()
    out_dir = cfg.out_dir or hc.runtime.output_dir
    run_or_record_failure(cfg, out_dir, multirun=hc.mode == RunMode.MULTIRUN)


if __name__ == "__main__":
    main()
    from occult.runner import FAILED_POINTS

    sys.exit(1 if FAILED_POINTS else 0)
