"""Routing traces: what every token of a run chose, per MoE layer, for analysis without
rerunning the model.

``routing.parquet``: columns ``layer, rank, token, slot, expert, weight`` (one row per
(token, top-k slot)); ``router_logits.npz``: one float32 array [T, E] per layer
(``layer_<i>``, all ranks' tokens in rank order). Written by rank 0.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from ..ep import Recorder


def _gather(ctx, obj):
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.ep.group)
    return out


def write_trace(ctx, rec: Recorder, out_dir: Path) -> None:
    """Gathers every rank's routing of the last timed iteration and writes the trace."""
    per_layer: dict = {}
    for layer, ids, weights, logits in rec.routing:
        per_layer.setdefault(layer, []).append((ids, weights, logits))
    local = {layer: tuple(None if parts[0][j] is None else torch.cat([p[j] for p in parts]).float()
                          if j else torch.cat([p[0] for p in parts]) for j in range(3))
             for layer, parts in per_layer.items()}
    gathered = _gather(ctx, local)
    if ctx.rank != 0:
        return
    frames, logits_arrays = [], {}
    for layer in sorted(gathered[0]):
        all_logits = []
        for rank, by_layer in enumerate(gathered):
            ids, weights, logits = by_layer[layer]
            T, K = ids.shape
            frames.append(pd.DataFrame({
                "layer": layer, "rank": rank, "token": np.repeat(np.arange(T), K), "slot": np.tile(np.arange(K), T),
                "expert": ids.flatten().numpy(), "weight": (weights.flatten().numpy() if weights is not None
                                                            else np.full(T * K, np.nan))}))
            if logits is not None:
                all_logits.append(logits.numpy().astype(np.float32))
        if all_logits:
            logits_arrays[f"layer_{layer}"] = np.concatenate(all_logits)
    out_dir.mkdir(parents=True, exist_ok=True)
    pd.concat(frames, ignore_index=True).to_parquet(out_dir / "routing.parquet", index=False)
    if logits_arrays:
        np.savez(out_dir / "router_logits.npz", **logits_arrays)


def load_trace(run_dir) -> tuple[pd.DataFrame, dict]:
    """The trace of a run folder: (routing DataFrame, {layer: logits [T, E]})."""
    run_dir = Path(run_dir)
    df = pd.read_parquet(run_dir / "routing.parquet")
    logits = {}
    path = run_dir / "router_logits.npz"
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
