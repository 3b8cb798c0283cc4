"""`make gpu-check`: everything in the harness that needs a GPU, on one GPU, into one results file.

    python -m occult.gpu_check                 # writes runs/gpu_check/<stamp>/gpu_check.json and .md
    python -m occult.gpu_check --tokens 4096   # a shorter check

Planned for one GPU (an H200) and at most 8 minutes; each step is timed, and a step that
cannot run (a library not installed, no second process) is recorded with why, the
others go on. Install the GPU extras first (``pip install -e '.[gpu]'``: triton,
megablocks).

1. The device: name, capability, memory, library versions.
2. Occult's Triton kernels against its PyTorch path at the OLMoE layer shape (E=64, K=8,
   D=2048, F=1024, ``--tokens`` 8192 tokens, bf16, one rank): outputs and every gradient
   compared first (relative error at most 2e-2 in bf16), then forward and forward+backward
   times of both paths; and the kernels at float32 on the parity suite's small cases
   against the single-device reference (1e-4).
3. The MegaBlocks library's dMoE experts at EP=1 (``system=megablocks``, ``library=on``)
   against the single-device reference (bf16), then its forward time beside the
   harness's scheme.
4. A one-rank NCCL world: ``python run.py -m cluster=gpu1 cluster.single_rank_collectives=true
   system=naive,occult task=layer model=bench_olmoe model.dtype=bfloat16``, every run's parity
   gate and its layer times. At P = 1 the harness's collectives are local copies; with
   ``single_rank_collectives`` they go through NCCL (the rank sends to itself), which
   ``NCCL_DEBUG=INFO``'s lines in the run's output confirm. One GPU cannot test an exchange
   between GPUs (NCCL refuses two ranks on one device): uneven splits between ranks, NVLink
   or network bandwidth and the overlap of collectives with compute need two GPUs or more.
5. The GPU's expert-GEMM throughput (the grouped SwiGLU of step 2's shape, bf16) and its
   memory bandwidth (a 1 GiB device-to-device copy). They replace the datasheet peak
   and efficiency of ``conf/profile/sim_h100x8.yaml`` in a measured profile written
   beside the results (``profile_<gpu>x8_measured.yaml``: compute and memory measured,
   links still the datasheet's), for ``python -m analysis.project RUNS --profile <that file>``.
6. CUDA graphs of the static decode step (``system.dispatch_mode=static``,
   :mod:`occult.ep.graphs`): naive's and Occult's MoE layer at the OLMoE shape on a decode
   step of 8 tokens (bf16, one rank) captured once, then replayed on fresh tokens against the
   eager layer (outputs equal to 1e-3), eager and replayed step times; and ``task=decode
   task.cuda_graph=true,false`` of Occult's static dispatch on a one-rank NCCL world
   (``cluster.single_rank_collectives``: the captured exchange goes through NCCL), random
   OLMoE-proxy weights, its per-token latency with and without the graphs.

The check exits with status 1 when any step failed (an exception), any of its checks is
false (the parity results, the NCCL world's), or the NCCL world's command failed, and it
prints the failed checks by name; a step that could not run (a library not installed) is
listed as skipped.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import traceback
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OCCULT = "occult.collab.dispatcher.OccultDispatcher"
MEGABLOCKS = "baselines.megablocks.MegaBlocksDispatcher"
NAIVE = "baselines.naive.NaiveDispatcher"
DECODE_TOKENS = 8
E, K, D, F = 64, 8, 2048, 1024
BF16_TOL, FP32_TOL = 2e-2, 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
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


def device_facts() -> dict:
    import importlib.metadata as md
    p = torch.cuda.get_device_properties(0)
    versions = {}
    for pkg in ("torch", "triton", "megablocks"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_GiB": p.total_memory / 2 ** 30,
            "multiprocessors": p.multi_processor_count, "versions": versions}


def _layer(ctx, system: dict, tokens: int, seed: int = 0):
    """One MoE layer of the OLMoE shape for ``system`` in bf16 on the GPU, with its inputs."""
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


def triton_kernels(tokens: int) -> dict:
    """Step 2: Occult's Triton path against its PyTorch path, then both timed."""
    from .parity import LayerCase, check_layer
    ctx = _world()
    res = {}
    layers = {k: _layer(ctx, {"name": "occult", "_target_": OCCULT, "kernels": k}, tokens) for k in ("torch", "triton")}
    (ref_out, ref_gx, ref_gp), (out, gx, gp) = (_fwd_bwd(*layers[k]) for k in ("torch", "triton"))
    errors = {"out": _rel(out, ref_out), "grad_x": _rel(gx, ref_gx)}
    errors.update({f"grad_{n}": _rel(gp[n], ref_gp[n]) for n in ref_gp if ref_gp[n] is not None})
    res["bf16_errors_vs_torch_path"] = errors
    res["bf16_parity"] = all(v <= BF16_TOL for v in errors.values())
    small = [LayerCase(8, 2, (37,), dtype="float32", hidden=64, ffn=32, seed=1),
             LayerCase(64, 8, (256,), dtype="float32", hidden=128, ffn=64, routing="router", seed=2)]
    fp32 = [check_layer(ctx, {"name": "occult", "_target_": OCCULT, "kernels": "triton"}, c)["errors"] for c in small]
    res["fp32_errors_vs_reference"] = fp32
    res["fp32_parity"] = all(v <= FP32_TOL for e in fp32 for v in e.values())
    if res["bf16_parity"] and res["fp32_parity"]:          # timed only once it is right
        for k, (layer, x, grad, ids) in layers.items():
            with torch.no_grad():
                res[f"{k}_forward_ms"] = _timed(lambda: layer(x, None, ids))
            res[f"{k}_forward_backward_ms"] = _timed(lambda: _fwd_bwd(layer, x, grad, ids))
        res["triton_over_torch_forward"] = res["triton_forward_ms"] / res["torch_forward_ms"]
        res["triton_over_torch_forward_backward"] = res["triton_forward_backward_ms"] / res["torch_forward_backward_ms"]
    return res


def megablocks_library(tokens: int) -> dict:
    """Step 3: the MegaBlocks library's dMoE experts at EP=1 against the reference."""
    from baselines.megablocks import library_available
    from .parity import LayerCase, check_layer
    if not library_available():
        return {"skipped": "megablocks does not import here (pip install -e '.[gpu]')"}
    ctx = _world()
    system = {"name": "megablocks", "_target_": MEGABLOCKS, "library": "on"}
    cases = [LayerCase(8, 2, (64,), dtype="bfloat16", hidden=128, ffn=64, seed=3),
             LayerCase(64, 8, (512,), dtype="bfloat16", hidden=256, ffn=128, routing="router", seed=4)]
    errors = [check_layer(ctx, system, c)["errors"] for c in cases]
    res = {"bf16_errors_vs_reference": errors, "bf16_parity": all(v <= BF16_TOL for e in errors for v in e.values())}
    if res["bf16_parity"]:
        for name, sysd in (("library", system), ("harness", {**system, "library": "off"})):
            layer, x, _, ids = _layer(ctx, sysd, tokens)
            with torch.no_grad():
                res[f"{name}_forward_ms"] = _timed(lambda: layer(x, None, ids))
    return res


def nccl_world(out: Path, tokens: int) -> dict:
    """Step 4: run.py on a one-rank NCCL world for naive and occult, its collectives through
    NCCL (``cluster.single_rank_collectives``; ``NCCL_DEBUG=INFO`` shows NCCL at work)."""
    import os

    import pandas as pd
    sweep = out / "nccl_gpu1"
    cmd = [sys.executable, "run.py", "-m", "cluster=gpu1", "cluster.single_rank_collectives=true",
           "system=naive,occult", "task=layer", "model=bench_olmoe", "model.dtype=bfloat16",
           f"task.tokens_per_rank={tokens}", "task.iters=3", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NCCL_DEBUG": "INFO"})
    res = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
           "nccl_used": "NCCL INFO" in proc.stdout + proc.stderr}
    if proc.returncode:
        res["stderr_tail"] = proc.stderr[-2000:]
        return res
    for path in sweep.rglob("results.parquet"):
        df = pd.read_parquet(path)
        sel = df[(df.metric == "time") & (df.phase == "layer")]
        res[df.system.iloc[0]] = {
            "parity_checked": bool((df[df.metric == "parity_checked"].value == 1).all()),
            "clock": df.clock.iloc[0], "device": df.device.iloc[0],
            "layer_ms": {d: float(sel[sel["pass"] == d].value.median()) for d in sorted(set(sel["pass"]))}}
    return res


def throughput(tokens: int) -> dict:
    """Step 5: grouped-SwiGLU throughput (bf16, step 2's shape) and device memory bandwidth."""
    from .ep.experts import grouped_swiglu
    _world()
    g = torch.Generator(device="cpu").manual_seed(5)
    to = dict(device="cuda:0", dtype=torch.bfloat16)
    rows = tokens * K
    x = torch.randn(rows, D, generator=g, device="cpu").to(**to)
    w = [torch.randn(E, *shape, generator=g, device="cpu").to(**to) / 30 for shape in ((D, F), (D, F), (F, D))]
    counts = torch.full((E,), rows // E, dtype=torch.long, device="cuda:0")
    ms = _timed(lambda: grouped_swiglu(x, counts, *w))
    big = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda:0")    # 1 GiB
    dst = torch.empty_like(big)
    copy_ms = _timed(lambda: dst.copy_(big))
    return {"grouped_swiglu_ms": ms, "grouped_swiglu_TFLOPs": 6 * rows * D * F / (ms / 1e3) / 1e12,
            "memory_GBps": 2 * big.numel() * big.element_size() / (copy_ms / 1e3) / 1e9,
            "rows": rows, "experts": E, "hidden": D, "ffn": F}


def cuda_graphs(out: Path) -> dict:
    """Step 6: the static decode step captured in a CUDA graph and replayed, against the
    eager layer; then task=decode with and without task.cuda_graph on a one-rank NCCL world."""
    import os

    import pandas as pd

    from .ep.graphs import GraphedCall
    ctx = _world()
    res = {}
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
    sweep = out / "decode_cuda_graph"
    cmd = [sys.executable, "run.py", "-m", "task=decode", "cluster=gpu1", "cluster.single_rank_collectives=true",
           "system=occult", "system.dispatch_mode=static", "task.cuda_graph=true,false", "model=olmoe_proxy",
           "model.init=random", "model.dtype=bfloat16", "task.new_tokens=16", "task.iters=3",
           f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    res["decode_command"] = " ".join(cmd[1:])
    res["decode_returncode"] = proc.returncode
    if proc.returncode:
        res["decode_stderr_tail"] = proc.stderr[-2000:]
        return res
    for path in sweep.rglob("results.parquet"):
        df = pd.read_parquet(path)
        graph = "graph" if "cuda_graph=true" in str(path.parent) else "eager"
        lat = df[(df.metric == "token_latency") & (df["rank"] == -1)].value
        res[f"decode_{graph}_token_latency_ms"] = float(lat.median())
        res[f"decode_{graph}_parity_checked"] = bool((df[df.metric == "parity_checked"].value == 1).all())
    return res


def measured_profile(name: str, tp: dict) -> str:
    """A projection profile: sim_h100x8's links (datasheet), this GPU's measured compute and memory."""
    import yaml

    from .ep.links import profile_fields
    base = profile_fields("sim_h100x8")
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    base.update(name=f"{slug}x8_measured", device_TFLOPs=round(tp["grouped_swiglu_TFLOPs"], 2),
                compute_efficiency=1.0, memory_GBps=round(tp["memory_GBps"], 1),
                source=f"device_TFLOPs and memory_GBps MEASURED by make gpu-check on {name} "
                       f"({datetime.now():%Y-%m-%d}); links and latencies from sim_h100x8 (datasheet, assumed)")
    return yaml.safe_dump(base, sort_keys=False)


# the steps: name -> fn(args, out_dir) -> the step's results (booleans are its checks)
STEPS = {"triton_kernels": lambda args, out: triton_kernels(args.tokens),
         "megablocks_library": lambda args, out: megablocks_library(args.tokens),
         "nccl_world": lambda args, out: nccl_world(out, args.tokens),
         "throughput": lambda args, out: throughput(args.tokens),
         "cuda_graphs": lambda args, out: cuda_graphs(out)}


def failed_checks(report: dict) -> list:
    """What failed, by name: a step's error, a check that is false (a boolean anywhere in a
    step's results), a command's non-zero return code."""
    failed = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, v in value.items():
                if key == "error":
                    failed.append(f"{prefix}: {v}")
                elif key == "returncode" and v:
                    failed.append(f"{prefix}.returncode = {v}")
                else:
                    walk(f"{prefix}.{key}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif value is False:
            failed.append(f"{prefix} is false")

    for name in STEPS:
        walk(name, report.get(name, {}))
    return failed


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the OLMoE-shaped layer")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False)")
    out = Path(args.out or ROOT / "runs" / "gpu_check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}")
    out.mkdir(parents=True, exist_ok=True)
    from .ep.measure import clock
    report = {"device": device_facts(), "tokens": args.tokens}
    for name, step in STEPS.items():
        t0 = clock()
        try:
            report[name] = step(args, out)
        except Exception as exc:  # noqa: BLE001 - one failed step must not lose the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = clock() - t0
        print(f"gpu-check {name}: {json.dumps(report[name], default=str)[:400]}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    if "grouped_swiglu_TFLOPs" in report.get("throughput", {}):
        path = out / f"profile_{re.sub(r'[^a-z0-9]+', '_', report['device']['name'].lower())}x8_measured.yaml"
        path.write_text(measured_profile(report["device"]["name"], report["throughput"]))
        report["measured_profile"] = str(path)
    report["failed"] = failed_checks(report)
    report["skipped"] = [f"{n}: {report[n]['skipped']}" for n in STEPS if "skipped" in report.get(n, {})]
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    lines = [f"# gpu-check on {report['device']['name']}", "", "```", json.dumps(report, indent=1, default=str), "```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print(out / "gpu_check.json")
    for line in report["skipped"]:
        print(f"gpu-check skipped {line}")
    if report["failed"]:
        print(f"gpu-check FAILED ({len(report['failed'])}):\n  " + "\n  ".join(report["failed"]), flush=True)
        raise SystemExit(1)
    print("gpu-check passed: every step ran and every check is true")


if __name__ == "__main__":
    main()
