"""Tutel's ``a2a_ffn_overlap_degree`` on one MoE layer (``python run.py experiment=tutel_overlap``;
``report: tutel_overlap``), from result tables only.

The sweep runs ``task=layer`` for naive EP and for ``system=tutel`` at each overlap degree,
at a prefill-like and a decode-like token count. :func:`tutel_overlap` writes
``tutel_overlap.csv`` / ``.md``: per run its degree, the padding rows Tutel sent (summed
over ranks), remote MB in the forward dispatch, the all-to-all and layer times (slowest
rank, median over samples) and their ratios to naive EP and to degree 1 at the same shape.
The degree is the run's ``a2a_ffn_overlap_degree`` column (a setting, :mod:`occult.columns`).
"""
from __future__ import annotations

import pandas as pd

from occult.config import setting_columns

from ..sections import Section, write_table
from ..summary import run_table, with_ratios

COLUMNS = ["system", "impl", "tokens_per_rank", "degree", "padding_rows", "dispatch_remote_MB",
           "a2a_dispatch_fwd_ms", "a2a_combine_fwd_ms", "layer_fwd_ms", "layer_fwd_bwd_ms",
           "dispatch_remote_MB_vs_naive", "layer_fwd_ms_vs_naive", "layer_fwd_bwd_ms_vs_naive",
           "padding_rows_vs_degree_1", "layer_fwd_bwd_ms_vs_degree_1"]


def overlap_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per layer run (naive and Tutel at each degree), with the ratios above."""
    runs = df[df.task == "layer"]
    table = with_ratios(run_table(runs))
    degree = runs.groupby("run_id").a2a_ffn_overlap_degree.first()     # the column; naive's: absent
    table["degree"] = table.run_id.map(degree.where(degree != setting_columns()["a2a_ffn_overlap_degree"][1]))
    padding = runs[runs.metric == "padding_rows"].groupby("run_id").value.sum()
    table["padding_rows"] = table.run_id.map(padding)
    tutel = table[table.system == "tutel"]
    for col in ("padding_rows", "layer_fwd_bwd_ms"):
        base = tutel[tutel.degree == 1].groupby("tokens_per_rank")[col].median()
        table[f"{col}_vs_degree_1"] = [value / base.get(t, float("nan")) if system == "tutel" else float("nan")
                                       for system, t, value in zip(table.system, table.tokens_per_rank, table[col])]
    table = table.sort_values(["tokens_per_rank", "system", "degree"], na_position="first")
    return table[[c for c in COLUMNS if c in table]]


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder: the table above (``tutel_overlap.csv`` / ``.md``)."""
    title = "Tutel's overlap degree on one layer"
    table = overlap_table(df)
    if table.empty or not (table.system == "tutel").any():
        return [Section(title, ["Not measured: no task=layer runs of system=tutel."])]
    write_table(table, out_dir, "tutel_overlap")
    text = ["On a CPU, Tutel pipelines nothing: its layer takes the overlap path for CUDA tensors only "
            "(NCCL kernels), so here the degree only rounds the capacity C up to a multiple of itself. "
            "Padding rows and bytes follow from that; times are measured in separate runs of one sweep "
            "(compare the ratios with the spread of repeated runs)."]
    return [Section(title, text, [("tutel_overlap", table)])]
