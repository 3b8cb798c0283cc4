"""Profiling the pre-trained router for similarity pruning (run in the launching process
before the ranks start, by ``task=finetune``'s ``prepare``).

Similarity pruning (:class:`occult.collab.variants.OccultSimilarityPruningDispatcher`)
needs each layer's expert similarity, the cosine of the experts' router logits over a
profiling set. With ``system.similarity_file: null``, :func:`ensure_similarity_file`
profiles the single-device model on the task's training data and points the system at
the file it writes.

Shapes: N profiling tokens, E experts.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..collab.variants import OccultSimilarityPruningDispatcher
from ..ep import system_config


@torch.no_grad()
def route_text(model, family, ids_N: torch.Tensor, num_tokens: int, seq_len: int, seed: int,
               batch_size: int = 8) -> dict:
    """How the single-device ``model``'s routers route ``num_tokens`` tokens of random windows
    (seeded) of ``ids_N``: ``{layer: (topk_ids_NK, topk_weights_NK, logits_NE)}``, the gates'
    own output (the ids and weights its MoE blocks would run with), float32 on the host."""
    from ..data.batches import batch_iterator
    from ..models.build import RouterTap, moe_blocks

    layers = [i for i, _, _ in moe_blocks(model, family)]
    windows = max(1, -(-num_tokens // seq_len))
    tap = RouterTap(model, family)
    try:
        model.eval()
        for x_BS, _ in batch_iterator(ids_N, min(batch_size, windows), seq_len, seed,
                                      num_batches=-(-windows // min(batch_size, windows))):
            model(input_ids=x_BS)
    finally:
        tap.remove()
    per_layer: dict = {layer: [] for layer in layers}
    for j, call in enumerate(tap.calls):
        per_layer[layers[j % len(layers)]].append(call)
    cat = lambda parts, i, kind: torch.cat([p[i] for p in parts])[:num_tokens].to("cpu", kind)
    return {layer: (cat(parts, 1, torch.long), cat(parts, 2, torch.float32), cat(parts, 0, torch.float32))
            for layer, parts in per_layer.items()}


def profile_router_logits(model, family, ids_N: torch.Tensor, num_tokens: int, seq_len: int, seed: int,
                          batch_size: int = 8) -> dict:
    """Router logits of the single-device ``model`` on ``num_tokens`` tokens of random
    windows (seeded) of ``ids_N``: ``{layer: logits [N, E] (float32 numpy)}``."""
    routed = route_text(model, family, ids_N, num_tokens, seq_len, seed, batch_size)
    return {layer: logits.numpy() for layer, (_, _, logits) in routed.items()}


def needs_profile(system) -> bool:
    """Whether ``system`` is similarity pruning without a similarity file."""
    config = system_config(system)
    return isinstance(config, OccultSimilarityPruningDispatcher.Config) and config.needs_router_profile


def ensure_similarity_file(spec):
    """For similarity pruning with ``similarity_file: null``: profiles the pre-trained
    router on the task's training data (``task.corpus``, ``task.split``;
    ``system.profile_tokens`` tokens of seeded random windows), writes
    ``profile_router_logits.npz`` into the run folder and returns the run spec with
    ``system.similarity_file`` set to it. Other systems' specs return unchanged."""
    if not needs_profile(spec.system):
        return spec
    import dataclasses

    from ..data.batches import token_ids
    from ..data.tokenizer import get_tokenizer
    from ..models.families import family_of
    from ..models.runtime import base_model

    t = spec.task
    tok = get_tokenizer(spec.pretrain.tokenizer_vocab, corpus=spec.pretrain.corpus)
    model = base_model(spec, spec.model.vocab_size or tok.vocab_size, spec.checkpoint)
    tokens = int(spec.system.profile_tokens)
    print(f"profiling router logits for similarity pruning: {tokens} tokens of {t.corpus}/{t.split}",
          flush=True)
    logits = profile_router_logits(model, family_of(spec.model.family), token_ids(t.corpus, t.split, tok),
                                   tokens, t.seq_len, seed=spec.seed + 7)
    out = Path(spec.out_dir) / "profile_router_logits.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **{f"layer_{layer}": a for layer, a in sorted(logits.items())})
    return spec.replace(system=dataclasses.replace(spec.system, similarity_file=str(out)))
