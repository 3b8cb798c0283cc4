"""The launchers real users take, run for real on this CPU: torchrun (a single run and a
multirun, two ranks on gloo), Hydra's submitit launcher (local jobs of two tasks each: the
Slurm path without Slurm), and local GPU worlds refused where there are no GPUs."""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SMALL = ["task=layer", "cluster=cpu2", "model.hidden_size=32", "model.expert_ffn_size=16", "task.tokens_per_rank=32",
         "task.warmup=0", "task.iters=1"]


def run(cmd: list, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def frames(folder: Path) -> dict:
    return {df.system.iloc[0]: df for df in map(pd.read_parquet, folder.rglob("results.parquet"))}


def assert_two_rank_runs(got: dict, systems: set, launcher: str) -> None:
    assert set(got) == systems
    for df in got.values():
        assert set(df.launcher) == {launcher} and set(df.world_size) == {2}
        assert {0, 1} <= set(df["rank"]) and (df[df.metric == "parity_checked"].value == 1).sum() == 2


@pytest.mark.timeout(300)
def test_torchrun_single_run_and_multirun(tmp_path):
    """A single run, then a multirun whose occult point is that run's folder: rank 0 sees it
    done and every rank skips it (resume), naive runs."""
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "run.py"]
    sweep = tmp_path / "sweep"
    run(torchrun + ["system=occult", *SMALL, f"out_dir={sweep / 'occult'}"])
    assert_two_rank_runs(frames(sweep), {"occult"}, "torchrun")
    proc = run(torchrun + ["-m", "system=naive,occult", *SMALL, f"hydra.sweep.dir={sweep}",
                           "hydra.sweep.subdir=${system.name}"])
    assert_two_rank_runs(frames(sweep), {"naive", "occult"}, "torchrun")
    assert (sweep / "report.md").is_file()
    assert (proc.stdout + proc.stderr).count("results of this config exist") == 1     # rank 0 says it skips occult


@pytest.mark.slow    # 14 s; torchrun's launcher test stays in the default run
@pytest.mark.timeout(300)
def test_submitit_jobs_of_two_tasks_each(tmp_path):
    """hydra/launcher=submitit_local with tasks_per_node=2: each sweep point is a job whose two
    tasks are the run's two ranks (as submitit_slurm's tasks are on a cluster)."""
    run([sys.executable, "run.py", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
         "system=naive,occult", *SMALL, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert_two_rank_runs(frames(tmp_path / "sweep"), {"naive", "occult"}, "submitit")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_gpu_clusters_are_refused_without_gpus(n):
    from hydra import compose, initialize_config_dir

    from occult.config import CONF_DIR, register
    from occult.validate import ConfigError, validate
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"cluster=gpu{n}"])
    assert cfg.cluster.world_size == n and cfg.cluster.backend == "nccl"
    with pytest.raises(ConfigError, match=rf"cluster=gpu{n} \(backend nccl\) needs {n} CUDA GPU\(s\) on this "
                                          r"machine, one per rank; torch.cuda.is_available\(\) is False"):
        validate(cfg)


def test_the_clock_says_which():
    from occult.ep.measure import clock_name
    assert clock_name("gloo") == "host" and clock_name("nccl") == "cuda-synchronized"
