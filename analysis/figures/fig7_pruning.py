"""Collaboration pruning's accuracy, Occult Fig. 7 in shape (``report: fig7_pruning``).

``python run.py experiment=fig7_pruning``: a sweep of ``task=finetune`` over arms: no
fine-tuning, standard fine-tuning, and score / similarity pruning at N_d' = 1, 2, 4;
``experiment=pruning_no_finetune`` (its own folder, runs/pruning_no_finetune) adds pruning
at N_d' = 1, 2 without fine-tuning: ``python -m analysis.report runs/fig7_pruning
runs/pruning_no_finetune --figures fig7_pruning`` draws both. Each run's arm is its
``label`` column, set by the experiment for every point. The builder writes
``accuracy.csv`` and ``accuracy.md`` (:func:`accuracy_table`; ``python -m
analysis.figures.fig7_pruning <sweep folders>`` rebuilds them) and draws the figure.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from occult.config import setting_columns

from ..plots import save, style, system_order
from ..sections import Section

def _budget(run: pd.DataFrame) -> Optional[int]:
    """The run's cap on devices per token, from its setting columns: pruning's ``budget`` or
    the group limit's ``topk_group`` (None without one: a system without the field writes
    its ``absent`` value, the group limit's ``topk_group: null`` no limit)."""
    for name in ("budget", "topk_group"):
        value = run[name].iloc[0]
        if not pd.isna(value) and value != setting_columns()[name][1]:
            return int(value)
    return None


def accuracy_table(sweep_dirs) -> pd.DataFrame:
    """:func:`accuracy_frame` of the runs under one sweep folder or several."""
    from analysis.load import load_runs

    return accuracy_frame(load_runs(sweep_dirs))


def accuracy_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finetune run (``run_id``) of ``df``: its arm (the ``label`` the
    experiment gave it), held-out loss / perplexity / accuracy on each domain, mean C_T
    (over MoE layers) on each domain and over both; in :func:`arm_order`."""
    df = df[df.task == "finetune"]
    out = []
    for run_id, run in df.groupby("run_id", sort=False):
        system, budget, steps = run.system.iloc[0], _budget(run), int((run.metric == "train_loss").sum())
        rec = {"arm": run.label.iloc[0], "system": system, "budget": budget, "steps": steps, "run_id": run_id}
        corpora = sorted(run[run.metric == "eval_loss"].phase.unique())
        for corpus in corpora:
            for metric in ("eval_loss", "eval_perplexity", "eval_accuracy"):
                rec[f"{corpus}_{metric[5:]}"] = run[(run.metric == metric) & (run.phase == corpus)].value.item()
            rec[f"{corpus}_ct_all"] = run[(run.metric == "ct_all") & (run.phase == corpus)].value.mean()
        rec["ct_all"] = run[(run.metric == "ct_all") & run.phase.isin(corpora)].value.mean()
        out.append(rec)
    table = pd.DataFrame(out)
    if table.empty:
        return table
    table["budget"] = table.budget.astype("Int64")
    return arm_order(table)


def arm_order(table: pd.DataFrame) -> pd.DataFrame:
    """The arms in reading order: by system (the legend order: Occult, then score, then
    similarity pruning), budget and steps, with pruned arms that were not fine-tuned last."""
    rank = {s: i for i, s in enumerate(system_order(table.system))}
    keys = pd.DataFrame({"untuned_pruned": table.budget.notna() & (table.steps == 0),
                         "system": table.system.map(rank), "budget": table.budget.fillna(-1), "steps": table.steps})
    return table.loc[keys.sort_values(list(keys.columns), kind="stable").index].reset_index(drop=True)


def write_accuracy_table(table: pd.DataFrame, out_dir) -> Path:
    """Writes ``accuracy.csv`` and ``accuracy.md`` into ``out_dir``; returns the CSV path."""
    sweep_dir = Path(out_dir)
    table.to_csv(sweep_dir / "accuracy.csv", index=False)
    lines = ["# Collaboration pruning: held-out accuracy after fine-tuning", "",
             "Loss in nats/token; accuracy = next-token accuracy; C_T = devices per token (mean over "
             "MoE layers) during evaluation. Arms: no fine-tuning (task.steps=0), standard fine-tuning "
             "(system=occult), score / similarity pruning at N_d' = budget, all with the same step "
             "budget and frozen set.", "", table.drop(columns=["run_id"]).to_markdown(index=False, floatfmt=".4g"),
             ""]
    (sweep_dir / "accuracy.md").write_text("\n".join(lines))
    return sweep_dir / "accuracy.csv"


FIG7_METHODS = {"occult_prune_score": "routing-score pruning", "occult_prune_sim": "similarity pruning"}


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder, Occult Fig. 7 in shape: held-out loss and accuracy on the
    fine-tuned domain, and the C_T measured while evaluating, against the device budget
    N_d', for score and similarity pruning (each a system), with standard and no
    fine-tuning (unpruned runs with and without steps) as reference lines."""
    title = "Fig. 7: collaboration pruning, accuracy and C_T vs device budget"
    table = accuracy_frame(df)
    if table.empty:
        return [Section(title, ["Not drawn: no task=finetune runs."])]
    write_accuracy_table(table, out_dir)
    domain = next((c[:-len("_loss")] for c in table.columns if c.endswith("_loss") and c != "shakespeare_loss"),
                  "shakespeare")
    tuned = table[table.steps > 0]
    pruned = tuned[tuned.budget.notna()].assign(
        method=lambda t: t.system.map(FIG7_METHODS), budget=lambda t: t.budget.astype(int))
    unpruned = table[table.budget.isna()]
    lines = {"standard fine-tuning": unpruned[unpruned.steps > 0], "no fine-tuning": unpruned[unpruned.steps == 0]}
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
    return [Section(title, text, [("fig7_pruning", table.drop(columns=["run_id"]))], figs)]


def main() -> None:
    ap = argparse.ArgumentParser(description="Rebuild accuracy.csv / accuracy.md from run folders.")
    ap.add_argument("paths", nargs="+", help="sweep folders (e.g. runs/fig7_pruning runs/pruning_no_finetune)")
    ap.add_argument("--out", default=None, help="where to write (default: the first folder)")
    args = ap.parse_args()
    out = Path(args.out or args.paths[0])
    path = write_accuracy_table(accuracy_table(args.paths), out)
    print(f"{path}\n{(out / 'accuracy.md').read_text()}")


if __name__ == "__main__":
    main()
