"""Routing-trace files: what every token of a run chose, per MoE layer, for analysis
without rerunning the model (written by :func:`occult.tasks.traces.write_trace`).

``routing.parquet``: columns ``layer, rank, token, slot, expert, weight`` (one row per
(token, top-k slot)); ``router_logits.npz``: one float32 array [T, E] per layer
(``layer_<i>``, all ranks' tokens in rank order).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROUTING_FILE = "routing.parquet"
LOGITS_FILE = "router_logits.npz"


def load_trace(run_dir) -> tuple[pd.DataFrame, dict]:
    """The trace of a run folder: (routing DataFrame, {layer: logits [T, E]})."""
    run_dir = Path(run_dir)
    df = pd.read_parquet(run_dir / ROUTING_FILE)
    logits = {}
    path = run_dir / LOGITS_FILE
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            logits = {int(k.split("_")[1]): z[k] for k in z.files}
    return df, logits


def trace_topk(df: pd.DataFrame, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's top-k ids [T, K] (all ranks, rank order) and each token's home rank [T]."""
    sel = df[df.layer == layer].sort_values(["rank", "token", "slot"])
    K = int(sel.slot.max()) + 1
    ids = torch.tensor(sel.expert.to_numpy(), dtype=torch.long).view(-1, K)
    home = torch.tensor(sel["rank"].to_numpy()[::K], dtype=torch.long)
    return ids, home


def trace_layers(run_dir) -> dict:
    """Every layer of a run's trace: ``{layer: (topk_ids_NK, weights_NK, logits_NE or None)}``,
    all ranks' tokens in rank order (the logits when the run wrote them)."""
    df, logits = load_trace(run_dir)
    out = {}
    for layer in sorted(df.layer.unique().tolist()):
        sel = df[df.layer == layer].sort_values(["rank", "token", "slot"])
        K = int(sel.slot.max()) + 1
        ids = torch.tensor(sel.expert.to_numpy(), dtype=torch.long).view(-1, K)
        weights = torch.tensor(sel.weight.to_numpy(), dtype=torch.float32).view(-1, K)
        out[int(layer)] = (ids, weights, torch.from_numpy(logits[layer]) if layer in logits else None)
    return out
