"""The benchmark's report: systems side by side, measured in the same world
(``task=bench``: one MoE layer; ``task=bench_model``: whole models).

    python run.py experiment=bench        # make bench: runs the benchmark, then this report

:func:`build` (``report: bench``) writes ``bench.md`` and ``bench.csv`` (layers) and
``bench_models.csv`` (whole models): one row per run (``run_id``: each compared system
config of a world is its own run), its figures and its ratios to the first system of
``task.compare`` with the same run keys:

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
* decode in both dispatch modes (``system.dispatch_mode``: dynamic, static): per step, the
  bytes each rank sent other ranks on the wire (``step_wire_KB``), the valid ones, what a
  low-latency kernel sends (``step_valid_KB``), and the padding rows, summed over ranks; a
  system's own index work per step (``own_index_ms_per_step``: its spans ``<system>_*``);
  ``mode_latency_ratio``, the latency over the first system's in the same mode;
* the targets of the "Occult at its limit" work (``report_options.bench`` of
  conf/experiment/bench.yaml: shapes, columns and bounds), each with its measured value
  and, where one is measured, its floor (``measured_floor``, named in ``floor_is``); with
  ``static_decode_bound``, one per proxy: Occult's static decode token latency over naive's
  static, its floor the same with Occult's own index work per step free (measured);
* collective bandwidth (``bench_bandwidth``): every timed all-to-all's algbw and busbw
  (:mod:`analysis.balance`);
* traffic plans (``task=simulate``, ``bench_plans.csv``): per system, the seconds and the
  peak memory of planning one layer of its simulated world (the slowest layer), with the
  bounds ``planning_time_bound_s`` and ``planning_memory_bound_GB``.

Nothing here starts ranks: it reads result tables.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..sections import Section
from ..summary import RUN_KEYS, TASK_LATENCY, baseline_value, ratio_to, run_table

# what a target's measured floor is (the targets table's floor_is column)
FLOOR_IS = {"layer": "route + collectives + experts step, index work and waits free (layer_*_floor_ratio)",
            "models": "only the collectives' plain all_to_all_single time differs from naive (a2a_only_ratio)",
            "static": "Occult's own index work free (its spans {system}_* in the decode steps: {ms:.3g} ms per "
                      "step, measured); what static mode leaves between the two systems"}


def ratio_table(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per shape: each system's figures and its ratios to ``baseline``."""
    table = run_table(df)
    act = df[df.metric == "activation_bytes"].groupby("run_id").value.max() / 1e6
    table["activation_MB_max_rank"] = table.run_id.map(act)
    table["own_index_work_share_fwd"] = table.run_id.map(_index_share(df))
    table["a2a_efficiency"] = table.run_id.map(_a2a_efficiency(df))
    for col, passes in (("layer_fwd", ("forward",)), ("layer_fwd_bwd", ("forward", "backward"))):
        table[f"{col}_floor_ms"] = table.run_id.map(_floor(df, passes))
        table[f"{col}_floor_ratio"] = table[f"{col}_floor_ms"] / baseline_value(table, f"{col}_ms", baseline)
    cols = ["dispatch_remote_MB", "a2a_dispatch_fwd_ms", "a2a_combine_fwd_ms", "a2a_dispatch_bwd_ms",
            "a2a_combine_bwd_ms", "layer_fwd_ms", "layer_fwd_bwd_ms", "activation_MB_max_rank"]
    for col in cols:
        table[f"{col}_ratio"] = ratio_to(table, col, baseline)
    for direction in ("forward", "forward+backward"):
        spread = _paired_ratio_range(df, baseline, direction)
        table[f"layer_{direction}_paired_ratio_range"] = table.run_id.map(spread)
    return table


def _paired_ratio_range(df: pd.DataFrame, baseline: str, direction: str) -> pd.Series:
    """Per run, '[min, max]' over samples of (its layer time / the baseline's layer time in
    the same sample): iterations alternate between systems, so each sample is a pair."""
    sel = df[(df.metric == "time") & (df.phase == "layer") & (df["pass"] == direction) & (df["sample"] >= 0)]
    slow = sel.groupby(["model", "system", "run_id", "sample"]).value.max().reset_index()
    base = slow[slow.system == baseline].set_index(["model", "sample"]).value
    slow["ratio"] = slow.value / slow.set_index(["model", "sample"]).index.map(base).to_numpy()
    agg = slow.groupby("run_id").ratio.agg(["min", "max"])
    return agg.apply(lambda r: f"[{r['min']:.2f}, {r['max']:.2f}]", axis=1)


def _index_share(df: pd.DataFrame) -> pd.Series:
    """Forward time in a system's own spans (named '<system>_*') over its forward layer time,
    slowest rank per sample, median over samples."""
    t = df[(df.metric == "time") & (df["sample"] >= 0)]
    own = t[[phase.startswith(f"{system}_") for phase, system in zip(t.phase, t.system)]]
    layer = t[(t.phase == "layer") & (t["pass"] == "forward")]
    if own.empty:
        return pd.Series(dtype=float)
    own_s = own.groupby(["run_id", "sample", "rank"]).value.sum()
    lay_s = layer.groupby(["run_id", "sample", "rank"]).value.sum()
    return (own_s / lay_s).groupby(["run_id", "sample"]).max().groupby("run_id").median()


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
    per_rank = parts.groupby(["run_id", "sample", "rank"]).value.sum()
    return per_rank.groupby(["run_id", "sample"]).max().groupby("run_id").median()


def _a2a_efficiency(df: pd.DataFrame) -> pd.Series:
    """Per run: the plain ``all_to_all_single`` replay's time over the harness's collective
    time in the same replay iterations, summed over the run's collectives (each: slowest
    rank per sample, median over samples). 1.0: no overhead; 0.8: the harness's
    collectives take 25 % longer."""
    def per_collective(metric: str) -> pd.Series:
        sel = df[(df.metric == metric) & (df["sample"] >= 0)]
        slow = sel.groupby(["run_id", "layer", "phase", "pass", "sample", "rank"]).value.sum()
        return slow.groupby(["run_id", "layer", "phase", "pass", "sample"]).max() \
            .groupby(["run_id", "layer", "phase", "pass"]).median()
    raw, harness = per_collective("raw_a2a_time"), per_collective("a2a_time_paired")
    if raw.empty:
        return pd.Series(dtype=float)
    both = pd.concat([raw.rename("raw"), harness.rename("harness")], axis=1).dropna()
    sums = both.groupby("run_id").sum()
    return sums.raw / sums.harness


def _workload(run: pd.DataFrame) -> str:
    """The whole-model workload a bench_model run timed (the phase of its latency rows)."""
    timed = run.metric.isin([m for m, _ in TASK_LATENCY.values()])
    return str(run.phase[timed].iloc[0]) if timed.any() else ""


def model_table(df: pd.DataFrame) -> pd.DataFrame:
    """Whole-model runs: one row per run (``run_id``: one per system config of a world)
    with its latency and its ratios to the first system compared in its world (matched
    by the run keys and the workload)."""
    out = []
    for run_id, rows in df.groupby("run_id", sort=False):
        workload = _workload(rows)
        if workload not in TASK_LATENCY:
            continue
        metric, phase = TASK_LATENCY[workload]
        lat = rows[(rows.metric == metric) & (rows.phase == phase) & (rows["rank"] == -1)].value
        remote = rows[(rows.metric == "bytes") & (rows.src_rank != rows.dst_rank) & (rows["pass"] == "forward")]
        out.append({**{k: rows[k].iloc[0] for k in RUN_KEYS}, "workload": workload, "system": rows.system.iloc[0],
                    "impl": rows.impl.iloc[0], "label": rows.label.iloc[0],
                    "system_options": rows.system_options.iloc[0], "latency_metric": metric,
                    "latency_ms": lat.median(), "remote_MB_fwd": remote.value.sum() / 1e6,
                    "iteration_ms": _iteration_ms(rows, workload), "raw_a2a_ms": _raw_a2a_per_iteration(rows),
                    "dispatch_mode": rows.dispatch_mode.iloc[0], **_step_traffic(rows),
                    "own_index_ms_per_step": _own_per_step(rows), "run_id": run_id})
    table = pd.DataFrame(out)
    if table.empty:
        return table
    keys = RUN_KEYS + ["workload"]
    baseline = table.groupby(keys, sort=False).system.transform("first")      # the world's first system
    base = lambda col: baseline_value(table, col, baseline, keys)
    table["latency_ratio"] = table.latency_ms / base("latency_ms")
    table["remote_bytes_ratio"] = table.remote_MB_fwd / base("remote_MB_fwd")
    table["raw_a2a_ratio"] = table.raw_a2a_ms / base("raw_a2a_ms")
    base_iter, base_raw = base("iteration_ms"), base("raw_a2a_ms")
    table["a2a_only_ratio"] = (base_iter - base_raw + table.raw_a2a_ms) / base_iter
    # against the first system in the same dispatch mode (static occult over static naive)
    table["mode_latency_ratio"] = table.latency_ms / baseline_value(table, "latency_ms", baseline,
                                                                    keys + ["dispatch_mode"])
    shown = ["model", "workload", "system", "impl", "label", "dispatch_mode", "system_options", "latency_metric",
             "latency_ms", "remote_MB_fwd", "iteration_ms", "raw_a2a_ms", "latency_ratio", "mode_latency_ratio",
             "remote_bytes_ratio", "raw_a2a_ratio", "a2a_only_ratio", "step_wire_KB", "step_valid_KB",
             "step_padding_rows", "own_index_ms_per_step", "run_id"]
    return table[shown]


def _step_traffic(rows: pd.DataFrame) -> dict:
    """A decode run's bytes per step sent to other ranks, on the wire and valid (KB), and its
    padding rows per step: summed over ranks, median over samples (NaN for another workload)."""
    out = {}
    for col, metric, scale in (("step_wire_KB", "step_wire_bytes", 1e3), ("step_valid_KB", "step_valid_bytes", 1e3),
                               ("step_padding_rows", "step_padding_rows", 1.0)):
        sel = rows[(rows.metric == metric) & (rows["rank"] >= 0)]
        out[col] = float(sel.groupby("sample").value.sum().median()) / scale if not sel.empty else float("nan")
    return out


def _own_per_step(rows: pd.DataFrame) -> float:
    """A decode run's time per step in the system's own spans (``<system>_*``), summed per rank:
    slowest rank, median over samples (NaN for another workload, or a system without any)."""
    system = rows.system.iloc[0]
    sel = rows[(rows.metric == "step_span_time") & rows.phase.str.startswith(f"{system}_")]
    if sel.empty:
        return float("nan")
    return float(sel.groupby(["sample", "rank"]).value.sum().groupby("sample").max().median())


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


def _layer_target(layers: pd.DataFrame, system: str, target: dict) -> dict:
    """One layer target's row: the value of its column for ``system`` at its shape, and
    the floor where the column is a layer time ratio."""
    col = target["column"]
    sel = layers[(layers.model == target["shape"]) & (layers.system == system)] if not layers.empty else layers
    value = float(sel[col].iloc[0]) if not sel.empty and col in sel else float("nan")
    floor_col = col.replace("_ms_ratio", "_floor_ratio")
    floor = float(sel[floor_col].iloc[0]) if floor_col.startswith("layer_") and not sel.empty \
        and floor_col in sel else float("nan")
    return {"target": target["what"], "bound": f"<= {target['bound']}", "measured": value,
            "met": value <= target["bound"], "measured_floor": floor, "floor_is": FLOOR_IS["layer"] if floor == floor else ""}


def _model_rows(models: pd.DataFrame, system: str, model_targets, whole_models_bound) -> list:
    """The whole-model targets: the median over proxy x task, and each (model, workload) target
    (the dynamic dispatch's runs; the static ones have targets of their own)."""
    occ = models[(models.system == system) & (models.dispatch_mode == "dynamic")] if not models.empty else models
    if occ.empty:
        return []
    rows = []
    if whole_models_bound is not None:
        median = float(occ.latency_ratio.median())
        rows.append({"target": "whole models, median over proxy x task", "bound": f"<= {whole_models_bound}",
                     "measured": median, "met": median <= whole_models_bound,
                     "measured_floor": float(occ.a2a_only_ratio.median()), "floor_is": FLOOR_IS["models"]})
    for t in model_targets:
        sel = occ[(occ.model == t["model"]) & (occ.workload == t["workload"])]
        value = float(sel.latency_ratio.iloc[0]) if not sel.empty else float("nan")
        rows.append({"target": t["what"], "bound": f"<= {t['bound']}", "measured": value,
                     "met": value <= t["bound"], "floor_is": FLOOR_IS["models"],
                     "measured_floor": float(sel.a2a_only_ratio.iloc[0]) if not sel.empty else float("nan")})
    return rows


def _static_decode_rows(models: pd.DataFrame, system: str, bound) -> list:
    """Per proxy: ``system``'s static decode token latency over the first system's static
    (``mode_latency_ratio``), and its floor: the same with the system's own index work per
    step free (measured)."""
    if bound is None or models.empty:
        return []
    sel = models[(models.system == system) & (models.dispatch_mode == "static") & (models.workload == "decode")]
    rows = []
    for _, r in sel.iterrows():
        base_ms = r.latency_ms / r.mode_latency_ratio
        own = r.own_index_ms_per_step
        rows.append({"target": f"{system} static decode token latency / the first system's static, {r.model}",
                     "bound": f"<= {bound}", "measured": r.mode_latency_ratio, "met": r.mode_latency_ratio <= bound,
                     "measured_floor": (r.latency_ms - own) / base_ms if own == own else float("nan"),
                     "floor_is": FLOOR_IS["static"].format(system=system, ms=own)})
    return rows


def targets_table(layers: pd.DataFrame, models: pd.DataFrame, system: str = "occult", layer_targets=(),
                  model_targets=(), whole_models_bound=None, activation_bound=None,
                  a2a_efficiency_bound=None, static_decode_bound=None) -> pd.DataFrame:
    """Each target (the experiment's ``report_options.bench``) with the value this benchmark
    measured for ``system`` (NaN: not run); a bound that is None is not checked."""
    rows = [_layer_target(layers, system, t) for t in layer_targets]
    rows += _model_rows(models, system, model_targets, whole_models_bound)
    rows += _static_decode_rows(models, system, static_decode_bound)
    if not layers.empty and "activation_MB_max_rank_ratio" in layers and activation_bound is not None:
        act = layers[layers.system == system].activation_MB_max_rank_ratio
        if not act.empty:
            rows.append({"target": "activation memory, max over shapes", "bound": f"<= {activation_bound}",
                         "measured": float(act.max()), "met": act.max() <= activation_bound})
    eff = layers.a2a_efficiency.dropna() if "a2a_efficiency" in layers else pd.Series(dtype=float)
    if not eff.empty and a2a_efficiency_bound is not None:
        rows.append({"target": "all-to-all bandwidth vs plain all_to_all_single, min over systems and shapes",
                     "bound": f">= {a2a_efficiency_bound}", "measured": float(eff.min()),
                     "met": eff.min() >= a2a_efficiency_bound})
    table = pd.DataFrame(rows)
    if "floor_is" in table:
        table["floor_is"] = table.floor_is.fillna("")
    return table


def planning_table(df: pd.DataFrame, time_bound_s=None, memory_bound_GB=None) -> pd.DataFrame:
    """``task=simulate`` runs, one row per run: the world planned (ranks, ranks per node, its
    tokens, E, K), the seconds of its slowest layer's plan and the peak memory of planning
    (the process's, and what planning added), each against its bound (None: not checked)."""
    out = []
    for run_id, rows in df.groupby("run_id", sort=False):
        value = lambda metric: rows[rows.metric == metric].value.max()
        first = rows.iloc[0]
        out.append({"system": first.system, "world_size": first.world_size, "devices_per_node": first.devices_per_node,
                    "world_tokens": first.tokens_per_rank * first.world_size, "num_experts": first.num_experts,
                    "top_k": first.top_k, "routing": first.routing, "planning_s": value("planning_time") / 1e3,
                    "peak_memory_GB": value("planning_peak_memory") / 1e9,
                    "added_memory_GB": value("planning_added_memory") / 1e9, "device": first.device, "run_id": run_id})
    table = pd.DataFrame(out)
    if not table.empty and time_bound_s is not None:
        table["time_met"] = table.planning_s <= time_bound_s
    if not table.empty and memory_bound_GB is not None:
        table["memory_met"] = table.peak_memory_GB <= memory_bound_GB
    return table


def bench_bandwidth(df: pd.DataFrame) -> pd.DataFrame:
    """Per run (model, system) and timed all-to-all (phase, pass): algbw and busbw
    (:func:`analysis.balance.bandwidth_table`, nccl-tests' all-to-all definitions)."""
    from ..balance import bandwidth_table

    table = bandwidth_table(df) if not df.empty else pd.DataFrame()
    if table.empty:
        return table
    names = df.groupby("run_id")[["model", "task", "system"]].first()
    return names.join(table.set_index("run_id"), how="inner").reset_index(drop=True)


def build(df: pd.DataFrame, out_dir, planning_time_bound_s=None, planning_memory_bound_GB=None, **targets) -> list:
    """Report builder: the benchmark tables (see the module docstring); ``targets``: the
    options of :func:`targets_table` (the experiment's ``report_options.bench``), and the
    planning bounds of :func:`planning_table`."""
    title = "Benchmark: systems in the same world, alternating iterations"
    out_dir = Path(out_dir)
    layer_runs, model_runs = df[df.task == "bench"], df[df.task == "bench_model"]
    plan_runs = df[df.task == "simulate"]
    if layer_runs.empty and model_runs.empty and plan_runs.empty:
        return [Section(title, ["Not drawn: no task=bench, task=bench_model or task=simulate runs."])]
    layers = pd.DataFrame()
    if not layer_runs.empty:
        layers = pd.concat([ratio_table(runs, runs.system.iloc[0]) for _, runs in layer_runs.groupby("model", sort=False)],
                           ignore_index=True)
        layers.to_csv(out_dir / "bench.csv", index=False)
    models = model_table(model_runs) if not model_runs.empty else pd.DataFrame()
    if not models.empty:
        models.to_csv(out_dir / "bench_models.csv", index=False)
    targets = targets_table(layers, models, **targets)
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
    bandwidth = bench_bandwidth(pd.concat([layer_runs, model_runs]))
    if not bandwidth.empty:
        tables.append(("bench_bandwidth", bandwidth))
        md.append(bandwidth.to_markdown(index=False, floatfmt=".3g"))
    plans = planning_table(plan_runs, planning_time_bound_s, planning_memory_bound_GB)
    if not plans.empty:
        plans.to_csv(out_dir / "bench_plans.csv", index=False)
        tables.append(("bench_plans", plans))
        md.append(plans.to_markdown(index=False, floatfmt=".3g"))
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
            "the floor named in floor_is. Traffic plans (task=simulate, one process): planning_s, the seconds to "
            "plan every rank's collectives of the world's slowest layer; peak_memory_GB, the process's peak "
            "resident memory while it planned (the device allocator's on a GPU), added_memory_GB what planning "
            "added to the memory in use when it began. Collective bandwidth (bench_bandwidth): per timed "
            "all-to-all, algbw = S / t and busbw = algbw x (n - 1) / n as nccl-tests defines them for "
            "all-to-all, S the bytes a rank sends including its own block (with uneven splits, each rank's own "
            "total); the median over samples and layers of the mean over ranks, and of the slowest rank's."]
    return [Section(title, text, tables)]
