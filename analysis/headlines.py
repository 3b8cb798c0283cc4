"""The headline numbers of the regenerated paper figures, old against new (``docs/results/index.md``).

Each :class:`Headline` names one number: where the hand copy held it (a line of
``docs/results/<experiment>.md`` at :data:`OLD_COMMIT`, the last commit with the hand copies,
and a regular expression whose group is the number; :func:`old_value` reads it from git, so
no old value is typed here) and how the experiment's runs give it now (``new``: a function of
the runs' results table, usually a value of the table its report builder publishes).

Samples: :func:`samples` evaluates ``new`` once per timed sample (iteration) of the runs, for
experiments whose headlines are times (:data:`TIMED`), or once per rerun of the whole command
for the others (their runs time nothing; reruns are folders ``runs/<experiment>_r<n>``).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from .summary import layer_table, run_table

OLD_COMMIT = "57d74c1"          # the hand copies' last commit (docs/results/*.md typed from the README at 82f5e01)
ROOT = Path(__file__).resolve().parents[1]
# experiments whose headlines are measured times: spread over the timed samples of one sweep
TIMED = ("table1_ct_runtime", "fig12_scaling", "fig1_latency")
RERUNS = 3                      # samples of the other headline experiments: the command run this often


@dataclass(frozen=True)
class Headline:
    """One number of a paper figure: its hand-copied value (``line`` of the experiment's file at
    OLD_COMMIT, group ``group`` of ``pattern``) and ``new``, a function of the runs' table."""

    experiment: str
    name: str
    line: int
    pattern: str
    new: Callable[[pd.DataFrame], float]
    group: int = 1


def old_file(experiment: str) -> list[str]:
    """The lines of the hand copy ``docs/results/<experiment>.md`` at OLD_COMMIT."""
    out = subprocess.run(["git", "show", f"{OLD_COMMIT}:docs/results/{experiment}.md"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def old_value(h: Headline, lines: list[str] | None = None) -> str:
    """The hand-copied number as it was written (a string, its digits kept); an error when the
    line no longer says it."""
    lines = lines if lines is not None else old_file(h.experiment)
    m = re.search(h.pattern, lines[h.line - 1])
    if not m:
        raise ValueError(f"{h.experiment}.md:{h.line} at {OLD_COMMIT} does not match {h.pattern!r}: {lines[h.line - 1]!r}")
    return m.group(h.group)


def builder_table(builder: str, df: pd.DataFrame, table: str) -> pd.DataFrame:
    """The table ``table`` of report builder ``builder`` (analysis.figures) on ``df`` (its
    figures written to a scratch folder)."""
    key = (builder, id(df))
    if key not in _BUILT:                   # one build per builder and table (evaluate clears it)
        build = import_module(f"analysis.figures.{builder}").build
        with tempfile.TemporaryDirectory() as tmp:
            _BUILT[key] = {name: t for sec in build(df, Path(tmp)) for name, t in sec.tables}
    if table not in _BUILT[key]:
        raise KeyError(f"report builder {builder} wrote no table {table}")
    return _BUILT[key][table]


_BUILT: dict = {}


def _one(t: pd.DataFrame, column: str, **where) -> float:
    for k, v in where.items():
        t = t[t[k] == v]
    if len(t) != 1:
        return float("nan")
    return float(t[column].iloc[0])


# ---- Table 1: Pearson r of C_T against bytes and times (table1_fit)
def _table1_r(y: str):
    return lambda df: _one(builder_table("table1_ct_runtime", df, "table1_fit"), "pearson_r", y=y)


TABLE1 = [Headline("table1_ct_runtime", "r(C_T, remote bytes per rank)", 6, r"\(r = ([\d.]+), the machine",
                   _table1_r("remote bytes sent per rank, fwd (MB)")),
          Headline("table1_ct_runtime", "r(C_T, all-to-all fwd+bwd)", 7, r"\(r = ([\d.]+) fwd\+bwd",
                   _table1_r("all-to-all, fwd+bwd (ms)")),
          Headline("table1_ct_runtime", "r(C_T, all-to-all forward)", 7, r", ([\d.]+) forward;",
                   _table1_r("all-to-all, forward (ms)")),
          Headline("table1_ct_runtime", "r(C_T, MoE layer fwd+bwd)", 7, r"the MoE layer ([\d.]+)\)",
                   _table1_r("MoE layer, fwd+bwd (ms)"))]


# ---- Fig. 12: remote MB per rank, Occult's all-to-all time / naive's, projected MoE layer / naive's
def _fig12_mb(system: str, P: int):
    def f(df):
        t = layer_table(df)
        return float(t[(t.system == system) & (t.world_size == P)].remote_MB_per_rank.median())
    return f


def _fig12_a2a_ratio(P: int):
    def f(df):
        t = layer_table(df)
        t = t[t.world_size == P]
        return float(t[t.system == "occult"].a2a_fwd_bwd_ms.median() / t[t.system == "naive"].a2a_fwd_bwd_ms.median())
    return f


def _fig12_projected(P: int):
    def f(df):
        proj = builder_table("fig12_scaling", df, "fig12_projected")
        proj = proj[proj.profile == f"sim_a6000x{P}"]
        return _one(proj, "moe_ms", system="occult") / _one(proj, "moe_ms", system="naive")
    return f


_FIG12_MB_GROUP = {2: 1, 4: 2, 8: 3, 16: 4}
FIG12 = [Headline("fig12_scaling", f"{name} remote MB per rank, P = {P}", line,
                  pattern, _fig12_mb(system, P), _FIG12_MB_GROUP[P])
         for system, name, line, pattern in (
             ("naive", "naive", 6, r"naive ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+)"),
             ("occult", "Occult", 6, r"Occult ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+)"))
         for P in (2, 4, 8, 16)]
FIG12 += [Headline("fig12_scaling", f"Occult all-to-all time / naive's, P = {P}", 8,
                   r"all-to-all time ([\d.]+) / ([\d.]+) / ([\d.]+) of naive", _fig12_a2a_ratio(P), g)
          for g, P in enumerate((2, 4, 8), 1)]
FIG12 += [Headline("fig12_scaling", f"Occult MoE layer / naive's, projected {P} x A6000", 10,
                   r"^([\d.]+) / ([\d.]+) / ([\d.]+) of naive", _fig12_projected(P), g)
          for g, P in enumerate((4, 8, 16), 1)]


# ---- Fig. 8: held-out C_T and intra-device share by placement (fig8_placements)
def _fig8(placement: str, column: str):
    return lambda df: _one(builder_table("fig8_pattern", df, "fig8_placements"), column, placement=placement)


FIG8 = [Headline("fig8_pattern", "held-out C_T, contiguous", 7, r"^([\d.]+) \(contiguous\)",
                 _fig8("contiguous (original)", "ct_all held-out")),
        Headline("fig8_pattern", "held-out C_T, greedy", 7, r"-> ([\d.]+) \(greedy",
                 _fig8("greedy", "ct_all held-out")),
        Headline("fig8_pattern", "held-out C_T, swap search", 7, r"-> ([\d.]+) \(swap search",
                 _fig8("swap_search", "ct_all held-out")),
        Headline("fig8_pattern", "intra-device share, contiguous", 8, r"co-activations ([\d.]+) ->",
                 _fig8("contiguous (original)", "intra_ratio held-out"))]


# ---- Fig. 7: held-out losses and C_T per arm (fig7_pruning's accuracy table)
_FIG7_ARMS = [(15, "no fine-tuning", "no_finetune"), (16, "standard fine-tuning", "standard"),
              (17, "score, N_d' = 1", "score_1"), (18, "score, N_d' = 2", "score_2"),
              (20, "similarity, N_d' = 1", "similarity_1"), (21, "similarity, N_d' = 2", "similarity_2")]
_FIG7_COLUMNS = [(1, "pydoc loss", "pydoc_loss"), (4, "Shakespeare loss", "shakespeare_loss")]


def _fig7(arm: str, column: str):
    return lambda df: _one(builder_table("fig7_pruning", df, "fig7_pruning"), column, arm=arm)


FIG7 = [Headline("fig7_pruning", f"{label}: {cname}", line,
                 r"^\| [^|]+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|",
                 _fig7(arm, column), group)
        for line, label, arm in _FIG7_ARMS for group, cname, column in _FIG7_COLUMNS]


# ---- Fig. 1: Occult / naive per proxy and task: C_T, latency, remote bytes, projected MoE time
_FIG1_ROWS = [(35 + 3 * i + j, model, task) for i, model in enumerate(("olmoe_proxy", "qwen_moe_proxy",
                                                                        "deepseek_moe_proxy"))
              for j, task in enumerate(("prefill", "decode", "train"))]


def _fig1_runs(df, model, task):
    return df[(df.model == model) & (df.task == task) & ~df.run_id.isin(_traced(df))]


def _traced(df):
    from .traces import traced_runs
    return {run.run_id.iloc[0] for _, run in traced_runs(df)}


def _fig1_ct(model, task):
    return lambda df: _one(run_table(_fig1_runs(df, model, task)), "ct_all", system="occult")


def _fig1_bytes(model, task):
    """Occult's remote bytes over naive's: every collective's forward bytes to other ranks, all layers
    (the hand copy's definition)."""
    def f(df):
        runs = _fig1_runs(df, model, task)
        sent = runs[(runs.metric == "bytes") & (runs.src_rank != runs.dst_rank) & (runs["pass"] == "forward")]
        per_system = sent.groupby("system").value.sum()
        return float(per_system.get("occult", np.nan) / per_system.get("naive", np.nan))
    return f


def _fig1_latency(model, task):
    return lambda df: _one(builder_table("fig1_latency", df, "fig1_measured"), "ratio_to_naive",
                           model=model, task=task, system="occult")


def _fig1_projected(model, task):
    return lambda df: _one(builder_table("fig1_latency", df, "fig1_projected"), "ratio_to_naive",
                           model=model, task=task, system="occult")


FIG1 = [Headline("fig1_latency", f"{model} {task}: {what}", line,
                 r"^\| `\w+` \| \w+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", fn(model, task), group)
        for line, model, task in _FIG1_ROWS
        for group, what, fn in ((1, "C_T", _fig1_ct), (2, "Occult / naive latency", _fig1_latency),
                                (3, "Occult / naive remote bytes", _fig1_bytes),
                                (4, "Occult / naive MoE time, projected 4 x A6000", _fig1_projected))]

HEADLINES = TABLE1 + FIG12 + FIG8 + FIG7 + FIG1


def of(experiment: str) -> list[Headline]:
    return [h for h in HEADLINES if h.experiment == experiment]


def timed_subsets(df: pd.DataFrame) -> list[pd.DataFrame]:
    """``df`` once per timed sample index: that sample's rows and every row that is not a timed sample."""
    return [df[(df["sample"] == s) | (df["sample"] < 0)] for s in sorted(df.loc[df["sample"] >= 0, "sample"].unique())]


def evaluate(experiment: str, frames: list[pd.DataFrame]) -> dict:
    """``{headline name: [value per sample]}`` over ``frames`` (the samples' tables)."""
    out = {h.name: [] for h in of(experiment)}
    for f in frames:
        for h in of(experiment):
            try:
                v = h.new(f)
            except Exception as err:            # a number the runs cannot give is shown as n/a, named here
                print(f"headline {experiment} / {h.name}: {type(err).__name__}: {err}")
                v = float("nan")
            out[h.name].append(None if not np.isfinite(v) else round(float(v), 6))
        _BUILT.clear()
    return out


def moved(old: str, new_samples: list) -> str:
    """Whether the hand-copied value lies outside the new samples' range, widened by half a unit
    of the old value's last digit (it was rounded when copied)."""
    vals = [v for v in new_samples if v is not None]
    if len(vals) < 1:
        return "no new value"
    decimals = len(old.split(".")[1]) if "." in old else 0
    tol = 0.5 * 10 ** -decimals
    o = float(old)
    return "yes" if o < min(vals) - tol or o > max(vals) + tol else "no"
