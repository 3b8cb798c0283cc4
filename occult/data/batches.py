"""Token tensors and language-model batches from the corpus splits.

``token_ids`` encodes the documents of one split, each followed by the tokenizer's
end-of-document id, into one long 1-D tensor ``ids_N`` and caches it as a ``.npy`` file
next to the tokenizer (loaded with ``allow_pickle=False``, so a cache file cannot run
code). The file name carries the tokenizer name and a digest of the split text.

``batch_iterator`` draws random training windows (seeded, reproducible);
``eval_batches`` walks a split in order without overlap for held-out loss;
``unigram_loss`` is the add-one-smoothed unigram baseline to report beside model losses.

Shapes: N tokens of a split, B batch rows, S sequence length.
"""
from __future__ import annotations

import io
import math
from typing import Iterator

import numpy as np
import torch

from occult.data.corpora import check_corpus, check_split, split_documents
from occult.data.tokenizer import atomic_write_bytes, text_digest


def _encode_documents(texts: list[str], tokenizer) -> torch.Tensor:
    """Token ids of the texts, each followed by ``tokenizer.eot_id``: ``ids_N`` (long)."""
    pieces = []
    for ids in tokenizer.encode_batch(texts):
        pieces.extend(ids)
        pieces.append(tokenizer.eot_id)
    return torch.tensor(pieces, dtype=torch.long, device="cpu")


def token_ids(corpus: str, split: str, tokenizer) -> torch.LongTensor:
    """Every token of ``split`` of ``corpus``, documents in sorted order, each followed
    by the end-of-document id. Returns ``ids_N`` (long).

    Cached as ``<tokenizer.cache_dir>/<tokenizer.name>.<corpus>-<split>-<digest>.npy``
    (uint16 when the vocabulary fits, else int32); no caching when ``cache_dir`` is None.
    """
    check_corpus(corpus)
    check_split(split)
    texts = list(split_documents(corpus, split).values())
    folder = getattr(tokenizer, "cache_dir", None)
    path = None
    if folder is not None:
        path = folder / f"{tokenizer.name}.{corpus}-{split}-{text_digest(texts)}.npy"
        if path.exists():
            return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    ids_N = _encode_documents(texts, tokenizer)
    if path is not None:
        dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        buf = io.BytesIO()
        np.save(buf, ids_N.numpy().astype(dtype), allow_pickle=False)
        atomic_write_bytes(path, buf.getvalue())
    return ids_N


def _check_window(ids_N: torch.Tensor, batch_size: int, seq_len: int) -> None:
    if ids_N.dim() != 1:
        raise ValueError(f"ids must be 1-D token ids, got shape {tuple(ids_N.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: allowed values are integers >= 1")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: allowed values are integers >= 1")
    if ids_N.numel() < seq_len + 1:
        raise ValueError(f"seq_len={seq_len}: allowed values are 1..{ids_N.numel() - 1} "
                         f"for {ids_N.numel()} tokens (a window needs seq_len + 1 tokens)")


def _windows(ids_N: torch.Tensor, starts_B: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x_BS`` = ids[start : start+S] and targets ``y_BS`` = ids[start+1 : start+S+1]."""
    idx_BS1 = starts_B.unsqueeze(1) + torch.arange(seq_len + 1, device=starts_B.device)
    w_BS1 = ids_N[idx_BS1].long()
    return w_BS1[:, :-1], w_BS1[:, 1:]


def batch_iterator(ids: torch.Tensor, batch_size: int, seq_len: int, seed: int,
                   num_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random training windows: yields ``(x_BS, y_BS)`` (long), ``y_BS`` = ``x_BS``
    shifted by one token. Window starts are uniform over ``0..N-S-1``, drawn from a
    ``torch.Generator`` seeded with ``seed``, so the sequence of batches is the same for
    the same arguments. Endless unless ``num_batches`` is given.
    """
    _check_window(ids, batch_size, seq_len)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    high = ids.numel() - seq_len                     # starts 0..N-S-1 leave room for the target
    produced = 0
    while num_batches is None or produced < num_batches:
        starts_B = torch.randint(0, high, (batch_size,), generator=gen, device="cpu")
        yield _windows(ids, starts_B, seq_len)
        produced += 1


def num_eval_windows(num_tokens: int, seq_len: int) -> int:
    """Non-overlapping windows of ``seq_len`` targets in ``num_tokens`` tokens."""
    return (num_tokens - 1) // seq_len


def eval_batches(ids: torch.Tensor, batch_size: int, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out batches in order: window ``w`` is ``x = ids[w*S : (w+1)*S]``,
    ``y = ids[w*S+1 : (w+1)*S+1]``, for ``w`` in ``0..W-1``, ``W = (N-1) // S``.

    Every token ``ids[1 : W*S+1]`` is a target exactly once; the last ``< S`` tokens are
    left out so all windows are full. Yields ``(x_BS, y_BS)`` (long); the last batch may
    have fewer than ``batch_size`` rows.
    """
    _check_window(ids, batch_size, seq_len)
    windows = num_eval_windows(ids.numel(), seq_len)
    for first in range(0, windows, batch_size):
        starts_B = torch.arange(first, min(first + batch_size, windows), device="cpu") * seq_len
        yield _windows(ids, starts_B, seq_len)


def unigram_loss(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per token) on ``eval_ids`` of a unigram model fitted on
    ``train_ids`` with add-one smoothing: p(v) = (count(v) + 1) / (N_train + V).

    A context-free baseline: a model that learned anything should go below it.
    """
    for arg, ids in (("train_ids", train_ids), ("eval_ids", eval_ids)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"{arg}: token ids must lie in 0..vocab_size-1 = 0..{vocab_size - 1}")
    if eval_ids.numel() == 0:
        raise ValueError("eval_ids is empty: nothing to evaluate")
    counts_V = torch.bincount(train_ids.long().flatten(), minlength=vocab_size).double() + 1.0
    logp_V = counts_V.log() - math.log(float(counts_V.sum()))
    return float(-logp_V[eval_ids.long().flatten()].mean())
