"""system=lsh: LSH-MoE's compressed exchange (harness implementation, from the paper; it
has no public code).

LSH-MoE (Nie et al., NeurIPS 2024) sends fewer rows by sending, for each group of
similar tokens bound for one expert, only their centroid. My reading, as implemented:

  sender    the (token, expert) pairs, sorted by destination device and local expert
            (naive EP's order); each pair's token hashed with ``bits`` random
            hyperplanes (the signs of x . h_j, hyperplanes seeded per layer, the same
            on every rank): pairs of one expert with one hash code form a bucket;
            each bucket's centroid (the mean of its tokens) is one row
  exchange  counts, then one all-to-all of the centroids (C rows instead of R pairs)
  receiver  the experts run on the centroids, grouped by local expert
  exchange  the centroids' outputs back
  sender    each pair's output is its bucket's output plus the pair's residual
            ``x_t - c`` (LSH-MoE's residual-based error compensation: the first-order
            correction that adds back what the centroid averaged away), then the
            gate-weighted sum at home, as naive EP's

``bits = 0`` puts every pair in a bucket of its own (the centroid is the token, the
residual zero): naive EP, exact. ``bits = b`` allows up to 2^b buckets per expert and
rank. The compression is reported per call (``lsh_rows`` / ``lsh_pairs`` counters, and
``merged_pairs``: the pairs that did not need a row of their own).
Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R pairs, C centroids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep import Exchange, Recorder, SplitDispatcher, SystemConfig, all_to_all_rows, exchange_counts
from occult.ep.permute import (expert_major_order, gather_rows, inverse_permutation, scatter_add_rows,
                               sort_pairs_by_destination, weighted_scatter_add)
from occult.ep.capabilities import Capabilities

MAX_BITS = 16


@dataclass(frozen=True)
class LSHHandle:
    """What combine needs: each pair's token, weight, bucket, and the exchange's splits."""

    token_R: torch.Tensor          # home token of each pair (sort order)
    weight_R: torch.Tensor         # its gate weight
    bucket_R: torch.Tensor         # its bucket (centroid row)
    residual_RD: Optional[torch.Tensor]   # each pair's correction to its bucket's output (None: none)
    inv_perm_C: torch.Tensor       # expert-major received centroids -> (source, slot) order
    send_P: list
    recv_P: list
    num_tokens: int
    pairs: int
    layer: int
    recorder: Optional[Recorder]


def hyperplanes(hidden: int, bits: int, layer: int, seed: int, device, dtype) -> torch.Tensor:
    """The layer's random hyperplanes [D, bits], drawn on the host (the same on every rank)."""
    g = torch.Generator(device="cpu").manual_seed(seed * 7919 + layer)
    return torch.randn(hidden, bits, generator=g, device="cpu").to(device=device, dtype=dtype)


def hash_keys(x_RD: torch.Tensor, group_R: torch.Tensor, bits: int, planes_DB: torch.Tensor) -> torch.Tensor:
    """One key per pair: its group (destination device x local expert) and hash code, so
    that pairs with one key share a bucket (bits >= 1). [R] (long)."""
    sign_RB = (x_RD.detach() @ planes_DB) > 0
    code_R = (sign_RB.long() << torch.arange(bits, device=x_RD.device)).sum(1)
    return group_R * (1 << bits) + code_R


class LSHDispatcher(SplitDispatcher):
    """LSH-MoE's centroid exchange; ``bits``: hash bits per expert (0: every pair its own bucket)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=False, exact_backward=False,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=("its rows are bucket centroids, and how many a (rank, expert) sends depends on the hash "
                     "of the tokens' activations, not on the routing"),
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    counter = "lsh"        # the prefix of its counters (lsh_rows, lsh_pairs)

    @dataclass
    class Config(SystemConfig):
        bits: int = 4          # random hyperplanes per expert: up to 2^bits centroids per expert and rank
        seed: int = 0          # of the hyperplanes

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if not 0 <= self.bits <= MAX_BITS:
                raise ValueError(f"system.bits={self.bits!r}: allowed values are 0..{MAX_BITS} (0: every pair its "
                                 "own bucket, exact)")

        def is_exact(self) -> bool:
            return self.bits == 0

        def lossless_options(self) -> dict:
            return {"bits": 0}

    def bucket_keys(self, x_RD: torch.Tensor, group_R: torch.Tensor, layer: int) -> tuple[torch.Tensor, int]:
        """One key per pair, ``group * base + code`` (pairs with one key share a bucket),
        and ``base``: ``([R] long, int)``. Here the code is the pair's hash (bits = 0: the
        pair's own index, so that every pair is its own bucket)."""
        bits, R = self.config.bits, x_RD.shape[0]
        if bits == 0:
            return group_R * max(R, 1) + torch.arange(R, device=x_RD.device), max(R, 1)
        planes = hyperplanes(x_RD.shape[1], bits, layer, self.config.seed, x_RD.device, x_RD.dtype)
        return hash_keys(x_RD, group_R, bits, planes), 1 << bits

    def bucket_rows(self, x_RD: torch.Tensor, bucket_R: torch.Tensor, keys_C: torch.Tensor, base: int
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The row each bucket sends, and each pair's correction to its bucket's output
        (None: none): here the centroid, and the residual ``x - centroid``. ``([C, D], [R, D])``."""
        C = keys_C.numel()
        sizes_C = torch.bincount(bucket_R, minlength=C).to(x_RD.dtype)
        centroid_CD = scatter_add_rows(C, bucket_R, x_RD) / sizes_C.unsqueeze(1)
        return centroid_CD, x_RD - gather_rows(centroid_CD, bucket_R)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        K, e = topk_ids_TK.shape[1], self.placement.num_local
        order_R, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement)
        token_R = order_R // K
        x_RD = gather_rows(x_TD, token_R)
        ids_R = topk_ids_TK.flatten()[order_R]
        group_R = self.placement.device_E[ids_R] * e + self.placement.slot_E[ids_R]
        key_R, base = self.bucket_keys(x_RD, group_R, layer)
        # sorted keys: the buckets in (destination device, local expert) order, as the exchange wants
        keys_C, bucket_R = torch.unique(key_R, sorted=True, return_inverse=True)
        rows_CD, residual_RD = self.bucket_rows(x_RD, bucket_R, keys_C, base)
        P = self.placement.num_devices
        send_cPe = torch.bincount(keys_C // base, minlength=P * e).view(P, e)
        recv_cPe = exchange_counts(send_cPe, self.ep, Exchange(layer, "counts", recorder))
        # device-to-host sync: split sizes go to the collective as Python ints
        send_P, recv_P = send_cPe.sum(1).tolist(), recv_cPe.sum(1).tolist()
        got_CD = all_to_all_rows(rows_CD, send_P, recv_P, self.ep, Exchange(layer, "dispatch", recorder))
        perm_C = expert_major_order(recv_cPe)
        handle = LSHHandle(token_R, topk_weights_TK.flatten()[order_R], bucket_R, residual_RD,
                           inverse_permutation(perm_C), send_P, recv_P, x_TD.shape[0], token_R.numel(), layer,
                           recorder)
        return gather_rows(got_CD, perm_C), recv_cPe.sum(0), handle

    def combine(self, y_CD, handle: LSHHandle):
        back_CD = all_to_all_rows(gather_rows(y_CD, handle.inv_perm_C), handle.recv_P, handle.send_P, self.ep,
                                  Exchange(handle.layer, "combine", handle.recorder))
        pairs_RD = gather_rows(back_CD, handle.bucket_R)
        if handle.residual_RD is not None:
            pairs_RD = pairs_RD + handle.residual_RD
        return weighted_scatter_add(handle.num_tokens, handle.token_R, pairs_RD, handle.weight_R)

    def stats(self, handle: LSHHandle) -> dict:
        """Rows sent (centroids) against (token, expert) pairs of this rank; the pairs
        merged into another's centroid (which the experts do not run: the cost model's
        expert rows leave them out)."""
        rows = int(sum(handle.send_P))
        return {f"{self.counter}_rows": rows, f"{self.counter}_pairs": handle.pairs, "merged_pairs": handle.pairs - rows}
