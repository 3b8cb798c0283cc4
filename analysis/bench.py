"""The benchmark's report: systems side by side, measured in the same world (``task=bench``).

    python run.py experiment=bench        # make bench: runs the benchmark, then this report

:func:`bench_report` (the experiment's ``report`` builder) gives, per shape, each
system's figures and its ratios to the first system of ``task.compare``: remote bytes,
all-to-all time per phase and pass, layer time forward and forward+backward (with the
range over paired samples: iterations alternate, so each sample is a pair), the share
of layer time in a system's own index work (spans named ``<system>_*``), and the
activation memory each keeps for backward. It writes ``bench.csv`` and ``bench.md``.
Nothing here starts ranks: it reads result tables.
"""
from __future__ import annotations

import pandas as pd

from .summary import run_table


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


def _per_system(df: pd.DataFrame) -> pd.DataFrame:
    """One ``run_dir`` per (run, system): a bench run holds several systems."""
    return df.assign(run_dir=df.run_dir + "#" + df.system)


def bench_report(df: pd.DataFrame, out_dir) -> list:
    """Report builder: the benchmark table (see the module docstring)."""
    from pathlib import Path

    from .figures import Section

    title = "Benchmark: systems on one MoE layer, same world, alternating iterations"
    bench = df[df.task == "bench"]
    if bench.empty:
        return [Section(title, ["Not drawn: no task=bench runs."])]
    bench = _per_system(bench)
    tables = []
    for model, runs in bench.groupby("model", sort=False):
        baseline = runs.system.iloc[0]
        table = ratio_table(runs, baseline)
        tables.append(table)
    table = pd.concat(tables, ignore_index=True)
    table.to_csv(Path(out_dir) / "bench.csv", index=False)
    shown = ["model", "system", "hidden_size", "expert_ffn_size", "tokens_per_rank", "ct_all",
             "dispatch_rows_per_token"] + [c for c in table.columns if c.endswith("_ratio")] + \
            ["layer_forward_paired_ratio_range", "layer_forward+backward_paired_ratio_range",
             "own_index_work_share_fwd", "layer_fwd_ms", "layer_fwd_bwd_ms", "activation_MB_max_rank"]
    shown_table = table[[c for c in shown if c in table]]
    (Path(out_dir) / "bench.md").write_text(shown_table.to_markdown(index=False, floatfmt=".3g") + "\n")
    print(shown_table.to_markdown(index=False, floatfmt=".3g"), flush=True)
    text = ["Ratios are to the first system of task.compare in the same world and sample (iterations "
            "alternate); times are the slowest rank's, median over samples; collectives are timed after a "
            "barrier (the transfer, not the wait for the slowest peer)."]
    return [Section(title, text, [("bench", shown_table)])]
