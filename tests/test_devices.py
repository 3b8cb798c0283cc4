"""Every tensor a rank makes is on the rank's device.

The ranks run with torch's default device set to ``meta`` while every real tensor is
explicitly on ``cpu`` (the rank's device here): a tensor made without the device of its
inputs is a meta tensor, which cannot mix with the real ones (an error) or gives wrong
values (caught by the parity check every run makes first). Run over every system and
every task (layer, prefill, decode, train, finetune; simulate: every plan), and shown to catch a system that
makes one index tensor without ``device=`` (``helpers.HostOnlyDispatcher``). A whole model in
bfloat16 (what a GPU run uses) runs prefill and train in the same world.
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from occult.config import CONF_DIR, register
from occult.dist import RankFailed, launch
from occult.ep import import_object, system_config
from occult.parity import LayerCase, run_grid
from occult.placement import save_placements
from occult.runner import build_spec
from occult.ep import Placement

from static_helpers import STATIC_PROXIES, check_static_decode
from systems import system, system_configs

TINY = ["model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2"]
TEXT = ["task.batch_size=2", "task.seq_len=16"]
TIMED = ["task.warmup=0", "task.iters=1"]
MODELS = {"layer": "layer_small"}
TASKS = {"layer": [*TIMED, "task.tokens_per_rank=64"], "prefill": [*TEXT, *TIMED],
         "decode": [*TEXT, *TIMED, "task.new_tokens=2"], "train": [*TEXT, *TIMED],
         "finetune": [*TEXT, "task.tokens_per_rank=64", "task.steps=1"],
         "simulate": ["task.routing=uniform", "task.tokens_per_rank=16", "cluster.devices_per_node=1"]}
P = 2


def _prepared(cfg, system: dict, out_dir: Path):
    """The run spec of a composed config with ``system`` (a system's dict) in place of its
    own, prepared as the runner prepares it."""
    spec = build_spec(cfg, out_dir, "d").replace(system=system_config(system))
    task = spec.task
    return import_object(task.prepare)(spec) if task.prepare else spec


def every_job(tmp_path: Path) -> list:
    """``(label, entry, spec)`` of every system on every task, its other exact paths on
    the layer task, and a whole model in bfloat16 (what a GPU run uses): each task composed
    once, each system's YAML put in its place (composition costs 0.2 s a config)."""
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = {task: compose("config", overrides=[f"task={task}", f"model={MODELS.get(task, 'olmoe_proxy')}",
                                                         f"cluster=cpu{P}", *TINY, *tiny_task])
                    for task, tiny_task in TASKS.items()}
        # the decode task's steps in fixed buffers on every proxy (system.dispatch_mode=static; its
        # exactness is the parity suite's): static_helpers.check_static_decode reads the rows
        static_decode = {model: compose("config", overrides=["task=decode", f"model={model}", f"cluster=cpu{P}", *TINY,
                                                               *TASKS["decode"], "task.check_parity=false"])
                         for model in STATIC_PROXIES}
        bf16 = {task: compose("config", overrides=[f"task={task}", "model=olmoe_proxy", f"cluster=cpu{P}", *TINY,
                                                     *TASKS[task], "model.dtype=bfloat16"])
                for task in ("prefill", "train")}
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
        extra = {"placement_file": str(placement_file)} if name == "occult_placed" else {}
        for task in TASKS:
            if not config.expert_parallel and task in ("layer", "finetune", "simulate"):
                continue
            if task == "simulate" and config.plan_refusal():
                continue
            if task == "prefill" and name != "naive":
                # task=decode runs every system's MoE forward on the prompt first; the model's
                # cache-less prompt forward (task=prefill) differs only outside the MoE layers
                continue
            options = dict(extra)
            if name == "occult_prune_sim":    # finetune profiles the router itself; the others need a file
                options.update({"profile_tokens": 64} if task == "finetune" else {"similarity_file": str(similarity_file)})
            jobs.append((f"{name}/{task}", *_entry_and_cfg(composed[task], {**yaml_cfg, **options},
                                                           tmp_path / f"{name}-{task}")))
        # a system's other exact paths (e.g. Occult's fused experts step, which auto takes only
        # for a large EPD), on one layer forward and backward
        for path in config.other_exact_paths() if config.is_exact() else []:
            jobs.append((f"{name}{path}/layer", *_entry_and_cfg(composed["layer"], {**yaml_cfg, **extra, **path},
                                                                tmp_path / f"{name}-layer-{path}")))
    for model, cfg in static_decode.items():
        for name in ("naive", "occult"):
            jobs.append((f"static decode/{model}/{name}",
                         *_entry_and_cfg(cfg, {**system_configs()[name], "dispatch_mode": "static"},
                                         tmp_path / f"static-{model}-{name}")))
    occult = system_configs()["occult"]
    for task, cfg in bf16.items():
        jobs.append((f"occult/{task}/bfloat16", *_entry_and_cfg(cfg, occult, tmp_path / f"occult-{task}-bf16")))
    return jobs


def _entry_and_cfg(cfg, system: dict, out_dir: Path) -> tuple:
    spec = _prepared(cfg, system, out_dir)
    return spec.task.entry, spec


@pytest.mark.timeout(600)
def test_every_system_and_task_keeps_its_tensors_on_the_rank_device(tmp_path):
    jobs = every_job(tmp_path)
    assert len(jobs) >= 30
    per_rank = launch(import_object("helpers.task_rows"), P, (jobs,), timeout_s=560, collective_timeout_s=120,
                      default_device="meta")
    labels = {label for label, *_ in jobs}
    for rank, rank_out in enumerate(per_rank):
        assert set(rank_out) == labels and all(rows for rows in rank_out.values())
        static = [label for label in labels if label.startswith("static decode/")]
        assert len(static) == 2 * len(STATIC_PROXIES)
        for label in static:
            check_static_decode(rank_out[label], rank, label)
    # model.dtype=bfloat16 runs prefill and train; the parity gate stays float64
    for label in ("occult/prefill/bfloat16", "occult/train/bfloat16"):
        for rank_out in per_rank:
            rows = rank_out[label]
            assert [r["value"] for r in rows if r["metric"] == "parity_checked"] == [1.0], label
            errors = [r["value"] for r in rows if r["metric"].startswith("parity_") and r["metric"] != "parity_checked"]
            assert errors and max(errors) <= 1e-9, label
            assert any(r["metric"] in ("ttft", "time") for r in rows), label


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
