"""`make gpu-check` is honest about failures, and its one-GPU NCCL world runs real collectives.

The check itself needs a GPU; its entry point is run here with its steps replaced (the
device facts too), so that what it does with a failed step or a false check is tested on
any machine: exit status 1 and the failed checks named. The one-rank world's collectives
(``cluster.single_rank_collectives``) are shown to reach the backend on gloo, as they
reach NCCL on the GPU.
"""
import json

import pytest

from occult import gpu_check
from occult.dist import launch


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "device_facts", lambda: {"name": "Test GPU"})


def _steps(monkeypatch, **steps):
    monkeypatch.setattr(gpu_check, "STEPS", steps)


def test_a_failed_step_or_a_false_check_exits_1_and_is_named(fake_gpu, monkeypatch, tmp_path, capsys):
    def boom(args, out):
        raise RuntimeError("the NCCL world did not start")

    _steps(monkeypatch,
           triton_kernels=lambda args, out: {"bf16_parity": True, "fp32_parity": False},
           megablocks_library=lambda args, out: {"skipped": "megablocks does not import here"},
           nccl_world=boom,
           throughput=lambda args, out: {"memory_GBps": 1.0})
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", str(tmp_path)])
    assert exit_.value.code == 1
    said = capsys.readouterr().out
    assert "triton_kernels.fp32_parity is false" in said
    assert "nccl_world: RuntimeError: the NCCL world did not start" in said
    assert "bf16_parity" not in said.split("FAILED")[1]          # a true check is not a failure
    assert "skipped megablocks_library" in said
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(report["failed"]) == 2


def test_every_check_true_exits_0(fake_gpu, monkeypatch, tmp_path, capsys):
    _steps(monkeypatch, triton_kernels=lambda args, out: {"bf16_parity": True},
           nccl_world=lambda args, out: {"returncode": 0, "nccl_used": True,
                                         "naive": {"parity_checked": True}})
    gpu_check.main(["--out", str(tmp_path)])          # no SystemExit: status 0
    assert "gpu-check passed" in capsys.readouterr().out


def test_a_failed_command_and_a_false_nested_check_are_named():
    report = {"nccl_world": {"returncode": 2, "occult": {"parity_checked": False}}}
    assert gpu_check.failed_checks(report) == ["nccl_world.returncode = 2",
                                               "nccl_world.occult.parity_checked is false"]


@pytest.mark.timeout(60)
def test_single_rank_collectives_reach_the_backend():
    """At P = 1 the collectives are local copies; with single_rank_collectives they go
    through the backend (here gloo; NCCL in make gpu-check), with the same rows back."""
    from helpers import backend_calls_at_one_rank
    (local, same_local), = launch(backend_calls_at_one_rank, 1, timeout_s=50)
    (real, same_real), = launch(backend_calls_at_one_rank, 1, timeout_s=50, single_rank_collectives=True)
    assert local == {} and same_local
    assert real == {"all_to_all_single": 1, "all_gather_single": 1, "broadcast": 1, "barrier": 1} and same_real
