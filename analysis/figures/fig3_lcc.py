"""Occult Fig. 3: experts in the largest connected component of the co-activation graph
against tokens in the batch (``report: fig3_lcc``).

From every run with a routing trace: top-2/4/6/8 taken from its router's logits at the
last MoE layer (the same router, only the number of experts taken changes), beside
uniform routing (simulated with the same batch sizes, :mod:`analysis.lcc`).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from occult.routing_traces import load_trace, trace_topk

from ..lcc import lcc_curve, token_counts, topk_from_logits, uniform_lcc_curve
from ..plots import save, style
from ..sections import Section, no_data
from ..traces import router_kind, traced_runs

LCC_TOP_K = (2, 4, 6, 8)
LCC_DRAWS = 16
LCC_FRACTIONS = (0.5, 0.9, 1.0)


def _tokens_to_reach(curve: pd.DataFrame, fraction: float, num_experts: int) -> str:
    """Median over draws of the fewest tokens whose LCC holds ``fraction`` of the experts."""
    need = fraction * num_experts
    firsts = []
    for _, d in curve.groupby("draw"):
        hit = d[d.lcc >= need - 1e-9].tokens
        firsts.append(hit.min() if not hit.empty else np.inf)
    med = float(np.median(firsts))
    return f"> {int(curve.tokens.max())}" if np.isinf(med) else f"{med:g}"


def lcc_curves(df: pd.DataFrame, draws: int = 0, seed: int = 0) -> tuple[pd.DataFrame, list[str]]:
    """LCC-vs-tokens curves of every traced run (last MoE layer), top-2/4/6/8 taken from
    the router's logits, beside uniform routing (``draws`` token orders; 0: LCC_DRAWS);
    plus notes on each trace."""
    draws = draws or LCC_DRAWS
    frames, notes = [], []
    for run_dir, run in traced_runs(df):
        trace, logits = load_trace(run_dir)
        layer = int(trace.layer.max())
        E, K, model = int(run.num_experts.iloc[0]), int(run.top_k.iloc[0]), str(run.model.iloc[0])
        ids_model = trace_topk(trace, layer)[0].numpy()
        checkpoints = token_counts(len(ids_model))
        kind_of_router = router_kind(run)
        if layer in logits:
            agree = float((np.sort(topk_from_logits(logits[layer], K), 1) == np.sort(ids_model, 1)).all(1).mean())
            per_k = {k: topk_from_logits(logits[layer], k) for k in LCC_TOP_K if k <= E}
            notes.append(f"`{model}` ({kind_of_router}, top-{K} model), layer {layer}, {len(ids_model)} tokens from "
                         f"run `{run.run_id.iloc[0]}`: top-k for k = {', '.join(map(str, per_k))} taken from its router's "
                         f"logits (the same router, only the number of experts taken changes; its own "
                         f"top-{K} agrees with the recorded routing on {agree:.1%} of tokens).")
        else:
            per_k = {K: ids_model}
            notes.append(f"`{model}`, layer {layer}: no router logits in the trace; its own top-{K} only.")
        for k, ids in per_k.items():
            for kind, curve in ((kind_of_router, lcc_curve(ids, E, checkpoints, draws, seed)),
                                ("uniform (simulated)", uniform_lcc_curve(E, k, checkpoints, draws, seed))):
                curve["model"], curve["top_k"], curve["routing"], curve["num_experts"] = model, k, kind, E
                frames.append(curve)
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), notes


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 3: experts in the largest connected component vs tokens in the batch."""
    title = "Fig. 3: largest connected component of the co-activation graph"
    curves, notes = lcc_curves(df)
    if curves.empty:
        return no_data(title, "routing traces (task.save_routing=true)")
    style()
    models = sorted(curves.model.unique())
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False)
    colors = dict(zip(LCC_TOP_K, sns.color_palette("viridis", len(LCC_TOP_K))))
    for ax, model in zip(axes[0], models):
        sub = curves[curves.model == model]
        for (k, kind), c in sub.groupby(["top_k", "routing"]):
            stats = c.groupby("tokens").lcc.agg(["median", lambda s: s.quantile(0.25), lambda s: s.quantile(0.75)])
            stats.columns = ["median", "q25", "q75"]
            trained = not kind.startswith("uniform")
            ax.plot(stats.index, stats["median"], "-o" if trained else "--", ms=3, color=colors.get(k),
                    label=f"top-{k}, {kind}", lw=1.6 if trained else 1.0, alpha=1.0 if trained else 0.8)
            if trained:
                ax.fill_between(stats.index, stats.q25, stats.q75, color=colors.get(k), alpha=0.15)
        E = int(sub.num_experts.iloc[0])
        ax.axhline(E, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the batch")
        ax.set_ylabel(f"experts in the largest component (of E = {E})")
        ax.set_title(f"{model}, last MoE layer")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Co-activation graph connectivity (routing traces; uniform: simulated)", y=1.02)
    figs = save(fig, Path(out_dir) / "fig3_lcc")
    summary = []
    for (model, kind, k), c in curves.groupby(["model", "routing", "top_k"]):
        E = int(c.num_experts.iloc[0])
        med = c.groupby("tokens").lcc.median()
        row = {"model": model, "routing": kind, "top_k": k, "E": E}
        row.update({f"tokens to {int(f * 100)} % of E": _tokens_to_reach(c, f, E) for f in LCC_FRACTIONS})
        row.update({f"LCC @ {n} tokens": med.get(n, np.nan) for n in (1, 4, 16, 64)})
        summary.append(row)
    text = ["Nodes are experts; an edge joins two experts that one token chose together. A batch of n "
            f"tokens is the first n of a random order of the trace's tokens ({curves.draw.nunique()} orders; median, "
            "band: quartiles). Uniform routing: K distinct experts per token uniformly at random, "
            "simulated with the same batch sizes. 'tokens to x % of E': the first batch size among 1, 2, "
            "4, ... whose largest component holds that share of the experts (median over orders). "
            "Paper's point: the graph connects after a few tokens, "
            "so re-placing experts per batch cannot keep a batch's tokens on few devices."] + notes
    curve_medians = curves.groupby(["model", "routing", "top_k", "tokens"]).lcc.median().reset_index()
    return [Section(title, text, [("fig3_lcc", pd.DataFrame(summary))], figs,
                    data=[("fig3_lcc_curves", curve_medians)])]
