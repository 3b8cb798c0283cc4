"""system=allgather: all-gather the tokens, compute local experts, reduce-scatter the outputs.

The all-gather token dispatcher of Megatron-Core (``moe_token_dispatcher_type=allgather``),
the expert parallelism of Pipeline MoE and vLLM's default: no all-to-all at all.

  sender     ``counts``: every rank's token count (an all-gather of one integer);
             ``dispatch``: an all-gather of every rank's tokens; ``dispatch_meta``: an
             all-gather of every token's top-k ids and gate weights (float64 [T, 2K],
             exact for the ids, the weights differentiable)
  receiver   every rank picks, among all gathered tokens, the (token, expert) pairs of
             its own experts, runs them and weights each output by its gate weight; the
             partial outputs of all tokens ([sum T, D], zero where none of its experts
             was chosen) are summed per token
  exchange   ``combine``: a reduce-scatter of those partials, block j (rank j's tokens)
             summed over ranks on rank j

Traffic does not depend on K or on the routing: every rank receives every other rank's
tokens (a fraction (P - 1) / P of all tokens when ranks hold equal numbers) and sends a
partial output of every other rank's tokens back: (P - 1) T rows per rank and direction,
against naive EP's K (P - 1) / P T under uniform routing, so fewer bytes when K > P (top-8
on 4 devices) and more when K < P. Its collectives are ring-friendly all-gathers and
reduce-scatters of equal-sized blocks (when ranks hold equal numbers of tokens) and need
no per-expert counts. Backward: the all-gather's backward is a reduce-scatter and vice versa.

Exact top-k MoE: every (token, expert) pair is computed once, on the expert's device,
and weighted there once.

Shapes: T tokens on this rank, A tokens of all ranks, K top-k, D hidden, e local experts,
Q (token, local expert) pairs on this rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from occult.ep import Exchange, Recorder, SplitDispatcher, SystemConfig
from occult.ep.comm import ALL_GATHER, REDUCE_SCATTER, all_gather_rows, reduce_scatter_rows
from occult.ep.permute import gather_rows, weighted_scatter_add
from occult.ep.plan import metadata_sends, returned, sends
from occult.ep.capabilities import Capabilities

# the token counts' dtype, and the routing's beside the tokens (gate weights and top-k ids:
# exact for the ids, differentiable for the weights)
COUNT_DTYPE, META_DTYPE = torch.long, torch.float64


@dataclass(frozen=True)
class AllGatherHandle:
    token_Q: torch.Tensor     # gathered token of each local pair, grouped by local expert
    weight_Q: torch.Tensor    # its gate weight
    tokens_P: list            # every rank's token count
    layer: int
    recorder: Optional[Recorder]


def token_counts(num_tokens: int, ep, where: Exchange, device) -> list:
    """Every rank's token count, in rank order (an all-gather of one integer per rank)."""
    mine_11 = torch.tensor([[num_tokens]], dtype=COUNT_DTYPE, device=device)
    # device-to-host sync: the counts size the collectives below
    return all_gather_rows(mine_11, [1] * ep.world_size, ep, replace(where, metadata=True)).flatten().tolist()


def local_pairs(ids_AK: torch.Tensor, placement, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, k) pairs among ``ids_AK`` whose expert lives on ``rank``, grouped by local
    slot: ``(token_Q, k_Q, counts_e)``."""
    mine_AK = placement.device_E[ids_AK] == rank
    token_Q, k_Q = torch.nonzero(mine_AK, as_tuple=True)
    slot_Q = placement.slot_E[ids_AK[token_Q, k_Q]]
    order_Q = torch.argsort(slot_Q, stable=True)
    counts_e = torch.bincount(slot_Q, minlength=placement.num_local)
    return token_Q[order_Q], k_Q[order_Q], counts_e


class AllGatherDispatcher(SplitDispatcher):
    """All-gather / reduce-scatter expert parallelism (no options)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(SystemConfig):
        pass

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        rec, ep, K = recorder, self.ep, topk_ids_TK.shape[1]
        tokens_P = token_counts(x_TD.shape[0], ep, Exchange(layer, "counts", rec), x_TD.device)
        x_AD = all_gather_rows(x_TD, tokens_P, ep, Exchange(layer, "dispatch", rec))
        meta_TX = torch.cat([topk_weights_TK.to(META_DTYPE), topk_ids_TK.to(META_DTYPE)], dim=1)
        meta_AX = all_gather_rows(meta_TX, tokens_P, ep, Exchange(layer, "dispatch_meta", rec, metadata=True))
        ids_AK = meta_AX[:, K:].detach().round().long()
        token_Q, k_Q, counts_e = local_pairs(ids_AK, self.placement, ep.rank)
        weight_Q = meta_AX[token_Q, k_Q].to(x_TD.dtype)
        handle = AllGatherHandle(token_Q, weight_Q, tokens_P, layer, rec)
        return gather_rows(x_AD, token_Q), counts_e, handle

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``counts`` (an all-gather of one integer), ``dispatch`` and ``dispatch_meta`` (this
        rank's T tokens and their 2K routing values to every rank) and ``combine`` (the
        reduce-scatter that returns the dispatch: rank j's block to rank j)."""
        P, (T, K) = self.ep.world_size, topk_ids_TK.shape
        x_bytes, meta_bytes = shape.bytes_of(shape.hidden), 2 * K * META_DTYPE.itemsize
        return [metadata_sends("counts", rank, [1] * P, COUNT_DTYPE.itemsize, kind=ALL_GATHER),
                sends("dispatch", rank, [T] * P, x_bytes, kind=ALL_GATHER),
                sends("dispatch_meta", rank, [T] * P, meta_bytes, kind=ALL_GATHER, meta_row_bytes=meta_bytes),
                returned("combine", 2, x_bytes, kind=REDUCE_SCATTER)]

    def combine(self, y_QD, handle: AllGatherHandle):
        partial_AD = weighted_scatter_add(sum(handle.tokens_P), handle.token_Q, y_QD, handle.weight_Q)
        return reduce_scatter_rows(partial_AD, handle.tokens_P, self.ep,
                                   Exchange(handle.layer, "combine", handle.recorder))
