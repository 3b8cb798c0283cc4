"""A report for any set of run folders: tables (CSV + Markdown), figures (PNG + PDF), report.md;
and its published copy under docs/results.

    python -m analysis.report runs/fig3_lcc [more folders...] [--out DIR] [--figures fig3_lcc,...]
    python -m analysis.report runs/default_study --publish docs/results     # docs/results/default_study.md

Written automatically at the end of every multirun (into the sweep folder, by
:class:`analysis.callbacks.SweepReport`), with the builders the experiment names in its
``report`` field and their knobs in ``report_options`` (:mod:`analysis.figures`). On
demand, ``--figures`` names them; without it they are those of the runs' experiments (the
``experiment`` column, read from ``conf/experiment``). Only result tables are read.

Sections: an overview of every run (one row per run; task=layer phase times), what the sweep
cost where its folder records it (:func:`cost_section`: ``sweep_cost.json``, written by the
sweep's callbacks) and each builder's figures and tables. Projected values carry ``source = projected`` and are
hatched or dashed in the figures.

``--publish DIR`` also writes ``DIR/<experiment>.md`` (:mod:`analysis.publish`): the
report's sections stamped with the date, command, commit and machine of the runs, its
figures copied beside it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from .load import load_runs
from .plots import plot_phase_times
from .sections import Section, builder_name, builder_names, guarded, render, resolve_builders
from .summary import RUN_KEYS, SYSTEM_KEYS, run_table, task_latency, with_ratios

SHOWN = ["system", "impl", "label", "model", "task", "cluster", "top_k", "routing", "ct_all",
         "dispatch_rows_per_token", "dispatch_remote_MB", "a2a_dispatch_fwd_ms", "a2a_combine_fwd_ms", "layer_fwd_ms",
         "layer_fwd_bwd_ms", "layer_fwd_ms_vs_naive", "layer_fwd_bwd_ms_vs_naive", "recv_max_over_mean",
         "slowest_rank"]
NOT_RUNS = ("calibrate",)          # tasks whose runs measure the machine, not a system
# what tells runs apart: shown in a summary only where its rows differ, but for those in SHOWN
KEYS = RUN_KEYS + SYSTEM_KEYS + ["label", "system_options", "init", "clock"]


def overview(df: pd.DataFrame, out: Path) -> Section:
    """Every run in one table (+ the whole-model latencies), and the phase-time figure."""
    runs = df[~df.task.isin(NOT_RUNS)]
    if runs.empty:
        return Section("Runs", ["Only calibration runs."])
    table = with_ratios(run_table(runs)).sort_values(["task", "system", "cluster", "top_k"])
    table.to_csv(out / "summary.csv", index=False)
    # run_dir rides along for the report to read each run's stored config (its task settings in
    # which the rows differ, analysis.sections.readable), and is not printed
    tables = [("summary", _filled(table[shown_columns(table, SHOWN) + [c for c in ["run_dir"] if c in table]]))]
    from .balance import phase_table
    phases = phase_table(runs)
    if not phases.empty:      # every timed phase's spread over ranks and its slowest rank
        phases.to_csv(out / "phases.csv", index=False)
    lat = task_latency(runs)
    if not lat.empty:
        values = [c for c in lat if c not in KEYS + SHOWN + ["run_id", "run_dir"]]
        tables.append(("task_latency", _filled(lat[shown_columns(lat, SHOWN + values)])))
    text = [f"{table.shape[0]} run(s), {len(df)} result rows; machine: {df.device.iloc[0]}; commit "
            f"{df.git_commit.iloc[0]}.{_wall_time(df)}", clock_words(runs),
            "recv_max_over_mean: the dispatch's received rows max / mean over ranks (MaxVio + 1); slowest_rank: "
            "of the run's headline phase; every timed phase's min / mean / max over ranks and slowest rank: "
            "phases.csv."]
    return Section("Runs", text, tables, plot_phase_times(runs, out))


def clock_words(runs: pd.DataFrame) -> str:
    """What the runs' numbers are, by their ``clock``: measured on this machine (runs that timed
    their ranks), simulated (``clock=simulated``: traffic plans, nothing timed), or both, each
    naming its runs."""
    clocks = runs.groupby("run_id").clock.first() if "clock" in runs else pd.Series("", runs.run_id.unique())
    simulated = int((clocks == "simulated").sum())
    timed = len(clocks) - simulated
    parts = []
    if timed:
        which = f"the {timed} timed run(s) (clock={', '.join(sorted(set(clocks[clocks != 'simulated'])))})" \
            if simulated else "these runs"
        parts.append(f"Times of {which} are medians over timed samples of the slowest rank, in ms, measured on "
                     "this machine: compare systems through the ratios, which were measured in the same sweep. "
                     "Their C_T, rows and bytes come from the split sizes that went into the collectives.")
    if simulated:
        parts.append(f"The {simulated} run(s) with clock=simulated timed nothing: their C_T, rows and bytes are "
                     "simulated (the systems' own traffic plans for every rank of a world that never ran, "
                     "task=simulate), and their time columns are empty.")
    return " ".join(parts)


def shown_columns(table: pd.DataFrame, shown: list) -> list:
    """``shown`` (those ``table`` has), and every other key column in which its rows differ
    (batch size, options, ...), after the key columns of ``shown``: two rows never look
    alike in a summary when their runs are not."""
    keys = [c for c in KEYS if c in table]
    differ = [c for c in keys if c not in shown and table[c].astype(str).nunique() > 1]
    cols = [c for c in shown if c in table]
    last_key = max((i for i, c in enumerate(cols) if c in keys), default=-1)
    return cols[:last_key + 1] + differ + cols[last_key + 1:]


def _filled(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` without its columns that hold nothing (all NaN, or an empty label)."""
    table = table.dropna(axis=1, how="all")
    return table.loc[:, (table != "").any()]


def _wall_time(df: pd.DataFrame) -> str:
    """' Points ran for N min ...' from the runs' ``run_wall_time`` rows ('' without them)."""
    wall = df[df.metric == "run_wall_time"] if "metric" in df else df.iloc[:0]
    if wall.empty:
        return ""
    n = wall.run_id.nunique()
    return (f" The {n} point(s) with a recorded wall time ran for {wall.value.sum() / 60:.1f} min in all, summed "
            "over points (points run side by side each count their own; start-up and any proxy pre-training "
            "included; reports and skipped points not).")


def builders_of(df: pd.DataFrame) -> tuple[str, dict]:
    """The ``report`` builders of the experiments these rows belong to (their
    ``experiment`` column, read from ``conf/experiment``), comma-separated, and their
    ``report_options``."""
    from occult.config import CONF_DIR, read_conf

    found, options = [], {}
    for name in sorted(map(str, df.experiment.unique())):
        if not (CONF_DIR / "experiment" / f"{name}.yaml").is_file():
            continue
        exp = read_conf("experiment", name)
        found += [b for b in builder_names(exp.report) if b not in found]
        options.update({k: dict(v) for k, v in exp.report_options.items()})
    return ",".join(found), options


def report_sections(df: pd.DataFrame, out: Path, builders=None, options=None) -> list[Section]:
    """The overview and each builder's sections (``builders``/``options``: as
    :func:`write_report`'s)."""
    spec, known = builders_of(df) if builders is None else (builders, {})
    options = {**known, **(options or {})}
    sections = [overview(df, out)]
    for build in resolve_builders(spec):
        sections += guarded(build, df, out, options.get(builder_name(build), {}))
    return sections


def write_report(paths, out_dir, builders=None, options=None, publish_dir=None, command: str = "") -> Path:
    """Builds the report from every results file under ``paths``; returns report.md.

    ``builders``: builder names (modules of :mod:`analysis.figures`), comma-separated;
    None: those the runs' experiments name (:func:`builders_of`), with their options.
    ``options``: ``{builder: {option: value}}`` (an experiment's ``report_options``).
    ``publish_dir``: also write the stamped copy ``<publish_dir>/<experiment>.md``
    (:func:`analysis.publish.publish`; ``command``: the command that published it).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df = load_runs(paths)
    sections = report_sections(df, out, builders, options)
    sections[1:1] = cost_section(paths)
    path = render(sections, out, report_title(df))
    if publish_dir is not None:
        from .publish import publish
        print(publish(df, sections, out, publish_dir, command))
    return path


def cost_section(paths) -> list[Section]:
    """What the sweeps under ``paths`` cost, from their ``sweep_cost.json``
    (:data:`occult.records.SWEEP_COST_FILE`): set-up before the points (pre-training), the
    points and the sweep's report, each with its wall time and peak memory; [] where no
    folder records it."""
    import json

    from occult.records import SWEEP_COST_FILE
    found = [Path(p) / SWEEP_COST_FILE for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    lines = []
    for path in (p for p in found if p.is_file()):
        cost = json.loads(path.read_text())
        gb = lambda key: f"{cost[key] / 1e9:.2f} GB" if cost.get(key, -1) >= 0 else "not measured"
        parts = [f"`{path.parent.name}`:"]
        setup = cost.get("setup", [])
        parts.append("before the points, " + "; ".join(f"{s['what']} in {_duration(s['seconds'])}" for s in setup)
                     + " (not in the points' time)." if setup else "nothing to set up before the points (every "
                     "proxy the points load was cached).")
        if "points_s" in cost:
            parts.append(f"The points took {_duration(cost['points_s'])} (from the sweep's start to its last point, "
                         f"composing every point's config included; {_cpu(cost, 'points_cpu_s')}), peak memory "
                         f"{gb('points_peak_rss')}.")
        if "report_s" in cost:
            parts.append(f"The report at the sweep's end took {_duration(cost['report_s'])} "
                         f"({_cpu(cost, 'report_cpu_s')}), peak memory {gb('report_peak_rss')}.")
        lines.append(" ".join(parts))
    if not lines:
        return []
    return [Section("Cost of the sweep", lines + [
        "Peak memory: the resident memory of the sweep's process and every process under it (the points' "
        "ranks, their fork server), summed, sampled every 0.5 s (`analysis.callbacks.TreeMemory`). Times are "
        "wall times on this machine, with whatever else ran on it; CPU: user and system seconds of the same "
        "processes, the sweep's own work however busy the cores were."])]


def _cpu(cost: dict, key: str) -> str:
    """``N min of CPU`` from a ``sweep_cost.json`` field ("CPU not recorded" without it)."""
    return f"{_duration(cost[key])} of CPU" if key in cost else "CPU not recorded"


def _duration(seconds: float) -> str:
    """``42 s`` under a minute, else ``N.N min``."""
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def report_title(df: pd.DataFrame) -> str:
    return f"Report: {', '.join(sorted(map(str, df.experiment.unique())))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run or sweep folders")
    ap.add_argument("--out", default=None, help="where to write (default: the first folder)")
    ap.add_argument("--figures", default=None,
                    help="comma-separated report builders (default: the `report` of the runs' experiments)")
    ap.add_argument("--publish", default=None, metavar="DIR",
                    help="also write DIR/<experiment>.md, stamped (e.g. docs/results)")
    args = ap.parse_args()
    command = "python -m analysis.report " + " ".join(sys.argv[1:])
    print(write_report(args.paths, args.out or args.paths[0], args.figures, publish_dir=args.publish,
                       command=command))


if __name__ == "__main__":
    main()
