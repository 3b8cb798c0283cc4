"""`make gpu-check` is honest about failures, and its one-GPU NCCL world runs real collectives.

The check itself needs a GPU; its orchestration is run here on the CPU with its steps
replaced by stand-ins (tests/gpu_check_steps.py) that pass, raise, hang past the step's
timeout, crash, fail a check, skip, or run a command that fails: each is reported as
such, in the step's own process, with what the other steps (and the failed step itself,
before it failed) recorded kept. The one-rank world's collectives
(``cluster.single_rank_collectives``) are shown to reach the backend on gloo, as they
reach NCCL on the GPU.
"""
import json
import os

import pytest

from occult import gpu_check, gpu_steps
from occult.dist import launch

STANDINS = ("passes", "raises", "hangs", "crashes", "false_check", "skipped", "failed_command")


@pytest.fixture
def standins(monkeypatch):
    """The stand-in steps as the check's steps, on a machine taken to have CUDA; the step
    processes find tests/ on their path."""
    monkeypatch.setattr(gpu_check, "cuda_missing", lambda: "")
    monkeypatch.setattr(gpu_check, "STEPS", {n: f"gpu_check_steps:{n}" for n in STANDINS})
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:           # a killed child not yet reaped is a zombie
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(60)
def test_each_way_a_step_ends_is_reported_and_every_result_kept(standins, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", str(tmp_path), "--step-timeout", "3"])
    assert exit_.value.code == 1
    said = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    assert steps["passes"]["kept"] == 1 and steps["passes"]["returncode"] == 0
    # raised: its error and the value it set before, its traceback in full in its stderr file
    assert steps["raises"]["before_error"] == 42 and steps["raises"]["returncode"] == 1
    assert "RuntimeError: the NCCL world did not start" in (tmp_path / "raises.stderr").read_text()
    # hung: killed at the step's timeout with the process it started, its earlier result kept
    assert steps["hangs"]["before_hang"] == 7 and steps["hangs"]["timed_out"] == "killed after 3 s"
    assert 2.5 < steps["hangs"]["seconds"] < 20 and not _alive(steps["hangs"]["child_pid"])
    # crashed: a signal, no exception of its own
    assert steps["crashes"]["before_crash"] == 3 and steps["crashes"]["crashed"] == "ended by signal SIGSEGV"
    assert steps["failed_command"]["decode_graph_token_latency_ms"] == 0.5
    assert "no run" in steps["failed_command"]["decode_stderr_tail"]
    assert report["failed"] == [
        "raises: RuntimeError: the NCCL world did not start", "raises.returncode = 1",
        "hangs.returncode = -9", "hangs.timed_out: killed after 3 s",
        "crashes.returncode = -11", "crashes.crashed: ended by signal SIGSEGV",
        "false_check.fp32_parity is false", "failed_command.decode_returncode = 3"]
    assert "gpu-check skipped skipped: megablocks is not installed" in said
    assert "gpu-check FAILED (8)" in said and "passed" not in said.split("FAILED")[1]

    # --steps reruns one step into the same folder; the others' results are kept
    gpu_check.STEPS["raises"] = "gpu_check_steps:passes"
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--steps", "raises", "--step-timeout", "3"])
    again = json.loads((tmp_path / "gpu_check.json").read_text())
    assert again["steps"]["raises"]["kept"] == 1 and "error" not in again["steps"]["raises"]
    assert again["steps"]["hangs"] == steps["hangs"] and len(again["failed"]) == 6


def test_skipped_steps_are_named_in_the_pass(standins, tmp_path, capsys):
    gpu_check.main(["--out", str(tmp_path), "--steps", "passes,skipped"])       # no SystemExit: status 0
    said = capsys.readouterr().out
    assert "gpu-check passed: 1 of 2 steps ran and every check is true; 1 skipped (skipped)" in said


def test_a_machine_without_cuda_stops_in_one_line(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", str(tmp_path / "never")])
    assert str(exit_.value.code).startswith("make gpu-check needs a CUDA GPU: torch ") and "\n" not in exit_.value.code
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_static_sync_step_runs_a_recorded_static_decode_step_on_cpu():
    """The static_syncs step's own code through the task's entry points (prepare, setup,
    DecodeWorkload) on a CPU rank: its parity gate passes, the checked step exchanges
    (dispatch and combine per MoE layer) between the two sync-debug mode switches."""
    from hydra import compose, initialize_config_dir

    from gpu_check_steps import static_step_on_cpu
    from occult.config import CONF_DIR, register
    from occult.runner import build_spec
    from occult.tasks.model import prepare
    register()
    overrides = [o.replace("gpu1", "cpu1").replace("bfloat16", "float32") for o in gpu_steps.STATIC_DECODE]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    spec = prepare(build_spec(cfg, ".", "d"))
    (found,) = launch(static_step_on_cpu, 1, (spec,), single_rank_collectives=True, timeout_s=200)
    assert found["parity_checked"] and found["static_step_without_host_sync"]
    assert found["collectives_in_step"] == 2 * cfg.model.num_layers and found["modes"] == ["error", "default"]


@pytest.mark.timeout(60)
def test_single_rank_collectives_reach_the_backend():
    """At P = 1 the collectives are local copies; with single_rank_collectives they go
    through the backend (here gloo; NCCL in make gpu-check), with the same rows back."""
    from helpers import backend_calls_at_one_rank
    (local, same_local), = launch(backend_calls_at_one_rank, 1, timeout_s=50)
    (real, same_real), = launch(backend_calls_at_one_rank, 1, timeout_s=50, single_rank_collectives=True)
    assert local == {} and same_local
    assert real == {"all_to_all_single": 1, "all_gather_single": 1, "broadcast": 1, "barrier": 1} and same_real
