"""`make gpu-check`: everything in the harness that needs a GPU, on one GPU, into one results file.

    python -m occult.gpu_check                          # runs/gpu_check/<stamp>/gpu_check.json and .md
    python -m occult.gpu_check --tokens 4096            # a shorter check
    python -m occult.gpu_check --out DIR --steps nccl_world,cuda_graphs   # rerun two steps into DIR

Two ways in (docs/install.md): ``make gpu-check`` on a machine with CUDA and a network (a
CUDA torch and the GPU extras in ``.venv-gpu``), and ``make gpu-check-device`` on a machine
without a network that has a CUDA torch already (the lent H200: its own ``python3``, the
packages it lacks carried as wheels, :mod:`occult.gpu_wheels`). Both run this module.

Each step (:mod:`occult.gpu_steps`) runs in a process of its own (``--run-step``): a CUDA
fault, which is sticky for the rest of a process, stays in its step, and a step that hangs
is killed (with whatever it started) after ``--step-timeout`` seconds (150; ``--total-timeout``
caps all of them together); the collectives of its NCCL worlds time
out after 60 s. A step writes its results to ``<out>/<step>.json`` as it goes, so what it
measured before it failed, crashed or hung is kept; its output goes to ``<step>.stdout``
and ``<step>.stderr`` in full (``HYDRA_FULL_ERROR=1``). ``--steps`` reruns some steps into an
existing ``--out`` folder, keeping the other steps' results.

1. ``device``: name, capability, memory, the CUDA, NCCL and library versions.
2. ``triton_kernels``: Occult's Triton kernels against its PyTorch path at the OLMoE layer
   shape (E=64, K=8, D=2048, F=1024, ``--tokens`` 8192 tokens, bf16, one rank): outputs and
   every gradient compared first (relative error at most 2e-2 in bf16), then forward and
   forward+backward times of both paths; and the kernels at float32 (IEEE dot products)
   on the parity suite's small cases against the single-device reference (1e-4).
3. ``megablocks_library``: the MegaBlocks library's dMoE experts at EP=1 (``system=megablocks``,
   ``library=on``) against the single-device reference (bf16), then its forward time beside
   the harness's scheme; "not installed" (skipped) without the opt-in extra.
4. ``nccl_world``: ``python run.py -m cluster=gpu1 cluster.single_rank_collectives=true
   system=naive,occult task=layer model=bench_olmoe model.dtype=bfloat16``, every run's parity
   gate and its layer times. At P = 1 the harness's collectives are local copies; with
   ``single_rank_collectives`` they go through NCCL (the rank sends to itself), which
   ``NCCL_DEBUG=INFO``'s lines in the run's output confirm. One GPU cannot test an exchange
   between GPUs (NCCL refuses two ranks on one device): uneven splits between ranks, NVLink
   or network bandwidth and the overlap of collectives with compute need two GPUs or more.
5. ``throughput``: the device's dense bf16 matrix rate (an 8192^3 product), the expert GEMMs
   of step 2's shape as one grouped GEMM (``torch._grouped_mm``, else a batched product of
   equal groups: which one is recorded) and its memory bandwidth (a 1 GiB device-to-device
   copy). They replace the datasheet peak and the assumed efficiency of
   ``conf/profile/sim_h100x8.yaml`` in a measured profile written beside the results
   (``profile_<gpu>x8_measured.yaml``: ``device_TFLOPs`` the dense rate,
   ``compute_efficiency`` the grouped GEMM's share of it, memory measured, links still the
   datasheet's), for ``python -m analysis.project RUNS --profile <that file>``.
6. ``cuda_graphs``: the static decode step (``system.dispatch_mode=static``,
   :mod:`occult.ep.graphs`): naive's and Occult's MoE layer at the OLMoE shape on a decode
   step of 8 tokens (bf16, one rank) captured once, then replayed on fresh tokens against the
   eager layer (outputs equal to 1e-3), eager and replayed step times; and ``task=decode
   task.cuda_graph=true,false`` of Occult's static dispatch on a one-rank NCCL world
   (``cluster.single_rank_collectives``: the captured exchange goes through NCCL), random
   OLMoE-proxy weights, its per-token latency with and without the graphs.
7. ``static_syncs``: one recorded static decode step of the OLMoE proxy (Occult, one-rank
   NCCL world, through :mod:`occult.tasks.model`'s ``prepare``, ``setup`` and
   ``DecodeWorkload``) under ``torch.cuda.set_sync_debug_mode("error")``: a step that reads
   anything on the host fails, naming the operation.

The check exits with status 1 when any step failed (an exception, a non-zero exit, a crash
or a timeout, its own or a command's it ran), or any of its checks is false, and it prints
the failed checks by name; a step that could not run (a library not installed) is listed as
skipped, and the summary says so.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_TIMEOUT_S = 150.0          # one step, everything it starts included
STDERR_TAIL_LINES = 30          # of a failed step's stderr, in the report (the whole of it in its file)


# --- the orchestration: one process per step -------------------------------------------------

class StepResults(dict):
    """A step's results, written to its JSON file at every top-level assignment: what a step
    recorded survives its crash or its hang. Values are set whole (a nested dict mutated
    after its assignment is not written again)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self._write()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._write()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str))
        tmp.replace(self.path)


def import_target(target: str):
    """``"package.module:function"`` -> the function."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_step_here(name: str, target: str, args, out: Path) -> int:
    """In the step's own process: ``target(res, args, out)`` filling ``<out>/<name>.json``;
    an exception is recorded as the step's ``error`` (exit status 1)."""
    res = StepResults(out / f"{name}.json")
    args.deadline = time.monotonic() + args.step_timeout - 10      # for what the step starts: before the kill
    try:
        import_target(target)(res, args, out)
    except Exception as exc:  # noqa: BLE001 - recorded, then the step's process exits 1
        res["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        res["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
        return 1
    return 0


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills ``proc``'s process group (a step, and the runs and ranks it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_command(cmd: list, log: Path, timeout_s: float, env: dict | None = None) -> dict:
    """Runs ``cmd`` in ROOT in a process group of its own, stdout and stderr in full to
    ``log.stdout`` / ``log.stderr``; killed (group and all) after ``timeout_s``. Returns
    ``returncode`` (negative: the signal that ended it), ``seconds`` and, when it failed,
    ``timed_out`` / ``crashed`` and the last lines of its stderr."""
    stdout, stderr = log.with_suffix(".stdout"), log.with_suffix(".stderr")
    t0 = time.monotonic()
    timed_out = False
    with open(stdout, "w") as so, open(stderr, "w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=so, stderr=se, start_new_session=True,
                                env={**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
    res = {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 2), "stderr_file": stderr.name}
    if timed_out:
        res["timed_out"] = f"killed after {timeout_s:g} s"
    elif proc.returncode < 0:
        res["crashed"] = f"ended by signal {signal.Signals(-proc.returncode).name}"
    if proc.returncode:
        res["stderr_tail"] = "\n".join(stderr.read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:])
    return res


def run_step(name: str, target: str, args, out: Path) -> dict:
    """The parent's side of a step: its process (``--run-step``), then its results file read
    whatever became of the process, with how the process ended."""
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "occult.gpu_check", "--run-step", name, "--target", target, "--out", str(out),
           "--tokens", str(args.tokens), "--step-timeout", str(args.step_timeout)]
    ended = run_command(cmd, out / name, args.step_timeout)
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        res = {"results_file": f"unreadable: {type(exc).__name__}: {exc}"}
    res.update(ended)
    return res


def _gist(error: str) -> str:
    """A one-line form of an error message: its first line and, for a longer one (a rank's
    traceback), its last (the step's results keep it whole)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    gist = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return gist[:400]


def failed_checks(report: dict, steps) -> list:
    """What failed, by name: a step's error, a check that is false (a boolean anywhere in a
    step's results), a non-zero return code (a key ``returncode`` or ``*_returncode``), a
    timeout, a crash, a step not run."""
    failed = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, v in value.items():
                if key == "error":
                    failed.append(f"{prefix}: {_gist(v)}")
                elif key.endswith("returncode"):
                    if v:           # None (never started) or non-zero
                        failed.append(f"{prefix}.{key} = {v}")
                elif key.endswith(("timed_out", "crashed", "not_run")):
                    if v:
                        failed.append(f"{prefix}.{key}: {v}")
                else:
                    walk(f"{prefix}.{key}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif value is False:
            failed.append(f"{prefix} is false")

    for name in steps:
        walk(name, report["steps"].get(name, {}))
    return failed


def cuda_missing() -> str:
    """Why this machine cannot run the check ("" when it can)."""
    try:
        import torch
    except ImportError:
        return "make gpu-check needs a CUDA torch: torch does not import here"
    if not torch.cuda.is_available():
        return (f"make gpu-check needs a CUDA GPU: torch {torch.__version__} sees none "
                f"(torch.cuda.is_available() is False)")
    return ""


def summary(report: dict, steps) -> list:
    """The closing lines: failed checks, skipped steps, or the pass."""
    skipped = [f"{n}: {report['steps'][n]['skipped']}" for n in steps if "skipped" in report["steps"].get(n, {})]
    lines = [f"gpu-check skipped {s}" for s in skipped]
    if report["failed"]:
        lines.append(f"gpu-check FAILED ({len(report['failed'])}):\n  " + "\n  ".join(report["failed"]))
    elif skipped:
        lines.append(f"gpu-check passed: {len(steps) - len(skipped)} of {len(steps)} steps ran and every check "
                     f"is true; {len(skipped)} skipped ({', '.join(s.split(':')[0] for s in skipped)})")
    else:
        lines.append(f"gpu-check passed: all {len(steps)} steps ran and every check is true")
    return lines


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    name = report["steps"].get("device", {}).get("name", "an unnamed GPU")
    lines = [f"# gpu-check on {name}", "", f"{report['started']}, `{report['command']}`", "", "```",
             json.dumps(report, indent=1, default=str), "```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the OLMoE-shaped layer")
    ap.add_argument("--out", default=None, help="the results folder (default runs/gpu_check/<stamp>)")
    ap.add_argument("--steps", default=None, help=f"comma-separated steps to run (default all: {','.join(STEPS)})")
    ap.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S, help="seconds one step may take")
    ap.add_argument("--total-timeout", type=float, default=None,
                    help="seconds all steps may take together (a step gets what is left, up to --step-timeout; "
                         "one with under 10 s left is not started, which fails the check)")
    ap.add_argument("--run-step", default=None, help=argparse.SUPPRESS)   # a step's own process
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_step:
        raise SystemExit(run_step_here(args.run_step, args.target, args, Path(args.out)))
    steps = list(STEPS) if args.steps is None else [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise SystemExit(f"--steps: unknown step(s) {unknown}; allowed: {','.join(STEPS)}")
    why = cuda_missing()
    if why:
        raise SystemExit(why)
    out = Path(args.out or ROOT / "runs" / "gpu_check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}")
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "gpu_check.json"
    report = json.loads(previous.read_text()) if previous.exists() else {"steps": {}}
    report.update(started=f"{datetime.now():%Y-%m-%d %H:%M:%S}", tokens=args.tokens,
                  command="python -m occult.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]))
    end = time.monotonic() + (args.total_timeout or float("inf"))
    for name in steps:
        left = end - time.monotonic()
        if left < 10:
            report["steps"][name] = {"not_run": f"--total-timeout {args.total_timeout:g} s spent"}
        else:
            step_args = argparse.Namespace(**{**vars(args), "step_timeout": min(args.step_timeout, left)})
            report["steps"][name] = run_step(name, STEPS[name], step_args, out)
        print(f"gpu-check {name}: {json.dumps(report['steps'][name], default=str)[:400]}", flush=True)
        write_report(report, out)
    ran = [n for n in STEPS if n in report["steps"]]      # this call's steps and those kept from before
    report["failed"] = failed_checks(report, ran)
    write_report(report, out)
    print(out / "gpu_check.json")
    lines = summary(report, ran)
    print("\n".join(lines), flush=True)
    if report["failed"]:
        raise SystemExit(1)


# the steps, in order: name -> "module:function" (:mod:`occult.gpu_steps`), each run in a process of its own
STEPS = {"device": "occult.gpu_steps:device_facts", "triton_kernels": "occult.gpu_steps:triton_kernels",
         "megablocks_library": "occult.gpu_steps:megablocks_library", "nccl_world": "occult.gpu_steps:nccl_world",
         "throughput": "occult.gpu_steps:throughput", "cuda_graphs": "occult.gpu_steps:cuda_graphs",
         "static_syncs": "occult.gpu_steps:static_syncs"}


if __name__ == "__main__":
    main()
