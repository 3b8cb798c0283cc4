"""A report for any set of run folders: tables (CSV + Markdown), figures (PNG + PDF), report.md.

    python -m analysis.report runs/fig3_lcc [more folders...] [--out DIR] [--figures fig3_lcc,...]

Written automatically at the end of every multirun (into the sweep folder, by
:class:`analysis.callbacks.SweepReport`), with the figure builders the experiment
names in its ``report`` field (:mod:`analysis.figures`). On demand, ``--figures``
names them; without it they are those of the runs' experiments (the ``experiment``
column, looked up in ``conf/experiment``). Only result tables are read.

Sections: an overview of every run (one row per run; task=layer phase
times), each named figure or table, and the cost model checked against this
machine when the runs allow it. Projected values carry ``source =
projected`` and are hatched or dashed in the figures.
"""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pandas as pd
import yaml

from .figures import Section, costmodel_check, resolve_builders
from .load import load_runs
from .plots import plot_phase_times
from .summary import run_table, task_latency, with_ratios

SHOWN = ["system", "impl", "model", "task", "cluster", "top_k", "routing", "ct_all", "dispatch_rows_per_token",
         "dispatch_remote_MB", "a2a_dispatch_fwd_ms", "a2a_combine_fwd_ms", "layer_fwd_ms",
         "layer_fwd_bwd_ms", "layer_fwd_ms_vs_naive", "layer_fwd_bwd_ms_vs_naive"]
NOT_RUNS = ("calibrate",)          # tasks whose runs measure the machine, not a system
log = logging.getLogger("occult")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def overview(df: pd.DataFrame, out: Path) -> Section:
    """Every run in one table (+ the whole-model latencies), and the phase-time figure."""
    runs = df[~df.task.isin(NOT_RUNS)]
    if runs.empty:
        return Section("Runs", ["Only calibration runs."])
    table = with_ratios(run_table(runs)).sort_values(["task", "system", "cluster", "top_k"])
    table.to_csv(out / "summary.csv", index=False)
    shown = table[[c for c in SHOWN if c in table]].dropna(axis=1, how="all")
    tables = [("summary", shown)]
    lat = task_latency(runs)
    if not lat.empty:
        tables.append(("task_latency", lat.drop(columns=["run_dir"]).dropna(axis=1, how="all")))
    text = [f"{table.shape[0]} run(s), {len(df)} result rows; machine: {df.device.iloc[0]}; commit "
            f"{df.git_commit.iloc[0]}.{_wall_time(df)}",
            "Times are medians over timed samples of the slowest rank, in ms, measured on this machine: "
            "compare systems through the ratios, which were measured in the same sweep. C_T, rows and "
            "bytes come from the split sizes that went into the collectives."]
    return Section("Runs", text, tables, plot_phase_times(runs, out))


def _wall_time(df: pd.DataFrame) -> str:
    """' Points ran for N min ...' from the runs' ``run_wall_time`` rows ('' without them)."""
    wall = df[df.metric == "run_wall_time"] if "metric" in df else df.iloc[:0]
    if wall.empty:
        return ""
    n = wall.run_dir.nunique()
    return (f" The {n} point(s) with a recorded wall time ran for {wall.value.sum() / 60:.1f} min in all "
            "(start-up and any proxy pre-training included; reports and skipped points not).")


def builders_of(df: pd.DataFrame) -> str:
    """The ``report`` builders of the experiments these rows belong to (their
    ``experiment`` column, looked up in ``conf/experiment``), comma-separated."""
    from occult.config import CONF_DIR

    found = []
    for name in sorted(map(str, df.experiment.unique())):
        path = CONF_DIR / "experiment" / f"{name}.yaml"
        if path.is_file():
            spec = str((yaml.safe_load(path.read_text()) or {}).get("report") or "")
            found += [b.strip() for b in spec.split(",") if b.strip() and b.strip() not in found]
    return ",".join(found)


def render(sections: list[Section], out: Path, title: str) -> Path:
    """Writes each table as CSV and everything as report.md; returns its path."""
    lines = [f"# {title}", ""]
    for sec in sections:
        lines += [f"## {sec.title}", ""]
        for para in sec.text:
            lines += [para, ""]
        for name, table in sec.tables:
            table.to_csv(out / f"{_slug(name)}.csv", index=False)
            lines += [f"**{name}** (`{_slug(name)}.csv`)", "",
                      table.to_markdown(index=False, floatfmt=".4g") if not table.empty else "(empty)", ""]
        for fig in sec.figures:
            if Path(fig).suffix == ".png":
                lines += [f"![{Path(fig).stem}]({Path(fig).name}) (also `{Path(fig).with_suffix('.pdf').name}`)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _guarded(build, df: pd.DataFrame, out: Path) -> list[Section]:
    """A builder's sections; if it fails, a section that says so (the other sections and the
    sweep's results stay intact) and the error in the log."""
    try:
        return build(df, out)
    except Exception as exc:  # noqa: BLE001 - one figure must not lose the whole report
        log.exception("report: %s failed", build.__name__)
        return [Section(f"{build.__name__}: not drawn", [f"The builder failed: `{type(exc).__name__}: {exc}` "
                                                         f"(traceback in the log). Rerun with "
                                                         f"`python -m analysis.report {out}`."])]


def write_report(paths, out_dir, builders=None) -> Path:
    """Builds the report from every results file under ``paths``; returns report.md.

    ``builders``: figure builders (names in :data:`analysis.figures.BUILDERS`, comma-separated,
    or dotted paths); None: those the runs' experiments name (:func:`builders_of`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df = load_runs(paths)
    spec = builders_of(df) if builders is None else builders
    sections = [overview(df, out)]
    for build in resolve_builders(spec):
        sections += _guarded(build, df, out)
    if "costmodel_check" not in str(spec):
        sections += _guarded(costmodel_check, df, out)
    title = f"Report: {', '.join(sorted(map(str, df.experiment.unique())))}"
    return render(sections, out, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run or sweep folders")
    ap.add_argument("--out", default=None, help="where to write (default: the first folder)")
    ap.add_argument("--figures", default=None,
                    help="comma-separated figure builders (default: the `report` of the runs' experiments)")
    args = ap.parse_args()
    print(write_report(args.paths, args.out or args.paths[0], args.figures))


if __name__ == "__main__":
    main()
