"""The bytes-accuracy front of the lossy strategies (``report: lossy_front``; ``python run.py experiment=lossy_front``).

Reads the sweep's ``task=finetune`` runs (one per arm and fine-tuning setting, the arm
its ``label``) and writes:

* ``lossy_front.csv`` / ``lossy_front.md``: one row per run: arm, family, whether it was
  fine-tuned with its loss active, held-out loss and next-token accuracy on both
  domains, remote bytes per token while evaluating (as they crossed: compressed rows at
  their wire size), C_T, the share of (token, expert) pairs that needed a row of their
  own (lsh, luffy, adaptive top-k), the measured prefill time and its ratio to naive EP's,
  and the projected MoE time of the real OLMoE on 4 x A6000 (:mod:`analysis.projection`,
  from the run's own bytes) with its ratio to naive EP's;
* ``lossy_front.png/pdf``: remote bytes per token against held-out loss (both domains),
  one point per run, the Pareto front (no other run has fewer bytes and a lower loss)
  drawn as a line.

Shapes: none (tables).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from occult.ep.profiles import load_profile

from ..plots import save, style
from ..projection import project_runs, projected_totals
from ..sections import Section
from .fig7_pruning import accuracy_frame

PROFILE = "sim_a6000x4"
FAMILIES = {"naive": "exact", "no_finetune": "exact", "standard": "exact", "score": "pruning (score)",
            "similarity": "pruning (similarity)", "naive_int8": "payload", "naive_fp8": "payload",
            "occult_int8": "payload", "occult_fp8": "payload", "lsh": "lsh", "luffy": "luffy",
            "adaptive": "adaptive top-k"}


def family_of(arm: str) -> str:
    """The arm's family: exact, pruning (score / similarity), payload, lsh, luffy, adaptive top-k."""
    return FAMILIES.get(arm) or FAMILIES.get(arm.split("_")[0], "other")


def _per_run(df: pd.DataFrame) -> pd.DataFrame:
    """Per run: bytes per token per domain, the timing probe's median ttft and the share
    of pairs with a row of their own."""
    out = []
    for run_id, run in df.groupby("run_id", sort=False):
        rec = {"run_id": run_id}
        for corpus in run[run.metric == "eval_remote_bytes"].phase.unique():
            b = run[(run.metric == "eval_remote_bytes") & (run.phase == corpus)].value.sum()
            n = run[(run.metric == "eval_tokens") & (run.phase == corpus)].value.sum()
            rec[f"{corpus}_bytes_per_token"] = b / n if n else np.nan
        ttft = run[(run.metric == "ttft") & (run["sample"] >= 0)].value
        rec["prefill_ms"] = ttft.median() if not ttft.empty else np.nan
        counters = run[run["rank"] >= 0]
        pairs = float(run[(run.metric == "tokens") & (run["rank"] >= 0)].value.sum() * run.top_k.iloc[0])
        saved = counters[counters.metric.isin(["dropped_pairs", "merged_pairs"])].value.sum()
        rec["pairs_with_a_row"] = 1.0 - saved / pairs if pairs else np.nan
        out.append(rec)
    return pd.DataFrame(out)


def _projected(df: pd.DataFrame) -> pd.DataFrame:
    """Per run: the projected MoE ms of the real model on :data:`PROFILE` (its run's bytes)."""
    runs = df[df.metric.isin(["bytes", "rows", "a2a_time", "tokens"]) | df.metric.str.endswith("_pairs")
              | (df.metric == "padding_rows")]
    totals = projected_totals(project_runs(runs, load_profile(PROFILE), target="real"))
    if totals.empty:
        return pd.DataFrame(columns=["run_id", "projected_moe_ms"])
    return totals[["run_id", "moe_ms"]].rename(columns={"moe_ms": "projected_moe_ms"})


def front_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finetune run of ``df`` (see the module docstring), ratios to the
    ``naive`` arm (NaN without one)."""
    df = df[df.task == "finetune"]
    acc = accuracy_frame(df)
    if acc.empty:
        return acc
    table = acc.merge(_per_run(df), on="run_id", how="left").merge(_projected(df), on="run_id", how="left")
    table.insert(1, "family", table.arm.map(family_of))
    table.insert(2, "finetuned", table.steps > 0)
    naive = table[table.arm == "naive"]
    for col, ratio in (("prefill_ms", "time_vs_naive"), ("projected_moe_ms", "projected_vs_naive")):
        base = naive[col].mean() if not naive.empty else np.nan
        table[ratio] = table[col] / base
    return table


def pareto(x, y) -> np.ndarray:
    """Indices of the points no other point beats on both (lower x and lower y), by x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    order = ok[np.lexsort((y[ok], x[ok]))]
    keep, best = [], np.inf
    for i in order:
        if y[i] < best:
            keep.append(i)
            best = y[i]
    return np.array(keep, dtype=int)


def plot_front(table: pd.DataFrame, domains: list, out_dir: Path) -> list:
    """Bytes per token against held-out loss, one panel per domain, the Pareto front drawn."""
    style()
    fig, axes = plt.subplots(1, len(domains), figsize=(6 * len(domains), 4.4), squeeze=False)
    families = list(dict.fromkeys(table.family))
    colors = {f: f"C{i}" for i, f in enumerate(families)}
    for ax, domain in zip(axes[0], domains):
        x, y = table[f"{domain}_bytes_per_token"].to_numpy(float), table[f"{domain}_loss"].to_numpy(float)
        for i, r in enumerate(table.itertuples()):
            ax.scatter(x[i], y[i], color=colors[r.family], marker="o" if r.finetuned else "x", s=36,
                       label=f"{r.family}" + ("" if r.finetuned else ", no fine-tuning"))
            ax.annotate(r.arm, (x[i], y[i]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        front = pareto(x, y)
        if len(front):
            ax.step(x[front], y[front], where="post", color="k", lw=1, ls="--", label="Pareto front")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=6)
        ax.set_xlabel(f"remote bytes per token while evaluating {domain}")
        ax.set_ylabel(f"held-out loss on {domain} (nats/token)")
    fig.tight_layout()
    return save(fig, Path(out_dir) / "lossy_front")


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder: the table, the figure and the Pareto front (module docstring)."""
    title = "Lossy strategies: bytes per token against held-out loss"
    table = front_frame(df)
    if table.empty:
        return [Section(title, ["Not drawn: no task=finetune runs."])]
    out_dir = Path(out_dir)
    domains = [c[:-len("_bytes_per_token")] for c in table.columns if c.endswith("_bytes_per_token")]
    tuned_domain = next((d for d in domains if d != "shakespeare"), domains[0] if domains else "")
    shown = table.drop(columns=["run_id"])
    shown.to_csv(out_dir / "lossy_front.csv", index=False)
    (out_dir / "lossy_front.md").write_text("# " + title + "\n\n" + shown.to_markdown(index=False, floatfmt=".4g")
                                            + "\n")
    figs = plot_front(table, domains, out_dir) if domains else []
    text = [f"One run per arm and setting on {df.model.iloc[0]}, P = {int(df.world_size.iloc[0])}; fine-tuned "
            f"runs trained {int(table.steps.max())} steps with their loss active; bytes = what crossed to other "
            "ranks while evaluating, at wire size; prefill time measured per run (separate runs: noisier than "
            f"a same-world ratio); projected = the real OLMoE's MoE layers on {PROFILE} from the run's bytes "
            "(compression and decompression kernels not modelled)."]
    if tuned_domain:
        front = pareto(table[f"{tuned_domain}_bytes_per_token"], table[f"{tuned_domain}_loss"])
        names = [f"{table.arm.iloc[i]}{'' if table.finetuned.iloc[i] else ' (no ft)'}" for i in front]
        text.append(f"Pareto front on {tuned_domain} (fewest bytes first): " + ", ".join(names) + ".")
    return [Section(title, text, [("lossy_front", shown)], figs)]
