"""Writing a run's routing trace (rank 0, after gathering every rank's routing); the
format and its readers are :mod:`occult.routing_traces`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..ep import Recorder
from ..ep.measure import gather_objects
from ..routing_traces import LOGITS_FILE, ROUTING_FILE


def write_trace(ctx, rec: Recorder, out_dir: Path) -> None:
    """Gathers every rank's routing of the last timed iteration and writes the trace."""
    per_layer: dict = {}
    for layer, ids, weights, logits in rec.routing:
        per_layer.setdefault(layer, []).append((ids, weights, logits))
    # device-to-host: the trace is written after the timed work
    local = {layer: tuple(None if parts[0][j] is None else torch.cat([p[j] for p in parts]).float().cpu()
                          if j else torch.cat([p[0] for p in parts]).cpu() for j in range(3))
             for layer, parts in per_layer.items()}
    gathered = gather_objects(ctx.ep, local)
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
    pd.concat(frames, ignore_index=True).to_parquet(out_dir / ROUTING_FILE, index=False)
    if logits_arrays:
        np.savez(out_dir / LOGITS_FILE, **logits_arrays)
