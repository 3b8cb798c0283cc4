"""The benchmark's report: systems side by side, measured in the same world
(``task=bench``: one MoE layer; ``task=bench_model``: whole models).

    python run.py experiment=bench        # make bench: runs the benchmark, then this report

:func:`bench_report` (the experiment's ``report`` builder) writes ``bench.md`` and
``bench.csv`` (layers) and ``bench_models.csv`` (whole models), each system's figures
and its ratios to the first system of ``task.compare``:

* layers: remote bytes, all-to-all time per phase and pass, layer time forward and
  forward+backward (with the range over paired samples: iterations alternate, so each
  sample is a pair), the share of forward layer time in a system's own index work
  (spans named ``<system>_*``), the activation memory each keeps for backward, and the
  all-to-all bandwidth each achieved against a plain ``all_to_all_single`` of the same
  split sizes in the same world (``a2a_efficiency``: the harness's own overhead), and
  the layer's measured floor, forward and forward+backward (``layer_fwd_floor_ratio``,
  ``layer_fwd_bwd_floor_ratio``: route, collectives and experts step only, over the
  baseline's layer);
* whole models: the task's latency (prefill: time to first token; decode: per-token
  latency; train: step time), slowest rank, median over samples, and its ratio; and what
  the bytes alone can buy there: ``raw_a2a_ratio``, the plain ``all_to_all_single`` replay
  of every collective of an iteration against the baseline's, and ``a2a_only_ratio``, the
  ratio a system would reach if its only difference from the baseline were that
  replayed transfer time, (baseline's iteration - its raw all-to-all + the system's) /
  baseline's iteration;
* the targets of the "Occult at its limit" work, each with its measured value and, where
  one is measured, its floor (``measured_floor``, named in ``floor_is``).

Nothing here starts ranks: it reads result tables.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .summary import TASK_LATENCY, run_table

# (what, shape or "models", column, bound): occult / naive ratios the benchmark aims at
TARGETS = [("comm-bound layer, forward", "bench_comm", "layer_fwd_ms_ratio", 0.58),
           ("comm-bound layer, forward+backward", "bench_comm", "layer_fwd_bwd_ms_ratio", 0.62),
           ("OLMoE-shaped layer, forward", "bench_olmoe", "layer_fwd_ms_ratio", 0.90),
           ("OLMoE-shaped layer, forward+backward", "bench_olmoe", "layer_fwd_bwd_ms_ratio", 0.90),
           ("Occult's index work / forward layer time, comm-bound", "bench_comm", "own_index_work_share_fwd", 0.25)]


# what a target's measured floor is (the targets table's floor_is column)
FLOOR_IS = {"layer": "route + collectives + experts step, index work and waits free (layer_*_floor_ratio)",
            "models": "only the collectives' plain all_to_all_single time differs from naive (a2a_only_ratio)"}


def ratio_table(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per shape: each system's figures and its ratios to ``baseline``."""
    table = run_table(df)
    act = df[df.metric == "activation_bytes"].groupby("run_dir").value.max() / 1e6
    table["activation_MB_max_rank"] = table.run_dir.map(act)
    table["own_index_work_share_fwd"] = table.run_dir.map(_index_share(df))
    table["a2a_efficiency"] = table.run_dir.map(_a2a_efficiency(df))
    for col, passes in (("layer_fwd", ("forward",)), ("layer_fwd_bwd", ("forward", "backward"))):
        table[f"{col}_floor_ms"] = table.run_dir.map(_floor(df, passes))
        base_layer = table[table.system == baseline].set_index("model")[f"{col}_ms"]
        table[f"{col}_floor_ratio"] = table[f"{col}_floor_ms"] / table.model.map(base_layer)
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
    own = t[[phase.startswith(f"{system}_") for phase, system in zip(t.phase, t.system)]]
    layer = t[(t.phase == "layer") & (t["pass"] == "forward")]
    if own.empty:
        return pd.Series(dtype=float)
    own_s = own.groupby(["run_dir", "sample", "rank"]).value.sum()
    lay_s = layer.groupby(["run_dir", "sample", "rank"]).value.sum()
    return (own_s / lay_s).groupby(["run_dir", "sample"]).max().groupby("run_dir").median()


def _floor(df: pd.DataFrame, passes: tuple) -> pd.Series:
    """Per run, the layer in ``passes`` with everything but routing, the collectives and
    the experts step free (index work, permutations, the wait for the slowest peer): route
    + every collective's time + the experts spans (forward, and backward: from the
    outputs' gradient to the inputs', :func:`occult.ep.accounting.backward_span`), summed
    per rank; slowest rank, median over samples. Over the baseline's layer time: the ratio
    that system could reach at best with its collectives and its experts step as they are."""
    t = df[df["pass"].isin(list(passes)) & (df["sample"] >= 0)]
    parts = t[((t.metric == "time") & t.phase.isin(["route", "experts"])) | (t.metric == "a2a_time")]
    if parts.empty:
        return pd.Series(dtype=float)
    per_rank = parts.groupby(["run_dir", "sample", "rank"]).value.sum()
    return per_rank.groupby(["run_dir", "sample"]).max().groupby("run_dir").median()


def _a2a_efficiency(df: pd.DataFrame) -> pd.Series:
    """Per run: the plain ``all_to_all_single`` replay's time over the harness's collective
    time in the same replay iterations, summed over the run's collectives (each: slowest
    rank per sample, median over samples). 1.0: no overhead; 0.8: the harness's
    collectives take 25 % longer."""
    def per_collective(metric: str) -> pd.Series:
        sel = df[(df.metric == metric) & (df["sample"] >= 0)]
        slow = sel.groupby(["run_dir", "layer", "phase", "pass", "sample", "rank"]).value.sum()
        return slow.groupby(["run_dir", "layer", "phase", "pass", "sample"]).max() \
            .groupby(["run_dir", "layer", "phase", "pass"]).median()
    raw, harness = per_collective("raw_a2a_time"), per_collective("a2a_time_paired")
    if raw.empty:
        return pd.Series(dtype=float)
    both = pd.concat([raw.rename("raw"), harness.rename("harness")], axis=1).dropna()
    sums = both.groupby("run_dir").sum()
    return sums.raw / sums.harness


def model_table(df: pd.DataFrame) -> pd.DataFrame:
    """Whole-model runs: one row per (model, workload, system) with its latency and ratio
    to the first system compared in that run."""
    out = []
    for run_dir, run in df.groupby("run_dir", sort=False):
        workload = run.phase[run.metric.isin([m for m, _ in TASK_LATENCY.values()])].iloc[0] \
            if run.metric.isin([m for m, _ in TASK_LATENCY.values()]).any() else ""
        if workload not in TASK_LATENCY:
            continue
        metric, phase = TASK_LATENCY[workload]
        for system, rows in run.groupby("system", sort=False):
            lat = rows[(rows.metric == metric) & (rows.phase == phase) & (rows["rank"] == -1)].value
            remote = rows[(rows.metric == "bytes") & (rows.src_rank != rows.dst_rank) & (rows["pass"] == "forward")]
            out.append({"model": run.model.iloc[0], "workload": workload, "system": system,
                        "impl": rows.impl.iloc[0], "latency_metric": metric, "latency_ms": lat.median(),
                        "remote_MB_fwd": remote.value.sum() / 1e6, "iteration_ms": _iteration_ms(rows, workload),
                        "raw_a2a_ms": _raw_a2a_per_iteration(rows), "run_dir": run_dir})
    table = pd.DataFrame(out)
    if table.empty:
        return table
    first = table.groupby("run_dir").system.transform("first")
    base = table[table.system == first].set_index("run_dir")
    table["latency_ratio"] = table.latency_ms / table.run_dir.map(base.latency_ms)
    table["remote_bytes_ratio"] = table.remote_MB_fwd / table.run_dir.map(base.remote_MB_fwd)
    table["raw_a2a_ratio"] = table.raw_a2a_ms / table.run_dir.map(base.raw_a2a_ms)
    base_iter, base_raw = table.run_dir.map(base.iteration_ms), table.run_dir.map(base.raw_a2a_ms)
    table["a2a_only_ratio"] = (base_iter - base_raw + table.raw_a2a_ms) / base_iter
    return table.drop(columns="run_dir")


def _iteration_ms(rows: pd.DataFrame, workload: str) -> float:
    """The workload's whole iteration, slowest rank, median over samples: prefill's and
    train's latency; decode's prompt plus its N tokens (time to first token + the tokens'
    latencies)."""
    metric, phase = TASK_LATENCY[workload]
    lat = rows[(rows.metric == metric) & (rows.phase == phase) & (rows["rank"] == -1)]
    if workload != "decode":
        return float(lat.value.median())
    ttft = rows[(rows.metric == "ttft") & (rows.phase == "decode") & (rows["rank"] == -1)].set_index("sample").value
    if ttft.empty or lat.empty:
        return float("nan")
    per_iteration = len(lat) // len(ttft)                   # token samples are iteration * N + k
    tokens = lat.groupby(lat["sample"] // per_iteration).value.sum()
    return float((tokens + ttft).median())


def _raw_a2a_per_iteration(rows: pd.DataFrame) -> float:
    """The plain ``all_to_all_single`` replay of every all-to-all of an iteration (task=
    bench_model's replay iterations), summed per rank: slowest rank, median over samples."""
    raw = rows[(rows.metric == "raw_a2a_time") & (rows["sample"] >= 0)]
    if raw.empty:
        return float("nan")
    return float(raw.groupby(["sample", "rank"]).value.sum().groupby("sample").max().median())


def targets_table(layers: pd.DataFrame, models: pd.DataFrame, system: str = "occult") -> pd.DataFrame:
    """Each target with the value this benchmark measured for ``system`` (NaN: not run)."""
    rows = []
    for what, shape, col, bound in TARGETS:
        sel = layers[(layers.model == shape) & (layers.system == system)] if not layers.empty else layers
        value = float(sel[col].iloc[0]) if not sel.empty and col in sel else float("nan")
        floor_col = col.replace("_ms_ratio", "_floor_ratio")
        floor = float(sel[floor_col].iloc[0]) if floor_col.startswith("layer_") and not sel.empty \
            and floor_col in sel else float("nan")
        rows.append({"target": what, "bound": f"<= {bound}", "measured": value, "met": value <= bound,
                     "measured_floor": floor, "floor_is": FLOOR_IS["layer"] if floor == floor else ""})
    if not models.empty:
        occ = models[models.system == system]
        if not occ.empty:
            rows.append({"target": "whole models, median over proxy x task", "bound": "<= 1.0",
                         "measured": float(occ.latency_ratio.median()), "met": occ.latency_ratio.median() <= 1.0})
            rows[-1].update(measured_floor=float(occ.a2a_only_ratio.median()), floor_is=FLOOR_IS["models"])
            for workload in ("prefill", "train"):
                sel = occ[(occ.model == "olmoe_proxy") & (occ.workload == workload)]
                value = float(sel.latency_ratio.iloc[0]) if not sel.empty else float("nan")
                rows.append({"target": f"OLMoE proxy {workload}", "bound": "<= 0.85", "measured": value,
                             "met": value <= 0.85, "floor_is": FLOOR_IS["models"],
                             "measured_floor": float(sel.a2a_only_ratio.iloc[0]) if not sel.empty else float("nan")})
    if not layers.empty and "activation_MB_max_rank_ratio" in layers:
        act = layers[layers.system == system].activation_MB_max_rank_ratio
        if not act.empty:
            rows.append({"target": "activation memory, max over shapes", "bound": "<= 1.02",
                         "measured": float(act.max()), "met": act.max() <= 1.02})
        eff = layers.a2a_efficiency.dropna() if "a2a_efficiency" in layers else pd.Series(dtype=float)
        if not eff.empty:
            rows.append({"target": "all-to-all bandwidth vs plain all_to_all_single, min over systems and shapes",
                         "bound": ">= 0.8", "measured": float(eff.min()), "met": eff.min() >= 0.8})
    table = pd.DataFrame(rows)
    if "floor_is" in table:
        table["floor_is"] = table.floor_is.fillna("")
    return table


def _per_system(df: pd.DataFrame) -> pd.DataFrame:
    """One ``run_dir`` per (run, system): a bench run holds several systems."""
    return df.assign(run_dir=df.run_dir + "#" + df.system)


def bench_report(df: pd.DataFrame, out_dir) -> list:
    """Report builder: the benchmark tables (see the module docstring)."""
    from .figures import Section

    title = "Benchmark: systems in the same world, alternating iterations"
    out_dir = Path(out_dir)
    layer_runs, model_runs = df[df.task == "bench"], df[df.task == "bench_model"]
    if layer_runs.empty and model_runs.empty:
        return [Section(title, ["Not drawn: no task=bench or task=bench_model runs."])]
    layers = pd.DataFrame()
    if not layer_runs.empty:
        per = _per_system(layer_runs)
        layers = pd.concat([ratio_table(runs, runs.system.iloc[0]) for _, runs in per.groupby("model", sort=False)],
                           ignore_index=True)
        layers.to_csv(out_dir / "bench.csv", index=False)
    models = model_table(model_runs) if not model_runs.empty else pd.DataFrame()
    if not models.empty:
        models.to_csv(out_dir / "bench_models.csv", index=False)
    targets = targets_table(layers, models)
    shown = ["model", "system", "hidden_size", "expert_ffn_size", "tokens_per_rank", "ct_all",
             "dispatch_rows_per_token"] + [c for c in layers.columns if c.endswith("_ms_ratio") or c.endswith("MB_ratio")
                                           or c == "activation_MB_max_rank_ratio"] + \
            ["layer_forward_paired_ratio_range", "layer_forward+backward_paired_ratio_range",
             "own_index_work_share_fwd", "a2a_efficiency", "layer_fwd_floor_ratio", "layer_fwd_bwd_floor_ratio",
             "layer_fwd_ms", "layer_fwd_bwd_ms", "activation_MB_max_rank"]
    tables, md = [], []
    if not layers.empty:
        shown_layers = layers[[c for c in dict.fromkeys(shown) if c in layers]]
        tables.append(("bench_layers", shown_layers))
        md.append(shown_layers.to_markdown(index=False, floatfmt=".3g"))
    if not models.empty:
        tables.append(("bench_models", models))
        md.append(models.to_markdown(index=False, floatfmt=".3g"))
    if not targets.empty:
        tables.append(("bench_targets", targets))
        md.append(targets.to_markdown(index=False, floatfmt=".3g"))
    (out_dir / "bench.md").write_text("\n\n".join(md) + "\n")
    print("\n\n".join(md), flush=True)
    text = ["Ratios are to the first system of task.compare in the same world and sample (iterations "
            "alternate); times are the slowest rank's, median over samples; layer collectives are timed after "
            "a barrier (the transfer, not the wait for the slowest peer). a2a_efficiency: a plain "
            "all_to_all_single of the same split sizes over the harness's collective, summed over the run's "
            "collectives. layer_fwd_floor_ratio (layer_fwd_bwd_floor_ratio): the system's route, collectives and "
            "experts step, forward (and backward), over the baseline's layer (its index work and waits free). "
            "Whole models: raw_a2a_ratio, the plain all_to_all_single replay of an iteration's collectives "
            "against the baseline's; a2a_only_ratio, the ratio if the only difference from the "
            "baseline were that transfer time (what the bytes alone can buy here). The targets' measured_floor: "
            "the floor named in floor_is."]
    return [Section(title, text, tables)]
