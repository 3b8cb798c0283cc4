"""DeepSeek's group limit beside Occult's pruning (``python run.py experiment=group_limit``;
``report: group_limit``), from result tables only.

Each run is one arm of ``task=finetune`` (its ``label``): a routing rule that caps the
devices per token (``system=group_limit`` at M = ``topk_group``, ``occult_prune_score`` /
``occult_prune_sim`` at ``budget``) or none (``system=occult``), without fine-tuning
(``task.steps=0``) or after it. :func:`group_limit_table` puts both of an arm's runs on
one row: held-out loss and accuracy on each domain before and after fine-tuning, and the
C_T and remote bytes measured while evaluating (after fine-tuning, where it ran).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ..plots import save, style
from ..sections import Section, write_table
from .fig7_pruning import accuracy_frame

METHODS = {"occult": "no cap (the router's own routing)", "group_limit": "DeepSeek-V3 group limit",
           "occult_prune_score": "Occult score pruning", "occult_prune_sim": "Occult similarity pruning"}


def _remote_bytes(df: pd.DataFrame) -> pd.Series:
    """Remote bytes while evaluating, summed over the domains and ranks, per run_id."""
    return df[df.metric == "eval_remote_bytes"].groupby("run_id").value.sum()


def group_limit_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, devices-per-token cap): before / after fine-tuning."""
    runs = accuracy_frame(df)
    if runs.empty:
        return runs
    runs["remote_MB"] = runs.run_id.map(_remote_bytes(df[df.task == "finetune"])) / 1e6
    domains = sorted(c[:-len("_loss")] for c in runs.columns if c.endswith("_loss"))
    out = []
    for (system, budget), arm in runs.groupby(["system", runs.budget.fillna(0)], sort=False):
        before, after = arm[arm.steps == 0], arm[arm.steps > 0]
        rec = {"method": METHODS.get(system, system), "system": system,
               "devices_cap": int(budget) if budget else None}
        for when, part in (("before", before), ("after", after)):
            for d in domains:
                for q in ("loss", "accuracy"):
                    rec[f"{d}_{q}_{when}"] = part[f"{d}_{q}"].mean() if len(part) else float("nan")
        measured = after if len(after) else before
        rec["ct_all"] = measured.ct_all.mean()
        rec["remote_MB"] = measured.remote_MB.mean()
        rec["steps"] = int(after.steps.max()) if len(after) else 0
        out.append(rec)
    table = pd.DataFrame(out)
    order = {s: i for i, s in enumerate(METHODS)}
    table["_o"] = table.system.map(order).fillna(len(order))
    table = table.sort_values(["_o", "devices_cap"], na_position="first").drop(columns="_o")
    table["devices_cap"] = table.devices_cap.astype("Int64")
    return table.reset_index(drop=True)


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder: the table (``group_limit.csv`` / ``.md``) and the figure (loss after
    fine-tuning and C_T against the cap, one line per method)."""
    title = "DeepSeek's group limit beside Occult's pruning"
    table = group_limit_table(df)
    if table.empty or not (table.system == "group_limit").any():
        return [Section(title, ["Not measured: no task=finetune runs of system=group_limit."])]
    out_dir = Path(out_dir)
    write_table(table, out_dir, "group_limit")
    domain = next((c[:-len("_loss_after")] for c in table.columns
                   if c.endswith("_loss_after") and not c.startswith("shakespeare")), "shakespeare")
    capped = table[table.devices_cap.notna()]
    reference = table[table.devices_cap.isna()]
    style()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = ((f"{domain}_loss_before", f"held-out loss on {domain}, not fine-tuned"),
              (f"{domain}_loss_after", f"held-out loss on {domain}, fine-tuned"),
              ("ct_all", "C_T while evaluating (devices/token)"))
    for ax, (col, label) in zip(axes, panels):
        for system, part in capped.groupby("system", sort=False):
            ax.plot(part.devices_cap.astype(int), part[col], marker="o", label=METHODS.get(system, system))
        if len(reference) and reference[col].notna().all():
            ax.axhline(reference[col].mean(), color="k", ls="--", lw=1, label=METHODS["occult"])
        ax.set_xlabel("devices per token allowed (M, budget)")
        ax.set_ylabel(label)
        ax.set_xticks(sorted(capped.devices_cap.astype(int).unique()))
        ax.legend(fontsize=7)
    fig.tight_layout()
    figs = save(fig, out_dir / "group_limit")
    steps = int(table.steps.max())
    text = [f"One run per arm and phase on the model of the sweep: each cap without fine-tuning and after {steps} "
            "steps of Occult's modified fine-tuning (same batches and frozen set); loss and accuracy on the "
            "held-out splits, C_T and remote bytes measured while evaluating (after fine-tuning where it ran). "
            "The group limit ranks devices by the sum of their two best experts' selection scores (DeepSeek-V3's "
            "group score, its correction bias included); score pruning by the sum of all the token's "
            "weights there; similarity pruning keeps the top-k and swaps out experts on other devices."]
    return [Section(title, text, [("group_limit", table)], figs)]
