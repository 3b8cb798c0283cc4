"""`make gpu-check`: everything in the harness that needs a GPU, on one GPU, into one results file.

    python -m occult.gpu_check                          # runs/gpu_check/<stamp>/gpu_check.json and .md
    python -m occult.gpu_check --tokens 4096            # a shorter check
    python -m occult.gpu_check --out DIR --steps nccl_world,cuda_graphs   # rerun two steps into DIR

Two ways in (docs/install.md): ``make gpu-check`` on a machine with CUDA and a network (a
CUDA torch and the GPU extras in ``.venv-gpu``), and ``make gpu-check-device`` on a machine
without a network that has a CUDA torch already (the lent H200: its own ``python3``, the
packages it lacks carried as wheels, :mod:`occult.gpu_wheels`). Both run this module.

Each step runs in a process of its own (``--run-step``): a CUDA fault, which is sticky for
the rest of a process, stays in its step, and a step that hangs is killed (with whatever
it started) after ``--step-timeout`` seconds (150); the collectives of its NCCL worlds time
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
import re
import signal
import subprocess
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OCCULT = "occult.collab.dispatcher.OccultDispatcher"
MEGABLOCKS = "baselines.megablocks.MegaBlocksDispatcher"
NAIVE = "baselines.naive.NaiveDispatcher"
DECODE_TOKENS = 8
E, K, D, F = 64, 8, 2048, 1024
BF16_TOL, FP32_TOL = 2e-2, 1e-4
STEP_TIMEOUT_S = 150.0          # one step, everything it starts included
COLLECTIVE_TIMEOUT_S = 60       # the collectives of a step's NCCL worlds
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
    tp, dev = report["steps"].get("throughput", {}), report["steps"].get("device", {})
    if "throughput" in steps and "dense_bf16_TFLOPs" in tp and "grouped_gemm_TFLOPs" in tp and "memory_GBps" in tp:
        name = dev.get("name", "gpu")
        path = out / f"profile_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}x8_measured.yaml"
        try:
            path.write_text(measured_profile(name, tp))
            report["measured_profile"] = str(path)
        except Exception as exc:  # noqa: BLE001 - the steps' results are written whatever the profile does
            report["measured_profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    ran = [n for n in STEPS if n in report["steps"]]      # this call's steps and those kept from before
    report["failed"] = failed_checks(report, ran) + failed_checks({"steps": report}, ["measured_profile"])
    write_report(report, out)
    print(out / "gpu_check.json")
    lines = summary(report, ran)
    print("\n".join(lines), flush=True)
    if report["failed"]:
        raise SystemExit(1)


# --- the steps: fn(res, args, out) fills res (a StepResults); booleans are its checks ---------

def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _timed(fn, reps: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the device (synchronised clock), after one warm-up."""
    from .ep.measure import clock
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _world():
    """A one-rank context on cuda:0 (no process group: nothing is exchanged at P = 1)."""
    from .dist import RankContext
    from .ep import EPGroup
    from .ep.measure import use_device
    use_device("cuda:0")
    return RankContext(0, 1, EPGroup(0, 1, None, "cuda:0"), 0)


def device_facts(res, args, out) -> None:
    """Step 1: the device and the versions the check runs with."""
    import importlib.metadata as md
    import platform

    import torch
    p = torch.cuda.get_device_properties(0)
    res.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_GiB=round(p.total_memory / 2 ** 30, 1),
               multiprocessors=p.multi_processor_count, python=platform.python_version(),
               cuda=torch.version.cuda, nccl=str(torch.cuda.nccl.version()))
    versions = {}
    for pkg in ("torch", "triton", "transformers", "hydra-core", "omegaconf", "numpy", "pandas", "megablocks",
                "grouped_gemm"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    res["versions"] = versions


def _layer(ctx, system: dict, tokens: int, seed: int = 0):
    """One MoE layer of the OLMoE shape for ``system`` in bf16 on the GPU, with its inputs."""
    import torch

    from .ep import MoELayer, system_config
    from .ep.experts import init_expert_weights
    from .synthetic import expert_popularity, sample_topk
    g = torch.Generator(device="cpu").manual_seed(seed)
    to = dict(device=ctx.device, dtype=torch.bfloat16)
    router = (torch.randn(E, D, generator=g, device="cpu") / D ** 0.5).to(**to)
    experts = {k: w.to(**to) for k, w in init_expert_weights(E, D, F, g).items()}
    dispatcher = system_config(system).build(ctx.ep, 0, E)
    layer = MoELayer.from_global(router, experts, K, dispatcher)
    x = torch.randn(tokens, D, generator=g, device="cpu").to(**to)
    grad = torch.randn(tokens, D, generator=g, device="cpu").to(**to)
    ids = sample_topk(tokens, K, expert_popularity("uniform", E), g).to(ctx.device)
    return layer, x, grad, ids


def _fwd_bwd(layer, x, grad, ids):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = layer(xi, None, ids)
    out.backward(grad)
    return out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}


def triton_kernels(res, args, out) -> None:
    """Step 2: Occult's Triton path against its PyTorch path, then both timed."""
    import torch

    from .kernels.triton_moe import DOT_PRECISION
    from .parity import LayerCase, check_layer
    ctx = _world()
    res["float32_dot_precision"] = DOT_PRECISION[torch.float32]
    layers = {k: _layer(ctx, {"name": "occult", "_target_": OCCULT, "kernels": k}, args.tokens)
              for k in ("torch", "triton")}
    (ref_out, ref_gx, ref_gp), (y, gx, gp) = (_fwd_bwd(*layers[k]) for k in ("torch", "triton"))
    errors = {"out": _rel(y, ref_out), "grad_x": _rel(gx, ref_gx)}
    errors.update({f"grad_{n}": _rel(gp[n], ref_gp[n]) for n in ref_gp if ref_gp[n] is not None})
    res["bf16_errors_vs_torch_path"] = errors
    res["bf16_parity"] = all(v <= BF16_TOL for v in errors.values())
    small = [LayerCase(8, 2, (37,), dtype="float32", hidden=64, ffn=32, seed=1),
             LayerCase(64, 8, (256,), dtype="float32", hidden=128, ffn=64, routing="router", seed=2)]
    fp32 = [check_layer(ctx, {"name": "occult", "_target_": OCCULT, "kernels": "triton"}, c)["errors"] for c in small]
    res["fp32_errors_vs_reference"] = fp32
    res["fp32_parity"] = all(v <= FP32_TOL for e in fp32 for v in e.values())
    if not (res["bf16_parity"] and res["fp32_parity"]):
        res["timings"] = "not taken: a parity check failed"
        return
    for k, (layer, x, grad, ids) in layers.items():      # timed only once it is right
        with torch.no_grad():
            res[f"{k}_forward_ms"] = _timed(lambda: layer(x, None, ids))
        res[f"{k}_forward_backward_ms"] = _timed(lambda: _fwd_bwd(layer, x, grad, ids))
    res["triton_over_torch_forward"] = res["triton_forward_ms"] / res["torch_forward_ms"]
    res["triton_over_torch_forward_backward"] = res["triton_forward_backward_ms"] / res["torch_forward_backward_ms"]


def megablocks_library(res, args, out) -> None:
    """Step 3: the MegaBlocks library's dMoE experts at EP=1 against the reference."""
    import torch

    from baselines.megablocks import library_available

    from .parity import LayerCase, check_layer
    if not library_available():
        res["skipped"] = "megablocks is not installed (opt-in: make gpu-megablocks)"
        return
    ctx = _world()
    system = {"name": "megablocks", "_target_": MEGABLOCKS, "library": "on"}
    cases = [LayerCase(8, 2, (64,), dtype="bfloat16", hidden=128, ffn=64, seed=3),
             LayerCase(64, 8, (512,), dtype="bfloat16", hidden=256, ffn=128, routing="router", seed=4)]
    errors = [check_layer(ctx, system, c)["errors"] for c in cases]
    res["bf16_errors_vs_reference"] = errors
    res["bf16_parity"] = all(v <= BF16_TOL for e in errors for v in e.values())
    if res["bf16_parity"]:
        for name, sysd in (("library", system), ("harness", {**system, "library": "off"})):
            layer, x, _, ids = _layer(ctx, sysd, args.tokens)
            with torch.no_grad():
                res[f"{name}_forward_ms"] = _timed(lambda: layer(x, None, ids))


def _time_left(args) -> float:
    """Seconds a command or world the step starts may take: what is left of the step's limit,
    less 10 s to record how it ended before the step itself is killed (at least 5)."""
    return max(args.deadline - time.monotonic(), 5.0)


def _harness_run(res, key: str, overrides: list, out: Path, args, env: dict | None = None) -> Path:
    """``python run.py -m <overrides>`` into ``<out>/<key>`` (collectives time out after
    60 s; the run itself inside what is left of the step's limit): how it ended under ``<key>_*`` in
    ``res``, its output in ``<key>.stdout`` / ``.stderr``. Returns the sweep folder, whose
    results the caller reads whatever the return code."""
    sweep = out / key
    cmd = [sys.executable, "run.py", "-m", *overrides, f"cluster.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
           f"hydra.sweep.dir={sweep}"]
    res[f"{key}_command"] = " ".join(cmd[1:])
    ended = run_command(cmd, out / key, _time_left(args), env)
    res.update({f"{key}_{k}": v for k, v in ended.items()})
    return sweep


def nccl_world(res, args, out) -> None:
    """Step 4: run.py on a one-rank NCCL world for naive and occult, its collectives through
    NCCL (``cluster.single_rank_collectives``; ``NCCL_DEBUG=INFO`` shows NCCL at work)."""
    import pandas as pd
    sweep = _harness_run(res, "nccl_gpu1", ["cluster=gpu1", "cluster.single_rank_collectives=true",
                                            "system=naive,occult", "task=layer", "model=bench_olmoe",
                                            "model.dtype=bfloat16", f"task.tokens_per_rank={args.tokens}",
                                            "task.iters=3"], out, args, {"NCCL_DEBUG": "INFO"})
    logs = "".join((out / f"nccl_gpu1.{s}").read_text(errors="replace") for s in ("stdout", "stderr"))
    res["nccl_used"] = "NCCL INFO" in logs
    for path in sorted(sweep.rglob("results.parquet")):
        df = pd.read_parquet(path)
        sel = df[(df.metric == "time") & (df.phase == "layer")]
        res[df.system.iloc[0]] = {
            "parity_checked": bool((df[df.metric == "parity_checked"].value == 1).all()),
            "clock": df.clock.iloc[0], "device": df.device.iloc[0],
            "layer_ms": {d: float(sel[sel["pass"] == d].value.median()) for d in sorted(set(sel["pass"]))}}
    res["both_systems_ran"] = {"naive", "occult"} <= set(res)


def _grouped_gemm(x_RD, w_eDF, counts_e):
    """The rows' expert products as one grouped GEMM: ``torch._grouped_mm`` where this torch
    has it, else a batched product (the groups are equal); returns (fn, what it is)."""
    import torch
    offs = torch.cumsum(counts_e, 0).to(torch.int32)
    if hasattr(torch, "_grouped_mm"):
        w_t = w_eDF.transpose(-2, -1).contiguous().transpose(-2, -1)      # column-major B, as it asks
        fn = lambda: torch._grouped_mm(x_RD, w_t, offs=offs)   # noqa: E731
        try:
            fn()
            return fn, "torch._grouped_mm"
        except RuntimeError as exc:
            why = f"torch._grouped_mm refused ({str(exc)[:200]}); "
    else:
        why = "no torch._grouped_mm; "
    e = w_eDF.shape[0]
    x_eRD = x_RD.view(e, -1, x_RD.shape[1])
    return (lambda: torch.bmm(x_eRD, w_eDF)), why + "torch.bmm over equal groups"


def throughput(res, args, out) -> None:
    """Step 5: the dense bf16 matrix rate, the expert GEMMs of step 2's shape as one grouped
    GEMM (its share of the dense rate: the profile's compute efficiency), memory bandwidth;
    and the harness's own grouped SwiGLU (a Python loop over the experts) beside them."""
    import torch

    from .ep.experts import grouped_swiglu
    _world()
    g = torch.Generator(device="cuda:0").manual_seed(5)
    to = dict(device="cuda:0", dtype=torch.bfloat16)
    n = 8192
    a, b = (torch.randn(n, n, generator=g, **to) for _ in range(2))
    dense_ms = _timed(lambda: a @ b, reps=10)
    res.update(dense_bf16_ms=dense_ms, dense_bf16_TFLOPs=2 * n ** 3 / (dense_ms / 1e3) / 1e12, dense_shape=[n, n, n])
    del a, b
    rows = args.tokens * K
    x = torch.randn(rows, D, generator=g, **to)
    w_gate, w_up = (torch.randn(E, D, F, generator=g, **to) / 30 for _ in range(2))
    w_down = torch.randn(E, F, D, generator=g, **to) / 30
    counts = torch.full((E,), rows // E, dtype=torch.long, device="cuda:0")
    gate, how = _grouped_gemm(x, w_gate, counts)
    up, _ = _grouped_gemm(x, w_up, counts)
    h = torch.randn(rows, F, generator=g, **to)
    down, _ = _grouped_gemm(h, w_down, counts)
    ms = _timed(lambda: (gate(), up(), down()), reps=10)
    flops = 3 * 2 * rows * D * F
    res.update(grouped_gemm=how, grouped_gemm_ms=ms, grouped_gemm_TFLOPs=flops / (ms / 1e3) / 1e12,
               rows=rows, experts=E, hidden=D, ffn=F)
    res["grouped_gemm_efficiency"] = res["grouped_gemm_TFLOPs"] / res["dense_bf16_TFLOPs"]
    loop_ms = _timed(lambda: grouped_swiglu(x, counts, w_gate, w_up, w_down))
    res.update(harness_grouped_swiglu_ms=loop_ms, harness_grouped_swiglu_TFLOPs=flops / (loop_ms / 1e3) / 1e12)
    big = torch.empty(2 ** 29, **to)    # 1 GiB
    big.normal_(generator=g)
    dst = torch.empty_like(big)
    copy_ms = _timed(lambda: dst.copy_(big), reps=10)
    res["memory_GBps"] = 2 * big.numel() * big.element_size() / (copy_ms / 1e3) / 1e9


def measured_profile(name: str, tp: dict) -> str:
    """A projection profile: sim_h100x8's links (datasheet), this GPU's measured compute
    (the dense rate, and the grouped GEMM's share of it as the efficiency) and memory."""
    import yaml

    from .ep.links import profile_fields
    base = profile_fields("sim_h100x8")
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    base.update(name=f"{slug}x8_measured", device_TFLOPs=round(tp["dense_bf16_TFLOPs"], 1),
                compute_efficiency=round(tp["grouped_gemm_efficiency"], 3), memory_GBps=round(tp["memory_GBps"], 1),
                source=f"MEASURED by make gpu-check on {name} ({datetime.now():%Y-%m-%d}): device_TFLOPs a dense "
                       f"{tp['dense_shape'][0]}^3 bf16 product, compute_efficiency the grouped GEMM "
                       f"({tp['grouped_gemm']}, {tp['rows']} rows over {tp['experts']} experts, D={tp['hidden']}, "
                       f"F={tp['ffn']}) over it, memory_GBps a 1 GiB device copy; links and latencies from "
                       f"sim_h100x8 (datasheet, assumed)")
    return yaml.safe_dump(base, sort_keys=False)


def cuda_graphs(res, args, out) -> None:
    """Step 6: the static decode step captured in a CUDA graph and replayed, against the
    eager layer; then task=decode with and without task.cuda_graph on a one-rank NCCL world."""
    import pandas as pd
    import torch

    from .ep.graphs import GraphedCall
    ctx = _world()
    g = torch.Generator(device="cpu").manual_seed(6)
    for name, target in (("naive", NAIVE), ("occult", OCCULT)):
        system = {"name": name, "_target_": target, "dispatch_mode": "static", "max_tokens_per_rank": DECODE_TOKENS}
        layer, x, _, _ = _layer(ctx, system, DECODE_TOKENS)
        with torch.no_grad():
            graphed = GraphedCall(lambda x_TD: layer(x_TD), [x])
            fresh = [torch.randn(DECODE_TOKENS, D, generator=g, device="cpu").to(x) for _ in range(3)]
            res[f"{name}_replay_error"] = max(_rel(graphed(xi), layer(xi)) for xi in fresh)
            res[f"{name}_replay_parity"] = res[f"{name}_replay_error"] <= 1e-3
            res[f"{name}_eager_ms"] = _timed(lambda: layer(fresh[0]))
            res[f"{name}_replay_ms"] = _timed(lambda: graphed(fresh[0]))
    sweep = _harness_run(res, "decode", ["task=decode", "cluster=gpu1", "cluster.single_rank_collectives=true",
                                         "system=occult", "system.dispatch_mode=static",
                                         "task.cuda_graph=true,false", "model=olmoe_proxy", "model.init=random",
                                         "model.dtype=bfloat16", "task.new_tokens=16", "task.iters=3"], out, args)
    for path in sorted(sweep.rglob("results.parquet")):
        df = pd.read_parquet(path)
        graph = "graph" if "cuda_graph=true" in str(path.parent) else "eager"
        lat = df[(df.metric == "token_latency") & (df["rank"] == -1)].value
        res[f"decode_{graph}_token_latency_ms"] = float(lat.median())
        res[f"decode_{graph}_parity_checked"] = bool((df[df.metric == "parity_checked"].value == 1).all())
    res["decode_both_ran"] = all(f"decode_{k}_token_latency_ms" in res for k in ("graph", "eager"))


STATIC_DECODE = ["task=decode", "cluster=gpu1", "cluster.single_rank_collectives=true", "system=occult",
                 "system.dispatch_mode=static", "model=olmoe_proxy", "model.init=random", "model.dtype=bfloat16",
                 "task.new_tokens=2", "task.warmup=0", "task.iters=1"]


def static_syncs(res, args, out) -> None:
    """Step 7: one recorded static decode step of Occult on a one-rank NCCL world under
    ``torch.cuda.set_sync_debug_mode("error")`` (the step must read nothing on the host)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from .config import CONF_DIR, register
    from .dist import launch
    from .tasks.model import prepare
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=STATIC_DECODE)
    cfg_dict = prepare({**OmegaConf.to_container(cfg, resolve=True), "out_dir_resolved": str(out)})
    res["overrides"] = " ".join(STATIC_DECODE)
    (found,) = launch(_static_step_rank, 1, (cfg_dict,), backend="nccl", single_rank_collectives=True,
                      timeout_s=_time_left(args), collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    res.update(found)


def _static_step_rank(ctx, cfg_dict: dict) -> dict:
    """On the rank: the model (its parity gate first), the prompt (dynamic), one static step
    eager to warm up, then one recorded static step with host syncs made errors."""
    import torch
    from omegaconf import OmegaConf

    from .ep import Recorder
    from .ep.accounting import recording
    from .ep.static import dynamic_calls
    from .tasks.model import DecodeWorkload, setup
    cfg = OmegaConf.create(cfg_dict)
    model, tok, rows = setup(ctx, cfg)
    work = DecodeWorkload(ctx, cfg, tok, model)
    rec = Recorder(rank=ctx.rank)

    def next_inputs(outs):
        return [{"input_ids": o.logits[:, -1].argmax(-1, keepdim=True), "cache": o.cache, "use_cache": True}
                for o in outs]

    found = {"parity_checked": any(r.get("metric") == "parity_checked" and r.get("value") == 1 for r in rows)}
    with torch.no_grad(), recording(rec):
        with dynamic_calls():
            outs = work.forward([{"input_ids": x, "use_cache": True} for x in work.x_mBS])
        outs = work.forward(next_inputs(outs))
        torch.cuda.synchronize()
        before = len(rec.comm)
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = work.forward(next_inputs(outs))
            found["static_step_without_host_sync"] = True
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            found["static_step_without_host_sync"] = False
            found["host_sync"] = f"{exc}"[:500]
            found["host_sync_traceback"] = traceback.format_exc()[-4000:]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    found["collectives_in_step"] = len(rec.comm) - before
    found["step_exchanged"] = found["collectives_in_step"] > 0
    return found


# the steps, in order: name -> "module:function" (run in a process of its own)
STEPS = {name: f"occult.gpu_check:{fn.__name__}" for name, fn in (
    ("device", device_facts), ("triton_kernels", triton_kernels), ("megablocks_library", megablocks_library),
    ("nccl_world", nccl_world), ("throughput", throughput), ("cuda_graphs", cuda_graphs),
    ("static_syncs", static_syncs))}


if __name__ == "__main__":
    main()
