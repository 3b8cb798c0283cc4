"""Benchmarks: systems side by side in the same world, same weights, same routing.

    python -m analysis.bench                       # (make bench) naive vs occult, both shapes
    python -m analysis.bench --shapes comm --iters 3

Every system is first checked against the single-device reference; then the
systems' iterations alternate, so that machine noise hits them alike. Reported:
ratios to the first system (remote bytes, all-to-all time per phase and pass,
layer time forward and forward+backward), the share of layer time spent in a
system's own index work (spans named ``<system>_*``), and the activation
memory each keeps for backward. Output: runs/bench/<stamp>/ (results.parquet,
bench.csv, bench.md).
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from occult.dist import launch
from occult.ep import Placement, Recorder
from occult.memory import saved_activation_bytes
from occult.records import make_frame, row, write_results
from occult.tasks.common import comm_rows, parity_gate, routing_rows
from occult.tasks.layer import build_layer, make_inputs, time_iteration

from .summary import run_table

# name: (hidden D, expert FFN F, tokens per rank T)
SHAPES = {"olmoe": (2048, 1024, 512), "comm": (2048, 16, 2048)}
SYSTEMS = {"naive": "baselines.naive.NaiveDispatcher", "occult": "occult.collab.dispatcher.OccultDispatcher"}


def bench_cfg(system: str, shape: str, E: int, K: int, P: int, iters: int, seed: int) -> dict:
    D, F, T = SHAPES[shape]
    return {"system": {"name": system, "_target_": SYSTEMS[system]},
            "model": {"name": f"bench_{shape}", "num_experts": E, "top_k": K, "hidden_size": D,
                      "expert_ffn_size": F, "norm_topk_prob": False, "dtype": "float32"},
            "task": {"name": "layer", "tokens_per_rank": T, "routing": "uniform", "zipf_s": 1.2,
                     "warmup": 1, "iters": iters, "backward": True, "sync_collectives": True},
            "cluster": {"name": f"cpu{P}", "world_size": P}, "seed": seed}


def bench_rank(ctx, cfgs: list) -> list:
    """On every rank: parity per system, then alternating timed iterations."""
    out = []
    for group in cfgs:                                  # one shape: several systems
        first = OmegaConf.create(group[0])
        placement = Placement.contiguous(first.model.num_experts, ctx.world_size)
        layers, recs = [], []
        for cfg_dict in group:
            cfg = OmegaConf.create(cfg_dict)
            parity_gate(ctx, cfg_dict["system"], cfg.model.num_experts, cfg.model.top_k, "uniform", placement)
            layers.append(build_layer(ctx, cfg))
            recs.append(Recorder(rank=ctx.rank, sync_collectives=True))
        x_TD, ids_TK, grad_TD = make_inputs(ctx, first)
        rows = {i: [] for i in range(len(group))}
        for i, layer in enumerate(layers):
            act = saved_activation_bytes(layer, x_TD.clone().requires_grad_(True), None, ids_TK)
            rows[i].append(row("activation_bytes", act, "bytes", layer=0, rank=ctx.rank))
        task = first.task
        for it in range(task.warmup + task.iters):
            took = []
            for i, layer in enumerate(layers):
                t0 = time.perf_counter()
                sample = time_iteration(ctx, layer, x_TD, ids_TK, grad_TD, recs[i], it - task.warmup, True)
                took.append(f"{group[i]['system']['name']} {time.perf_counter() - t0:.1f} s")
                if it >= task.warmup:
                    rows[i] += sample
            if ctx.rank == 0:
                kind = "warm-up" if it < task.warmup else f"sample {it - task.warmup + 1}/{task.iters}"
                print(f"  [{first.model.name}] {kind}: {', '.join(took)}", flush=True)
        for i, cfg_dict in enumerate(group):
            rows[i] += comm_rows(recs[i]) + routing_rows(ctx, recs[i], placement)
            out.append((cfg_dict["system"]["name"], cfg_dict["model"]["name"], rows[i]))
    return out


def ratio_table(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per shape: each system's figures and its ratios to ``baseline``."""
    table = run_table(df)
    act = df[df.metric == "activation_bytes"].groupby("run_dir").value.max() / 1e6
    table["activation_MB_max_rank"] = table.run_dir.map(act)
    share = _index_share(df)
    table["own_index_work_share_fwd"] = table.run_dir.map(share)
    cols = ["dispatch_remote_MB", "a2a_dispatch_fwd_ms", "a2a_combine_fwd_ms", "a2a_dispatch_bwd_ms",
            "a2a_combine_bwd_ms", "layer_fwd_ms", "layer_fwd_bwd_ms", "activation_MB_max_rank"]
    for col in cols:
        base = table[table.system == baseline].set_index("model")[col]
        table[f"{col}_ratio"] = table[col] / table.model.map(base)
    for direction in ("forward", "forward+backward"):
        spread = _paired_ratio_range(df, baseline, direction)
        table[f"layer_{direction}_paired_ratio_range"] = table.run_dir.map(spread)
    return table


def _paired_ratio_range(df: pd.DataFrame, baseline: str, direction: str) -> pd.Series:
    """Per run, '[min, max]' over samples of (its layer time / the baseline's layer time in
    the same sample): iterations alternate between systems, so each sample is a pair."""
    sel = df[(df.metric == "time") & (df.phase == "layer") & (df["pass"] == direction) & (df["sample"] >= 0)]
    slow = sel.groupby(["model", "system", "run_dir", "sample"]).value.max().reset_index()
    base = slow[slow.system == baseline].set_index(["model", "sample"]).value
    slow["ratio"] = slow.value / slow.set_index(["model", "sample"]).index.map(base).to_numpy()
    agg = slow.groupby("run_dir").ratio.agg(["min", "max"])
    return agg.apply(lambda r: f"[{r['min']:.2f}, {r['max']:.2f}]", axis=1)


def _index_share(df: pd.DataFrame) -> pd.Series:
    """Forward time in a system's own spans (named '<system>_*') over its forward layer time,
    slowest rank per sample, median over samples."""
    t = df[(df.metric == "time") & (df["sample"] >= 0)]
    own = t[t.apply(lambda r: r.phase.startswith(f"{r.system}_"), axis=1)]
    layer = t[(t.phase == "layer") & (t["pass"] == "forward")]
    if own.empty:
        return pd.Series(dtype=float)
    own_s = own.groupby(["run_dir", "sample", "rank"]).value.sum()
    lay_s = layer.groupby(["run_dir", "sample", "rank"]).value.sum()
    return (own_s / lay_s).groupby(["run_dir", "sample"]).max().groupby("run_dir").median()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="olmoe,comm", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--systems", default="naive,occult", help="first one is the baseline of the ratios")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    systems, shapes = args.systems.split(","), args.shapes.split(",")
    groups = [[bench_cfg(s, shape, args.experts, args.top_k, args.world, args.iters, args.seed) for s in systems]
              for shape in shapes]
    out = Path(args.out or f"runs/bench/{datetime.now():%Y-%m-%d_%H-%M-%S}")
    print(f"benchmark: {systems} x {shapes}, E={args.experts} K={args.top_k} P={args.world}, "
          f"{args.iters} timed iterations each -> {out}", flush=True)
    t0 = time.perf_counter()
    per_rank = launch(bench_rank, args.world, (groups,), seed=args.seed, timeout_s=3600)
    frames = []
    for idx, (system, model, _) in enumerate(per_rank[0]):
        rows = [r for rank_out in per_rank for r in rank_out[idx][2]]
        cfg = groups[idx // len(systems)][idx % len(systems)]
        ctx = {"run_id": f"bench/{system}/{model}", "experiment": "bench", "system": system, "impl": "harness",
               "model": model, "task": "layer", "cluster": f"cpu{args.world}", "world_size": args.world,
               "num_experts": args.experts, "top_k": args.top_k, "hidden_size": cfg["model"]["hidden_size"],
               "expert_ffn_size": cfg["model"]["expert_ffn_size"],
               "tokens_per_rank": cfg["task"]["tokens_per_rank"], "routing": "uniform", "batch_size": -1,
               "seq_len": -1, "seed": args.seed}
        df = make_frame(rows, ctx)
        df["run_dir"] = f"{model}/{system}"
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    write_results(df.drop(columns="run_dir"), out)
    table = ratio_table(df, systems[0])
    table.to_csv(out / "bench.csv", index=False)
    shown = ["model", "system", "hidden_size", "expert_ffn_size", "tokens_per_rank", "ct_all",
             "dispatch_rows_per_token"] + [c for c in table.columns if c.endswith("_ratio")] + \
            ["layer_forward_paired_ratio_range", "layer_forward+backward_paired_ratio_range",
             "own_index_work_share_fwd", "layer_fwd_ms", "layer_fwd_bwd_ms", "activation_MB_max_rank"]
    md = table[shown].to_markdown(index=False, floatfmt=".3g")
    (out / "bench.md").write_text(f"# Benchmark ({time.perf_counter() - t0:.0f} s)\n\n{md}\n")
    print(md)
    print(f"\nwritten: {out}/bench.md, bench.csv, results.parquet")


if __name__ == "__main__":
    main()
