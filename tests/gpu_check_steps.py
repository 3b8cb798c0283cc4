"""Stand-in steps for `make gpu-check`'s orchestration test (tests/test_gpu_check.py): each
runs in the check's own step process, as a real step does, and ends one way."""
import os
import signal
import subprocess
import sys
import time

from occult import gpu_check, gpu_steps


def passes(res, args, out):
    res["kept"] = 1
    res["parity"] = True


def raises(res, args, out):
    res["before_error"] = 42
    raise RuntimeError("the NCCL world did not start")


def hangs(res, args, out):
    """Starts a process of its own, then hangs: the step's timeout must end both."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    res["child_pid"] = child.pid
    res["before_hang"] = 7
    time.sleep(120)


def crashes(res, args, out):
    """Ends its process as a CUDA fault or a segfault would: no exception, no exit code of its own."""
    res["before_crash"] = 3
    os.kill(os.getpid(), signal.SIGSEGV)


def false_check(res, args, out):
    res["fp32_parity"] = False
    res["bf16_parity"] = True


def skipped(res, args, out):
    res["skipped"] = "megablocks is not installed"


def failed_command(res, args, out):
    """A command the step ran exits non-zero: the step itself returns normally."""
    ended = gpu_check.run_command([sys.executable, "-c", "import sys; print('no run', file=sys.stderr); "
                                   "sys.exit(3)"], out / "decode", 20)
    res.update({f"decode_{k}": v for k, v in ended.items()})
    res["decode_graph_token_latency_ms"] = 0.5


def static_step_on_cpu(ctx, spec):
    """The static_syncs step's rank function on a CPU rank (gloo): the device syncs and the
    sync debug mode, which need CUDA, recorded instead of set."""
    import torch
    modes = []
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_sync_debug_mode = modes.append
    found = gpu_steps._static_step_rank(ctx, spec)
    return {**found, "modes": modes}
