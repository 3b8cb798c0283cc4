"""The trained proxies' table (``python run.py experiment=proxies``; ``report: proxies``),
from the rows ``task=pretrain`` writes (a cached proxy's rows are those recorded when it
was trained: its wall time, held-out figures and expert load).

One row per proxy: its routed experts, top-k, shared experts, width and layers (from its
model config), router, parameters, pre-training wall time, held-out loss, perplexity and
next-token accuracy, and per MoE layer the experts never chosen on held-out text and the
busiest expert's load over the mean.
"""
from __future__ import annotations


import pandas as pd

from occult.config import read_conf
from occult.models.families import family_of

from ..sections import Section, write_table


def _router(m) -> str:
    """The model's gate rule in a few words."""
    words = [m.scoring_func + (" + correction bias" if family_of(m.family).correction_bias else "")]
    if m.topk_group < m.n_group:
        words.append(f"top-{m.topk_group} of {m.n_group} groups")
    if m.norm_topk_prob:
        words.append("renormalised")
    if m.routed_scaling_factor != 1.0:
        words.append(f"x {m.routed_scaling_factor:g}")
    return ", ".join(words)


def _per_layer(run: pd.DataFrame, metric: str, fmt: str) -> str:
    part = run[run.metric == metric].sort_values("layer")
    return ", ".join(fmt.format(v) for v in part.value)


def proxies_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per pre-trained proxy (the newest run of each)."""
    runs = df[df.task == "pretrain"]
    out = []
    for model, run in runs.groupby("model", sort=False):
        run = run[run.run_id == run.sort_values("time").run_id.iloc[-1]]
        m = read_conf("model", model)
        value = lambda metric: run[run.metric == metric].value.iloc[0]
        shared = "" if not m.num_shared_experts else (
            f"{m.num_shared_experts} gated" if m.family.startswith("qwen") else str(m.num_shared_experts))
        out.append({"proxy": model, "E": m.num_experts, "K": m.top_k, "shared": shared or "0",
                    "D": m.hidden_size, "layers": f"{m.num_layers}" + (f" ({m.first_k_dense} dense)"
                                                                        if m.first_k_dense else ""),
                    "router": _router(m), "parameters_M": value("parameters") / 1e6,
                    "wall_time_s": value("wall_time"), "val_loss": value("val_loss"),
                    "perplexity": value("val_perplexity"), "next_token_acc": value("val_accuracy"),
                    "never_chosen": _per_layer(run, "experts_never_chosen", "{:.0f}"),
                    "busiest_over_mean": _per_layer(run, "expert_load_max_over_mean", "{:.2f}")})
    return pd.DataFrame(out)


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder: ``proxies.csv`` / ``proxies.md``."""
    title = "The trained proxies"
    table = proxies_table(df)
    if table.empty:
        return [Section(title, ["Not measured: no task=pretrain runs."])]
    write_table(table, out_dir, "proxies")
    unigram = df[df.metric == "unigram_val_loss"].value
    text = ["Pre-training: `pretrain.*` settings (400 steps of 16 x 128 Shakespeare tokens by default), one "
            "process. Held-out = the Shakespeare validation split"
            + (f"; the unigram baseline there is {unigram.iloc[0]:.3f} nats/token" if len(unigram) else "")
            + ". Wall times are those recorded when each proxy was trained (other jobs may have shared the "
            "machine). Expert load on held-out text, per MoE layer: experts never chosen, and the busiest "
            "expert's load over the mean (max / mean)."]
    return [Section(title, text, [("proxies", table)])]
