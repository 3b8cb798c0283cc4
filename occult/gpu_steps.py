"""The steps of `make gpu-check` (:mod:`occult.gpu_check` lists them and runs each in a
process of its own): ``fn(res, args, out)`` fills ``res`` (a :class:`occult.gpu_check.StepResults`,
written as it is filled), booleans being its checks; ``args`` has ``tokens``, ``step_timeout``
and ``deadline``; ``out`` is the results folder. Each needs a CUDA GPU.

Shapes: the OLMoE layer's E experts, top-K, hidden D, expert FFN F; T tokens, R rows.
"""
from __future__ import annotations

import re
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

from .gpu_check import run_command

OCCULT = "occult.collab.dispatcher.OccultDispatcher"
MEGABLOCKS = "baselines.megablocks.MegaBlocksDispatcher"
NAIVE = "baselines.naive.NaiveDispatcher"
DECODE_TOKENS = 8
E, K, D, F = 64, 8, 2048, 1024
BF16_TOL, FP32_TOL = 2e-2, 1e-4
COLLECTIVE_TIMEOUT_S = 60       # the collectives of a step's NCCL worlds


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
    and the harness's own grouped SwiGLU (a Python loop over the experts) beside them. Then
    the measured profile, ``<out>/profile_<gpu>x8_measured.yaml``."""
    import torch

    from .ep.experts import grouped_swiglu
    _world()
    g = torch.Generator(device="cuda:0").manual_seed(5)
    to = dict(device="cuda:0", dtype=torch.bfloat16)
    n = 8192
    a, b = (torch.randn(n, n, generator=g, **to) for _ in range(2))
    dense_ms = _timed(lambda: a @ b, reps=10)
    res.update(dense_bf16_ms=dense_ms, dense_bf16_TFLOPs=2 * n ** 3 / (dense_ms / 1e3) / 1e12, dense_shape=[n, n, n])
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
    name = torch.cuda.get_device_name(0)
    path = out / f"profile_{_slug(name)}x8_measured.yaml"
    path.write_text(measured_profile(name, res))
    res["measured_profile"] = str(path)


def _slug(name: str) -> str:
    """A device name as a file-name part: ``NVIDIA H200`` -> ``nvidia_h200``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def measured_profile(name: str, tp: dict) -> str:
    """A projection profile: sim_h100x8's links (datasheet), this GPU's measured compute
    (the dense rate, and the grouped GEMM's share of it as the efficiency) and memory."""
    import yaml

    from .ep.profiles import profile_fields
    base = profile_fields("sim_h100x8")
    base.update(name=f"{_slug(name)}x8_measured", device_TFLOPs=round(tp["dense_bf16_TFLOPs"], 1),
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
    from .tasks.model import DecodeWorkload, call_tokens, setup
    cfg = OmegaConf.create(cfg_dict)
    model, tok, rows = setup(ctx, cfg, call_tokens(cfg))
    work = DecodeWorkload(ctx, cfg, tok, model)
    # times by device marks read after the step: a synchronised clock would itself be a host sync
    rec = Recorder(rank=ctx.rank, marks=True)

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
