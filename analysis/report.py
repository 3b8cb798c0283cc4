"""A report for any set of run folders: summary table (CSV, Markdown), figures, report.md.

    python -m analysis.report runs/default_study [more folders...] [--out DIR]

Written automatically at the end of every multirun (into the sweep folder).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from .load import load_runs
from .plots import plot_phase_times
from .summary import run_table, with_ratios

SHOWN = ["system", "impl", "cluster", "top_k", "routing", "ct_all", "dispatch_rows_per_token",
         "dispatch_remote_MB", "a2a_dispatch_fwd_ms", "a2a_combine_fwd_ms", "layer_fwd_ms",
         "layer_fwd_bwd_ms", "layer_fwd_ms_vs_naive", "layer_fwd_bwd_ms_vs_naive"]


def write_report(paths, out_dir) -> Path:
    """Builds the report from every results file under ``paths``; returns report.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df = load_runs(paths)
    table = with_ratios(run_table(df)).sort_values(["system", "cluster", "top_k"])
    table.to_csv(out / "summary.csv", index=False)
    figures = plot_phase_times(df, out)
    shown = table[[c for c in SHOWN if c in table]]
    lines = [f"# Report: {', '.join(sorted(df.experiment.unique()))}", "",
             f"{table.shape[0]} run(s), {len(df)} result rows; machine: {df.device.iloc[0]}; "
             f"commit {df.git_commit.iloc[0]}.", "",
             "Times are medians over timed samples of the slowest rank, in ms, measured on this "
             "machine: compare systems through the ratios, which were measured in the same sweep. "
             "C_T, rows and bytes come from the split sizes that went into the collectives.", "",
             shown.to_markdown(index=False, floatfmt=".3g"), ""]
    lines += [f"![{f.stem}]({f.name})" for f in figures if f.suffix == ".png"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run or sweep folders")
    ap.add_argument("--out", default=None, help="where to write (default: the first folder)")
    args = ap.parse_args()
    print(write_report(args.paths, args.out or args.paths[0]))


if __name__ == "__main__":
    main()
