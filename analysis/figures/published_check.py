"""The cost model against published GPU measurements (``python run.py experiment=published_check``;
``report: published_check``), from the simulated worlds of the sweep and conf/published only.

Every published point (:mod:`analysis.published`: DeepEP's normal and low-latency tables,
pplx-garden's decode table, UCCL-EP's p5en tables) is matched to the ``task=simulate`` run of
its shapes and declared system, priced on its profile and counted by its source's byte rule
(:mod:`analysis.transport_fit`). Fit points are projected by the fit that left their source
out; check points (DeepEP's low-latency table, and pplx-garden's column of the same kernel) by
the fit on every fit point, which no check point entered. Sections: the error per source
(median and 90th percentile of |ln(projected / published)|) against the targets
(:data:`MEDIAN_TARGET` per validated source, :data:`P90_TARGET` over all validated points), the
check, every point, the fitted parameters of every fold, decode at EP 256 and prefill at EP 64
on the H800 profile beside the published numbers, and a diagnostic: the same fits with each
kernel's NIC messages counted per its declared, cited unit (:func:`granularity_check`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..published import exclusions, load_points
from ..sections import Section, write_table
from ..transport_fit import (START, counted_messages, errors, exchange_of, leave_one_source_out, point_key,
                             priced_seconds, rule_rows, simulated_runs, stack, stack_seconds)

MEDIAN_TARGET = math.log(1.15)      # per validated source
P90_TARGET = math.log(1.35)         # over all validated points


def point_exchanges(df: pd.DataFrame) -> tuple[pd.DataFrame, list]:
    """Every published point (:func:`analysis.published.load_points` plus ``run_id`` and
    ``rule_bytes``) and its simulated :class:`analysis.transport_fit.Exchange`, messages as
    simulated (one per remote peer with a non-empty block). Raises when a point's world was
    not simulated."""
    points = load_points()
    runs = simulated_runs(df)
    missing = [p for p in points.itertuples() if point_key(p) not in runs]
    if missing:
        p = missing[0]
        raise ValueError(f"{len(missing)} published point(s) without a simulated world, e.g. {p.source} {p.kernel} "
                         f"EP {p.ep} {p.phase}: run python run.py experiment=published_check")
    exchanges, run_ids, rule_bytes = [], [], []
    for p in points.itertuples():
        run = runs[point_key(p)]
        valid = p.transport == "one_sided" and p.system_options.get("dispatch_mode") == "static"
        exchanges.append(exchange_of(run, p.phase, valid, p.counts))
        run_ids.append(run.run_id.iloc[0])
        rule_bytes.append(rule_rows(run, p.byte_rule) * p.row_bytes)
    points["run_id"], points["rule_bytes"] = run_ids, rule_bytes
    return points, exchanges


def checked_points(df: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Every published point with its simulated run's exchange priced (see the module
    docstring): columns of :func:`point_exchanges`' points plus ``projected_s``,
    ``projected_GBps``, ``error``, ``fold``, ``validated``; and the fitted parameters of
    every fold."""
    points, exchanges = point_exchanges(df)
    table, folds = leave_one_source_out(stack(points, exchanges), points)
    # the reported projection: the cost model's own price on the profile with the fold's parameters
    table["projected_s"] = [priced_seconds(x, p.row_bytes, p.profile, folds[p.fold], p.overlap, p.nodes > 1)
                            for x, p in zip(exchanges, table.itertuples())]
    table["projected_GBps"] = table.rule_bytes / table.projected_s / 1e9
    table["error"] = errors(table.projected_s.to_numpy(float), table)
    return table, folds


def granularity_check(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The message-granularity diagnostic: the same leave-one-source-out fits with each
    kernel's NIC messages counted per its declared unit (``messages.unit`` in conf/published,
    cited from its source's code; :func:`analysis.transport_fit.counted_messages`) instead of
    one per remote peer. Returns the error per source (:func:`per_source`, with the fit on
    every fit point's own errors beside as ``in_sample_median``) and every fold's per-message
    cost per transport. The price itself is unchanged: this shows what the count explains."""
    points, exchanges = point_exchanges(df)
    counted = [counted_messages(x, p.message_unit) for x, p in zip(exchanges, points.itertuples())]
    s = stack(points, counted)
    table, folds = leave_one_source_out(s, points)
    full = {t: folds["all"].get(t, START) for t in set(s.intra_t_N) | set(s.inter_t_N)}
    in_sample = points.assign(error=errors(stack_seconds(s, full), points))
    sources = per_source(table)
    sources["in_sample_median"] = [float(in_sample[(in_sample.source == r.source) & (in_sample.role == r.role)]
                                         .error.median()) for r in sources.itertuples()]
    costs = pd.DataFrame([{"fold": "fit on every fit source" if fold == "all" else f"{fold} left out",
                           **{f"{t} message_us": round(params[t]["message_us"], 4) for t in sorted(params)}}
                          for fold, params in folds.items()])
    return sources.assign(p90_validated=overall(table)["p90_error"]), costs


def granularity_text(by_unit: pd.DataFrame, table: pd.DataFrame) -> list:
    """The diagnostic's paragraph: the declared units and the targets under them."""
    units = table.drop_duplicates(["source", "kernel"])
    declared = "; ".join(f"{r.source} {r.kernel}: {r.message_unit}" for r in units.itertuples() if r.message_declared)
    fit = by_unit[(by_unit.role == "fit") & (by_unit.validated == "yes")]
    check = by_unit[by_unit.role == "check"]
    return [
        "Each decode kernel declares the granularity of its NIC messages as its source's code issues them "
        f"(conf/published, messages.cited: repository, file, line, commit): {declared}; the other kernels are "
        "counted as simulated (a message per remote peer with a non-empty block). The same leave-one-source-out "
        "fits with those counts, no parameter added: median error per validated source "
        + ", ".join(f"{r.source} {r.median_error:.3f} (in-sample {r.in_sample_median:.3f})" for r in fit.itertuples())
        + f" against {MEDIAN_TARGET:.3f}; 90th percentile over the validated points {fit.p90_validated.iloc[0]:.3f} "
        f"against {P90_TARGET:.3f}; the check's median "
        + ", ".join(f"{r.source} {r.median_error:.3f}" for r in check.itertuples()) + ". "
        "A fold's per-message cost of a transport comes only from the sources it saw: where the one other source "
        "on that transport batches its writes per peer, its fit cannot see a per-message cost (the table below), "
        "and a source whose writes are per row is projected without one."]


def per_source(table: pd.DataFrame) -> pd.DataFrame:
    """Per source and role: points, validated, median and 90th-percentile error, target met."""
    rows = []
    for (source, role), g in table.groupby(["source", "role"], sort=True):
        e = g.error.to_numpy(float)
        validated = bool(g.validated.all()) if role == "fit" else False
        rows.append({"source": source, "role": role, "points": len(g),
                     "fold": "left out" if role == "fit" else "all fit sources",
                     "validated": "yes" if validated else ("check" if role == "check" else "no (transport unseen)"),
                     "median_error": float(np.median(e)), "p90_error": float(np.quantile(e, 0.9)),
                     "median_factor": float(np.exp(np.median(e))),
                     "median_target_met": bool(np.median(e) <= MEDIAN_TARGET) if validated else None})
    return pd.DataFrame(rows)


def overall(table: pd.DataFrame) -> dict:
    """Over all validated fit points: their count and 90th-percentile error, against the target."""
    v = table[(table.role == "fit") & table.validated]
    p90 = float(np.quantile(v.error, 0.9)) if len(v) else float("nan")
    return {"points": len(v), "p90_error": p90, "p90_target": P90_TARGET, "met": bool(p90 <= P90_TARGET)}


def params_table(folds: dict, table: pd.DataFrame) -> pd.DataFrame:
    """The fitted parameters of every fold (a row per fold and transport) and where they came
    from: the fit points of the sources the fold saw."""
    fit = table[table.role == "fit"]
    rows = []
    for fold, params in folds.items():
        seen = fit if fold == "all" else fit[fit.source != fold]
        origin = ", ".join(f"{src} ({n})" for src, n in seen.groupby("source").size().items())
        for t, p in sorted(params.items()):
            rows.append({"fold": "fit on every fit source" if fold == "all" else f"{fold} left out", "transport": t,
                         **{k: round(v, 4) for k, v in p.items()}, "fitted on (points)": origin})
    return pd.DataFrame(rows)


def disagreements(table: pd.DataFrame) -> pd.DataFrame:
    """Published times of one exchange (profile, EP, phase, tokens per rank, harness system)
    by two sources, side by side: what no price with parameters per transport can tell apart."""
    timed = table[table.latency_us.notna() & (table.role == "fit")].copy()
    timed["kind"] = [f"{s} {json.dumps(o, sort_keys=True)}" for s, o in zip(timed.system, timed.system_options)]
    rows = []
    keys = ["profile", "ep", "phase", "tokens_per_rank", "kind"]
    for key, g in timed.groupby(keys, sort=True):
        by_source = g.groupby("source").latency_us.mean()
        if len(by_source) < 2:
            continue
        (a, ta), (b, tb) = sorted(by_source.items())[:2]
        rows.append({**dict(zip(keys, key)), f"source_a": a, "us_a": ta, "source_b": b, "us_b": tb,
                     "b/a": round(tb / ta, 2)})
    return pd.DataFrame(rows).drop(columns=["kind"]) if rows else pd.DataFrame()


def _shown(table: pd.DataFrame) -> pd.DataFrame:
    """Every point as the report lists it: published and projected (us where a time is
    published, else GB/s), the error and the ratio."""
    timed = table.latency_us.notna()
    return pd.DataFrame({
        "source": table.source, "table": table.table, "kernel": table.kernel, "role": table.role, "EP": table.ep,
        "nodes": table.nodes, "phase": table.phase, "profile": table.profile,
        "system": [f"{s} {' '.join(f'{k}={v}' for k, v in o.items())}".strip()
                   for s, o in zip(table.system, table.system_options)],
        "metric": np.where(timed, "us", "GB/s"),
        "published": np.where(timed, table.latency_us, table.GBps),
        "projected": np.where(timed, table.projected_s * 1e6, table.projected_GBps).round(1),
        "error": table.error.round(3), "projected/published": np.where(
            timed, table.projected_s * 1e6 / table.latency_us, table.projected_GBps / table.GBps).round(2),
        "fold": table.fold, "run_id": table.run_id})


def h800_projections(table: pd.DataFrame) -> pd.DataFrame:
    """Decode at EP 256 (DeepEP's low-latency kernels) and prefill at EP 64 (its normal
    kernels) on the H800 profile beside DeepEP's published numbers: the decode row (a check
    point) projected by the fit on every fit source, the prefill row by the fit that left
    DeepEP out; a published bandwidth also as a time (its byte rule's bytes over it)."""
    sel = table[(table.source == "deepep") & (((table.table == "low_latency") & (table.ep == 256))
                                              | ((table.table == "normal") & (table.ep == 64)))]
    return pd.DataFrame({"workload": np.where(sel.table == "low_latency", "decode, 128 tokens per rank",
                                              "prefill, 4096 tokens per rank"),
                         "EP": sel.ep, "phase": sel.phase, "profile": sel.profile,
                         "projected_us": (sel.projected_s * 1e6).round(1), "published_us": sel.latency_us.where(
                             sel.latency_us.notna(), (sel.rule_bytes / sel.GBps / 1e3).round(1)),
                         "projected_GBps": sel.projected_GBps.round(1), "published_GBps": sel.GBps,
                         "fold": sel.fold})


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder (see the module docstring): ``published_check.csv`` (every point),
    ``published_check_sources.csv``, ``published_check_params.csv``, ``published_check_h800.csv``,
    ``published_check_disagreements.csv``, and the message-unit diagnostic's
    ``published_check_message_units.csv`` and ``published_check_message_costs.csv``."""
    title = "The price of an exchange against published GPU measurements"
    sim = df[(df.task == "simulate")] if "task" in df else df
    if sim.empty:
        return [Section(title, ["Not simulated: no task=simulate runs (python run.py experiment=published_check)."])]
    out_dir = Path(out_dir)
    table, folds = checked_points(df)
    shown, sources, params, h800 = _shown(table), per_source(table), params_table(folds, table), h800_projections(table)
    apart = disagreements(table)
    by_unit, unit_costs = granularity_check(df)
    for name, t in (("published_check", shown), ("published_check_sources", sources),
                    ("published_check_params", params), ("published_check_h800", h800),
                    ("published_check_disagreements", apart), ("published_check_message_units", by_unit),
                    ("published_check_message_costs", unit_costs)):
        write_table(t, out_dir, name)
    total = overall(table)
    validated = sources[(sources.role == "fit") & (sources.validated == "yes")]
    met_median = bool(validated.median_target_met.all()) if len(validated) else False
    check = table[table.role == "check"]
    excluded = exclusions()
    limited = table[table.byte_rule == "node_dedup_sent"]
    widest = limited.loc[limited.nodes.idxmax()] if len(limited) else None
    routing_note = "" if widest is None or widest.nodes <= 4 else (
        f" DeepEP's and UCCL-EP's internode benchmarks limit a token to min(nodes, 4) nodes; the simulated "
        f"routing is uniform without that limit (at EP {widest.ep}, {widest.nodes} nodes, a token reaches "
        f"{widest.rule_bytes / widest.row_bytes / widest.tokens_per_rank:.2f} nodes): their bandwidths are "
        "compared as the byte rule over the projected time on the same simulated routing.")
    text = [
        f"{len(table)} published points from {table.source.nunique()} sources ({', '.join(sorted(table.source.unique()))}); "
        f"{len(excluded)} excluded as evident typos" + (": " + "; ".join(f"{e['source']}: {e}" for e in excluded)
                                                        if excluded else "") + ".",
        "Each point is its kernel's declared harness system simulated at its shapes (task=simulate), its rows "
        "at the published dtypes' row bytes, priced on its profile (analysis.pricing) with three free parameters "
        "per transport (latency, efficiency <= 1, per-message cost). A fit point is projected by the fit that "
        "left its source out; a check point by the fit on every fit point. Error: |ln(projected / published)| "
        "on time, on bandwidth (the source's byte rule over the projected time) where no time is published."
        + routing_note,
        f"Targets: median error <= ln 1.15 = {MEDIAN_TARGET:.3f} on every validated source: "
        f"{'met' if met_median else 'NOT met'} ("
        + ", ".join(f"{r.source} {r.median_error:.3f}" for r in validated.itertuples()) + "); "
        f"90th percentile over the {total['points']} validated points <= ln 1.35 = {P90_TARGET:.3f}: "
        f"{total['p90_error']:.3f}, {'met' if total['met'] else 'NOT met'}.",
        f"The check (held out of every fit): {len(check)} points, median error {np.median(check.error):.3f} "
        f"(x{np.exp(np.median(check.error)):.2f}), 90th percentile {np.quantile(check.error, 0.9):.3f}, "
        f"largest {check.error.max():.3f}." if len(check) else "No check points.",
    ]
    return [Section(title, text, tables=[("error per source", sources)]),
            Section("The check: DeepEP's low-latency kernels, never fitted", [],
                    tables=[("check points", shown[shown.role == "check"].drop(columns=["run_id"]))]),
            Section("Decode at EP 256 and prefill at EP 64 on sim_h800_cx7",
                    ["DeepEP's kernels projected on the H800 profile beside its published numbers: decode "
                     "(low-latency kernels, a check point) by the fit on every fit source, prefill (normal "
                     "kernels) by the fit that left DeepEP out, so no fit saw either row. A published "
                     "bandwidth is also shown as the time it implies (its byte rule's bytes over it)."],
                    tables=[("H800", h800)]),
            Section("One exchange, two sources", [
                "Published times of the same exchange (profile, EP, phase, tokens per rank, harness system) by "
                "two sources: a price whose parameters belong to the hardware gives both the same time, so "
                "their ratio bounds what any such price can reach on them."] if len(apart) else
                ["No exchange is published by two fit sources."], tables=[("same exchange", apart)] if len(apart) else []),
            Section("Messages counted per declared unit (a diagnostic; the price above is unchanged)",
                    granularity_text(by_unit, table),
                    tables=[("error per source, messages per declared unit", by_unit),
                            ("per-message cost per fold, messages per declared unit", unit_costs)]),
            Section("Every point", [], tables=[("points", shown.drop(columns=["run_id"]))]),
            Section("Fitted parameters", ["Per fold: latency (us per call), efficiency (of the profile's "
                                          "datasheet bandwidth) and per-message cost (us per peer with a "
                                          "non-empty block), per transport."], tables=[("parameters", params)])]
