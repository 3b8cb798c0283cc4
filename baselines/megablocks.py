"""system=megablocks: MegaBlocks' dropless expert parallelism (the harness's implementation).

MegaBlocks (``megablocks.layers.moe.MoE.parallel_forward_once`` and dMoE):

  sender    sort the (token, expert) pairs locally by expert (radix sort of
            the flattened top-k ids, stable, so tokens stay in order within
            an expert) and histogram them: tokens_per_expert, [P, e]
  exchange  **counts first**: an all-to-all of the [P, e] counts, then the
            host turns them into split sizes
  exchange  variable-split all-to-all of one row per (token, expert) pair;
            nothing is dropped and nothing is padded on the wire
  receiver  rows arrive grouped by source rank; a second local sort groups
            them by local expert, then a grouped GEMM (or, in dMoE's sparse
            path, a block-sparse matmul over rows padded to whole blocks)
  back      un-permute, all-to-all back, gate-weighted sum at home

That ordering is exactly the harness's naive EP (:mod:`baselines.naive`:
``sort_pairs_by_destination`` is the local sort by (device, slot), which is
MegaBlocks' sort by global expert id under the contiguous placement MegaBlocks
assumes; ``expert_major_order`` is the receiver's second sort), and the expert
compute is the shared grouped SwiGLU, so this class subclasses
:class:`NaiveDispatcher` instead of copying it. What it adds is MegaBlocks'
**block padding**: with ``block_size`` b > 0 every local expert's row group is
padded with zero rows to a multiple of b before the experts run (dMoE's
``round_up(tokens_per_expert, blocking)`` / ``padded_gather``, blocking 128 in
MegaBlocks), and the padding is cut away after them. The padding is computed,
never sent; the result stays exact (zero rows give zero outputs and zero weight
gradients). ``block_size = 0`` (the default) is the grouped-GEMM path with no
padding, whose dispatch and combine are naive EP's.

Library: this is the harness's own implementation (``impl = "harness"``); the
megablocks library is not driven by this harness. The megablocks package needs CUDA, and
its layers own their router, expert weights and all-to-all, which the
Dispatcher contract (shared experts, accounted collectives) leaves no room for.

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R received
rows grouped by local expert, B rows after block padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from baselines.naive import NaiveDispatcher, NaiveHandle
from occult.ep import SystemConfig
from occult.ep.permute import gather_rows, scatter_add_rows



@dataclass(frozen=True)
class MegaBlocksHandle:
    """Naive EP's handle, and where each real row sits in the block-padded rows."""

    naive: NaiveHandle
    padded_row_R: Optional[torch.Tensor]   # None: no block padding
    padding_rows: int                      # zero rows added before the experts (not sent)


def block_padded_rows(counts_e: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert, padded so each group is a multiple of ``block_size``.

    Returns ``padded_row_R`` (the new row of each of the R = sum(counts_e)
    rows) and ``padded_e`` (the padded group sizes), shape [e].
    """
    padded_e = (counts_e + block_size - 1) // block_size * block_size
    shift_e = (torch.cumsum(padded_e, 0) - padded_e) - (torch.cumsum(counts_e, 0) - counts_e)
    expert_R = torch.repeat_interleave(torch.arange(counts_e.numel(), device=counts_e.device), counts_e)
    return torch.arange(expert_R.numel(), device=counts_e.device) + shift_e[expert_R], padded_e


class MegaBlocksDispatcher(NaiveDispatcher):
    """MegaBlocks' dropless scheme: counts first, variable splits, rows grouped by
    local expert, optional block padding (``block_size``; 0 = grouped GEMM, none)."""

    impl = "harness"
    exact = True

    @dataclass
    class Config(SystemConfig):
        # > 0: pad each local expert's rows to a multiple (block-sparse path; MegaBlocks uses 128)
        block_size: int = 0

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if self.block_size < 0:
                raise ValueError(f"system.block_size={self.block_size!r}: must be an integer >= 0 "
                                 "(0: grouped GEMM without padding; MegaBlocks' block-sparse path uses 128)")

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        routed_RD, counts_e, naive = super().dispatch(x_TD, topk_ids_TK, topk_weights_TK, layer=layer,
                                                      recorder=recorder)
        if self.config.block_size == 0:
            return routed_RD, counts_e, MegaBlocksHandle(naive, None, 0)
        padded_row_R, padded_e = block_padded_rows(counts_e, self.config.block_size)
        B = int(padded_e.sum())
        padded_BD = scatter_add_rows(B, padded_row_R, routed_RD)
        return padded_BD, padded_e, MegaBlocksHandle(naive, padded_row_R, B - routed_RD.shape[0])

    def combine(self, y_BD, handle: MegaBlocksHandle):
        """``y_BD``: the experts' rows, block-padded when ``block_size`` > 0 (B = R otherwise)."""
        y_RD = y_BD if handle.padded_row_R is None else gather_rows(y_BD, handle.padded_row_R)
        return super().combine(y_RD, handle.naive)

    def stats(self, handle: MegaBlocksHandle) -> dict:
        """This rank's load figures of one call: never drops; zero rows added for block padding."""
        return {"dropped_pairs": 0, "padding_rows": handle.padding_rows}
