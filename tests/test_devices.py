"""Every tensor a rank makes is on the rank's device.

The ranks run with torch's default device set to ``meta`` while every real tensor is
explicitly on ``cpu`` (the rank's device here): a tensor made without the device of its
inputs is a meta tensor, which cannot mix with the real ones (an error) or gives wrong
values (caught by the parity check every run makes first). Run over every system and
every task (layer, prefill, decode, train, finetune), and shown to catch a system that
makes one index tensor without ``device=`` (``helpers.HostOnlyDispatcher``).
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from occult.config import CONF_DIR, register
from occult.dist import RankFailed, launch
from occult.ep import import_object, system_config
from occult.parity import LayerCase, run_grid
from occult.placement import save_placements
from occult.tasks.options import task_config
from occult.ep import Placement

from systems import system, system_configs

TINY = ["model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2"]
TEXT = ["task.batch_size=2", "task.seq_len=16"]
TIMED = ["task.warmup=0", "task.iters=1"]
TASKS = {"layer": [*TIMED, "task.tokens_per_rank=64"], "prefill": [*TEXT, *TIMED],
         "decode": [*TEXT, *TIMED, "task.new_tokens=2"], "train": [*TEXT, *TIMED],
         "finetune": [*TEXT, "task.tokens_per_rank=64", "task.steps=1"]}
P = 2


def _cfg(overrides: list, out_dir: Path) -> dict:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    cfg_dict["out_dir_resolved"] = str(out_dir)
    task = task_config(cfg.task)
    if task.prepare:
        cfg_dict = import_object(task.prepare)(cfg_dict)
    cfg_dict["entry"] = task.entry
    return cfg_dict


def every_job(tmp_path: Path) -> list:
    placement_file = tmp_path / "placements.json"
    g = torch.Generator(device="cpu").manual_seed(0)
    save_placements(placement_file, {layer: Placement.from_groups(torch.randperm(64, generator=g).view(P, 32).tolist())
                                     for layer in range(2)}, {"test": True})
    similarity_file = tmp_path / "logits.npz"
    np.savez(similarity_file, **{f"layer_{i}": np.random.default_rng(i).standard_normal((128, 64)).astype(np.float32)
                                 for i in range(2)})
    jobs = []
    for name, yaml_cfg in system_configs().items():
        config = system_config(yaml_cfg)
        expert_parallel = config.expert_parallel
        extra = [f"system.placement_file={placement_file}"] if name == "occult_placed" else []
        for task, tiny_task in TASKS.items():
            if not expert_parallel and task in ("layer", "finetune"):
                continue
            if task == "prefill" and name != "naive":
                # task=decode runs every system's MoE forward on the prompt first; the model's
                # cache-less prompt forward (task=prefill) differs only outside the MoE layers
                continue
            model = "layer_small" if task == "layer" else "olmoe_proxy"
            overrides = [f"system={name}", f"task={task}", f"model={model}", f"cluster=cpu{P}", *TINY, *tiny_task,
                         *extra]
            if name == "occult_prune_sim":    # finetune profiles the router itself; the others need a file
                overrides += ["system.profile_tokens=64"] if task == "finetune" else \
                             [f"system.similarity_file={similarity_file}"]
            out = tmp_path / f"{name}-{task}"
            cfg_dict = _cfg(overrides, out)
            jobs.append((f"{name}/{task}", cfg_dict["entry"], cfg_dict))
        # a system's other exact paths (e.g. Occult's fused experts step, which auto takes only
        # for a large EPD), on one layer forward and backward
        for path in config.other_exact_paths() if config.is_exact() else []:
            options = [f"system.{k}={v}" for k, v in path.items()]
            overrides = [f"system={name}", "task=layer", "model=layer_small", f"cluster=cpu{P}", *TINY,
                         *TASKS["layer"], *extra, *options]
            cfg_dict = _cfg(overrides, tmp_path / f"{name}-layer-{'-'.join(options)}")
            jobs.append((f"{name}{path}/layer", cfg_dict["entry"], cfg_dict))
    return jobs


@pytest.mark.timeout(600)
def test_every_system_and_task_keeps_its_tensors_on_the_rank_device(tmp_path):
    jobs = every_job(tmp_path)
    assert len(jobs) >= 30
    per_rank = launch(import_object("helpers.run_tasks"), P, (jobs,), timeout_s=560, collective_timeout_s=120,
                      default_device="meta")
    labels = {label for label, *_ in jobs}
    for rank_out in per_rank:
        assert set(rank_out) == labels and all(n > 0 for n in rank_out.values())


@pytest.mark.timeout(120)
def test_the_meta_world_catches_a_tensor_made_without_its_device():
    case = LayerCase(8, 2, (5, 4), routing="uniform", seed=1)
    # in an ordinary world the defect is invisible: the default device is the CPU
    (r0, _) = launch(run_grid, P, ([(system("helpers.HostOnlyDispatcher"), case, None)],), timeout_s=60)
    assert all(v <= 1e-9 for v in r0[0]["errors"].values())
    # with torch's default device set to meta, it fails: an error, or wrong values the parity check sees
    try:
        (r0, _) = launch(run_grid, P, ([(system("helpers.HostOnlyDispatcher"), case, None)],), timeout_s=60,
                         default_device="meta")
    except RankFailed as err:
        assert "helpers.py" in str(err)            # raised where the defect is used
    else:
        assert max(r0[0]["errors"].values()) > 1e-3


@pytest.mark.timeout(300)
def test_whole_model_tasks_run_in_bfloat16(tmp_path):
    """model.dtype=bfloat16 (what a GPU run uses) runs prefill and train; the parity gate stays float64."""
    import subprocess
    import sys

    import pandas as pd
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "run.py", "-m", "system=occult", "model=olmoe_proxy", "task=prefill,train",
                           "cluster=cpu2", "model.dtype=bfloat16", *TINY, *TEXT, *TIMED,
                           f"hydra.sweep.dir={tmp_path}"],
                          cwd=root, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = [pd.read_parquet(p) for p in tmp_path.rglob("results.parquet")]
    assert sorted(df.task.iloc[0] for df in frames) == ["prefill", "train"]
    for df in frames:
        assert (df[df.metric == "parity_checked"].value == 1).all()
        assert (df[df.metric.str.startswith("parity_") & (df.metric != "parity_checked")].value <= 1e-9).all()
