"""occult-bench entry point (Hydra).

    python run.py system=naive task=layer cluster=cpu4            # one run
    python run.py -m system=naive cluster=cpu2,cpu4 model.top_k=2,8   # a sweep
    python run.py experiment=fig1_latency                         # a declared sweep (resumable)
    occult-bench system=naive task=layer                          # the same, as the installed command
    python run.py cluster=gpu4 ...                                # 4 local GPUs, NCCL
    torchrun --standalone --nproc-per-node 8 run.py -m cluster=gpu8 system=naive,occult ...
    python run.py -m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=8 ...   # Slurm

Each run writes results.parquet / results.csv (rank 0, atomically) into its
Hydra output folder under runs/. An invalid config stops with one line that
names the field and the allowed values (the full traceback goes to the run's
log, or with HYDRA_FULL_ERROR=1 to the screen).
"""
from occult.main import console

if __name__ == "__main__":
    console()
