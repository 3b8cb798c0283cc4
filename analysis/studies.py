"""Occult beyond exact: the expert-placement study and the pruning-accuracy table, as
report builders that read result tables only.

**Placement study** (``python run.py experiment=placement_study``; the ranks' part is
:mod:`occult.tasks.placement_study`): :func:`placement_study` turns the run's rows into
``placement_p<P>.csv`` (one row per optimiser, load cap and layer with the held-out
``ct_all, ct_remote, intra_ratio, load_max_over_mean, busiest_rows_vs_contiguous``,
``busiest_sfd_rows_vs_contiguous``, ``solve_s`` and the profiling figures),
``placement_p<P>.md`` (averaged over layers) and ``placement_front_p<P>.png/pdf`` (held-out
C_T against load balance, one point per optimiser and cap). The placement artifacts
(``placements_cap-<cap>.json``) are in the run folder.

**Pruning accuracy** (``python run.py experiment=fig7_pruning``): a sweep of
``task=finetune`` over arms: no fine-tuning, standard fine-tuning, and score /
similarity pruning at N_d' = 1, 2, 4 (``experiment=pruning_no_finetune`` adds pruning at
N_d' = 1, 2 without fine-tuning, into the same folder). Each run's arm is its ``label``
column (set by the experiment), else it is read from its ``system``, ``system_options``
and step count. The report builder :func:`fig7_pruning` writes ``accuracy.csv`` and
``accuracy.md`` (:func:`accuracy_table`; ``python -m analysis.studies accuracy <sweep
folder>`` rebuilds them) and draws the figure into ``report.md``.

Shapes: T tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import pandas as pd

from occult.placement.study import OPTIMISERS, LOAD_CAPS, frame_from_rows


# ---------------------------------------------------------------------------
# placement study: table and front (from the run's rows)
# ---------------------------------------------------------------------------


def plot_front(df: pd.DataFrame, out_dir: Path, name: str = "placement_front") -> list:
    """Held-out C_T (mean over layers) against load balance, per (optimiser, cap)."""
    from analysis.plots import plt, save

    mean = df.groupby(["optimiser", "load_cap"], sort=False)[["ct_all", "load_max_over_mean"]].mean().reset_index()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    markers = {"none": "o", "1.25": "s", "1.15": "^", "1.1": "D"}
    for i, optimiser in enumerate(OPTIMISERS):
        sel = mean[mean.optimiser == optimiser]
        # caps that gave the same placement quality share one point and one label
        points = sel.groupby([sel.load_max_over_mean.round(6), sel.ct_all.round(6)], sort=False).load_cap.apply(list)
        for j, ((x, y), caps) in enumerate(points.items()):
            ax.scatter(x, y, color=f"C{i}", marker=markers.get(caps[0], "o"), s=40, label=optimiser if j == 0 else None)
            text = "any cap" if len(caps) == len(LOAD_CAPS) else "/".join(caps)
            ax.annotate(text, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("held-out device load, max / mean")
    ax.set_ylabel("held-out C_T (devices/token, mean over layers)")
    ax.set_title("Expert placement: C_T vs load balance (labels: load cap)")
    ax.legend(fontsize=7)
    return save(fig, out_dir / name)


def placement_study(df: pd.DataFrame, out_dir) -> list:
    """Report builder (``experiment=placement_study``): per world size, the study's table
    (``placement_p<P>.csv``: one row per optimiser, cap and layer; ``.md``: averaged over
    layers) and the C_T-vs-load front (``placement_front_p<P>.png/pdf``), from the rows of
    its ``task=placement_study`` runs."""
    from .figures import Section

    title = "Expert placement: held-out C_T and load balance per optimiser and load cap"
    runs = df[df.task == "placement_study"]
    if runs.empty:
        return [Section(title, ["Not drawn: no task=placement_study runs."])]
    out_dir, sections = Path(out_dir), []
    for P, run in runs.groupby("world_size"):
        table = frame_from_rows(run)
        table.to_csv(out_dir / f"placement_p{P}.csv", index=False)
        (out_dir / f"placement_p{P}.md").write_text(placement_markdown(table) + "\n")
        figs = plot_front(table, out_dir, f"placement_front_p{P}")
        mean = table.groupby(["optimiser", "load_cap"], sort=False).mean(numeric_only=True).drop(columns="layer")
        text = [f"P = {P}, model {run.model.iloc[0]}: placements fitted on the profiling set, judged on held-out "
                "text (mean over MoE layers); the run folder holds one placement artifact per cap "
                "(placements_cap-<cap>.json, for system=occult_placed)."]
        sections.append(Section(f"{title} (P = {P})", text, [(f"placement_p{P}", mean.reset_index())], figs))
    return sections


def placement_markdown(df: pd.DataFrame) -> str:
    """The study averaged over layers, as a Markdown table."""
    mean = df.groupby(["optimiser", "load_cap"], sort=False).mean(numeric_only=True).drop(columns="layer")
    return mean.reset_index().to_markdown(index=False, floatfmt=".4g")


# ---------------------------------------------------------------------------
# pruning accuracy table
# ---------------------------------------------------------------------------

ARM_ORDER = ("no_finetune", "standard", "score_1", "score_2", "score_4", "similarity_1", "similarity_2",
             "similarity_4", "score_1_no_finetune", "score_2_no_finetune", "similarity_1_no_finetune",
             "similarity_2_no_finetune")


def arm_of(system: str, budget: Optional[int], steps: int) -> str:
    """The arm of one finetune run: ``no_finetune``, ``standard``, ``score_<budget>`` or
    ``similarity_<budget>`` (with ``_no_finetune`` when a pruned run has no steps)."""
    kinds = {"occult_prune_score": "score", "occult_prune_sim": "similarity"}
    if system not in kinds:
        return "standard" if steps else "no_finetune"
    return f"{kinds[system]}_{budget}" + ("" if steps else "_no_finetune")


def _budget(run: pd.DataFrame) -> Optional[int]:
    """system.budget of a run, from its ``system_options`` column (None without one)."""
    budget = json.loads(run.system_options.iloc[0] or "{}").get("budget")
    return None if budget is None else int(budget)


def accuracy_table(sweep_dir) -> pd.DataFrame:
    """:func:`accuracy_frame` of a sweep folder's runs."""
    from analysis.load import load_runs

    return accuracy_frame(load_runs([sweep_dir]))


def accuracy_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finetune run of ``df``: arm, held-out loss / perplexity / accuracy on
    each domain, mean C_T (over MoE layers) on each domain and over both."""
    df = df[df.task == "finetune"]
    out = []
    for run_dir, run in df.groupby("run_dir"):
        system, budget, steps = run.system.iloc[0], _budget(run), int((run.metric == "train_loss").sum())
        arm = run.label.iloc[0] or arm_of(system, budget, steps)
        rec = {"arm": arm, "system": system, "budget": budget, "steps": steps, "run_dir": run_dir}
        corpora = sorted(run[run.metric == "eval_loss"].phase.unique())
        for corpus in corpora:
            for metric in ("eval_loss", "eval_perplexity", "eval_accuracy"):
                rec[f"{corpus}_{metric[5:]}"] = run[(run.metric == metric) & (run.phase == corpus)].value.item()
            rec[f"{corpus}_ct_all"] = run[(run.metric == "ct_all") & (run.phase == corpus)].value.mean()
        rec["ct_all"] = run[(run.metric == "ct_all") & run.phase.isin(corpora)].value.mean()
        out.append(rec)
    table = pd.DataFrame(out)
    table["budget"] = table.budget.astype("Int64")
    order = {a: i for i, a in enumerate(ARM_ORDER)}
    return table.sort_values("arm", key=lambda s: s.map(lambda a: order.get(a, len(order)))).reset_index(drop=True)


def write_accuracy_table(table: pd.DataFrame, out_dir) -> Path:
    """Writes ``accuracy.csv`` and ``accuracy.md`` into ``out_dir``; returns the CSV path."""
    sweep_dir = Path(out_dir)
    table.to_csv(sweep_dir / "accuracy.csv", index=False)
    lines = ["# Collaboration pruning: held-out accuracy after fine-tuning", "",
             "Loss in nats/token; accuracy = next-token accuracy; C_T = devices per token (mean over "
             "MoE layers) during evaluation. Arms: no fine-tuning (task.steps=0), standard fine-tuning "
             "(system=occult), score / similarity pruning at N_d' = budget, all with the same step "
             "budget and frozen set.", "", table.drop(columns=["run_dir"]).to_markdown(index=False, floatfmt=".4g"),
             ""]
    (sweep_dir / "accuracy.md").write_text("\n".join(lines))
    return sweep_dir / "accuracy.csv"


FIG7_METHODS = {"score": "routing-score pruning", "similarity": "similarity pruning"}


def fig7_pruning(df: pd.DataFrame, out_dir) -> list:
    """Report builder (``report: analysis.studies.fig7_pruning``), Occult Fig. 7 in shape:
    held-out loss and accuracy on the fine-tuned domain, and the C_T measured while
    evaluating, against the device budget N_d', for score and similarity pruning, with
    standard and no fine-tuning as reference lines."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from .figures import Section
    from .plots import save, style

    title = "Fig. 7: collaboration pruning, accuracy and C_T vs device budget"
    table = accuracy_frame(df)
    if table.empty:
        return [Section(title, ["Not drawn: no task=finetune runs."])]
    write_accuracy_table(table, out_dir)
    domain = next((c[:-len("_loss")] for c in table.columns if c.endswith("_loss") and c != "shakespeare_loss"),
                  "shakespeare")
    tuned = table[table.steps > 0]
    pruned = tuned[tuned.budget.notna()].assign(
        method=lambda t: t.arm.str.split("_").str[0].map(FIG7_METHODS), budget=lambda t: t.budget.astype(int))
    lines = {"standard fine-tuning": tuned[tuned.arm == "standard"], "no fine-tuning": table[table.arm == "no_finetune"]}
    style()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, col, label in zip(axes, (f"{domain}_loss", f"{domain}_accuracy", "ct_all"),
                              (f"held-out loss on {domain} (nats/token)", f"next-token accuracy on {domain}",
                               "C_T while evaluating (devices/token)")):
        if not pruned.empty:
            sns.lineplot(data=pruned, x="budget", y=col, hue="method", style="method", markers=True, dashes=False,
                         ax=ax, hue_order=list(FIG7_METHODS.values()))
        for (name, ref), ls in zip(lines.items(), ("--", ":")):
            if ref.empty:
                continue
            if name == "no fine-tuning" and col != "ct_all":   # far off the pruning scale: named, not drawn
                ax.plot([], [], " ", label=f"{name}: {ref[col].mean():.3f} (off the axis)")
            else:
                ax.axhline(ref[col].mean(), color="k", ls=ls, lw=1, label=name)
        ax.set_xlabel("device budget N_d' (devices per token)")
        ax.set_ylabel(label)
        ax.set_xticks(sorted(pruned.budget.unique()) if not pruned.empty else [])
        ax.legend(fontsize=7)
    fig.tight_layout()
    figs = save(fig, Path(out_dir) / "fig7_pruning")
    text = [f"One fine-tuning run per arm (same steps, frozen set and batches) on the {domain} domain; loss and "
            "accuracy on its held-out split; C_T measured during that evaluation. Occult reports that pruning "
            "to 2 devices keeps standard fine-tuning's accuracy and that similarity pruning beats score "
            "pruning (docs/paper_claims.md); compare the lines here, which are one seed of a CPU proxy."]
    return [Section(title, text, [("fig7_pruning", table.drop(columns=["run_dir"]))], figs)]


def main() -> None:
    ap = argparse.ArgumentParser(description="Rebuild a study's table from its run folders.")
    ap.add_argument("study", choices=["accuracy"], help="which table")
    ap.add_argument("sweep_dir", help="the sweep folder (e.g. runs/fig7_pruning)")
    args = ap.parse_args()
    path = write_accuracy_table(accuracy_table(args.sweep_dir), args.sweep_dir)
    print(f"{path}\n{(Path(args.sweep_dir) / 'accuracy.md').read_text()}")


if __name__ == "__main__":
    main()
