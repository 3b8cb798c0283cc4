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

Library: with ``library`` = ``auto`` (the default) the system runs the megablocks
library itself (``impl = "library"``) where it can: when megablocks imports (it needs
CUDA: ``make gpu-megablocks``, opt-in) and the run has one rank (EP=1). The library's
``dMoE`` experts (``ParallelDroplessMLP``, grouped GLU with SiLU) then run on the
harness's routing (its ``experts(x, scores, expert_weights, top_experts)`` entry, as
``dMoE.forward`` calls it after its own router) with the harness's expert weights
(views, so gradients reach them): w1 = W_gate^T, v1 = W_up^T, w2 = W_down per expert.
Elsewhere (a CPU, or EP > 1, whose all-to-all the library would run unaccounted) it is
the harness's implementation above (``impl = "harness"``); ``library: on`` insists on
the library (refused where it cannot run), ``off`` never uses it. The library path
has not been run on this project's CPU machines; ``make gpu-check`` runs it against
the single-device reference on a GPU.

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R received
rows grouped by local expert, B rows after block padding.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from baselines.naive import NaiveDispatcher, NaiveHandle
from occult.ep.permute import gather_rows, scatter_add_rows
from occult.ep.capabilities import Capabilities
from occult.ep.payload import PAYLOADS
from occult.ep.replica_rules import REPLICA_POLICIES



@dataclass(frozen=True)
class MegaBlocksHandle:
    """Naive EP's handle, and where each real row sits in the block-padded rows."""

    naive: NaiveHandle
    padded_row_R: Optional[torch.Tensor]   # None: no block padding
    padding_rows: int                      # zero rows added before the experts (not sent)
    routed_pairs: int                      # (token, expert) pairs the routing asked for (dropped ids left out)


def block_padded_rows(counts_e: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert, padded so each group is a multiple of ``block_size``.

    Returns ``padded_row_R`` (the new row of each of the R = sum(counts_e)
    rows) and ``padded_e`` (the padded group sizes), shape [e].
    """
    padded_e = (counts_e + block_size - 1) // block_size * block_size
    shift_e = (torch.cumsum(padded_e, 0) - padded_e) - (torch.cumsum(counts_e, 0) - counts_e)
    expert_R = torch.repeat_interleave(torch.arange(counts_e.numel(), device=counts_e.device), counts_e)
    return torch.arange(expert_R.numel(), device=counts_e.device) + shift_e[expert_R], padded_e


LIBRARY_CHOICES = ("auto", "on", "off")


def library_available() -> bool:
    """Whether the megablocks library can run here: it imports only with CUDA, and its
    grouped GLU (``mlp_impl="grouped"``, the dropless experts used here) needs the
    ``grouped_gemm`` package (both in the ``gpu`` extra)."""
    if importlib.util.find_spec("megablocks") is None or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("grouped_gemm") is None:
        return False
    try:
        import megablocks.layers.dmoe  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - a broken or CUDA-less install
        return False


def make_library_experts(num_experts: int, top_k: int, experts, x_TD: torch.Tensor):
    """The megablocks ``ParallelDroplessMLP`` (grouped GLU, SiLU, no bias, EP=1) on the
    device and in the dtype of ``x_TD``; its own weights are replaced per call by views of
    the harness's experts (:func:`library_experts`)."""
    import torch.nn.functional as nnf
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import ParallelDroplessMLP

    D, F = experts.w_gate.shape[1], experts.w_gate.shape[2]
    args = Arguments(hidden_size=D, ffn_hidden_size=F, moe_num_experts=num_experts, moe_top_k=top_k,
                     mlp_type="glu", mlp_impl="grouped", activation_fn=nnf.silu, bias=False, return_bias=False,
                     moe_loss_weight=0.0, fp16=x_TD.dtype == torch.float16, bf16=x_TD.dtype == torch.bfloat16,
                     device=x_TD.device)
    module = ParallelDroplessMLP(args)
    for name in ("w1", "v1", "w2"):       # the harness's weights stand in for the library's
        delattr(module.mlp, name)
    return module


def library_experts(module, x_TD, topk_ids_TK, topk_weights_TK, experts) -> torch.Tensor:
    """megablocks' dropless experts on the harness's routing and expert weights: [T, D] -> [T, D]
    (gate weights applied inside, as every system does)."""
    E, F, D = experts.w_gate.shape[0], experts.w_gate.shape[2], experts.w_gate.shape[1]
    module.mlp.w1 = experts.w_gate.transpose(1, 2).reshape(E * F, D)      # [E*F, D]: W_gate^T per expert
    module.mlp.v1 = experts.w_up.transpose(1, 2).reshape(E * F, D)        # W_up^T
    module.mlp.w2 = experts.w_down.reshape(E * F, D)                      # W_down [F, D] per expert
    scores = None                                                         # only its load-balancing loss reads it
    out = module(x_TD.unsqueeze(1), scores, topk_weights_TK.to(x_TD.dtype), topk_ids_TK)
    return out.view_as(x_TD)


class MegaBlocksDispatcher(NaiveDispatcher):
    """MegaBlocks' dropless scheme: counts first, variable splits, rows grouped by
    local expert, optional block padding (``block_size``; 0 = grouped GEMM, none)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="MegaBlocks' block-padded grouped compute is sized by counts read on the host",
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=REPLICA_POLICIES, payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(NaiveDispatcher.Config):
        # > 0: pad each local expert's rows to a multiple (block-sparse path; MegaBlocks uses 128)
        block_size: int = 0
        # the megablocks library: auto (where it imports and EP=1) | on | off (the harness scheme)
        library: str = "auto"

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if self.block_size < 0:
                raise ValueError(f"system.block_size={self.block_size!r}: must be an integer >= 0 "
                                 "(0: grouped GEMM without padding; MegaBlocks' block-sparse path uses 128)")
            if self.library not in LIBRARY_CHOICES:
                raise ValueError(f"system.library={self.library!r}: allowed values are {list(LIBRARY_CHOICES)}")
            if self.library == "on" and not library_available():
                raise ValueError("system.library=on: the megablocks library does not run here (it needs CUDA "
                                 "and make gpu-megablocks: megablocks and grouped_gemm); use library=auto or off")
            if self.library == "on" and world_size > 1:
                raise ValueError(f"system.library=on runs the megablocks library at EP=1 only (cluster.world_size="
                                 f"{world_size}: its all-to-all would not be accounted); use library=auto or off")
            if self.compressed() and self.library == "on":
                raise ValueError("system.payload: the megablocks library sends no rows (EP=1); a compressed "
                                 "payload needs the harness scheme (system.library=off)")
            if self.library != "off" and self.block_size and self.uses_library(world_size):
                raise ValueError("system.block_size applies to the harness scheme; the megablocks library pads "
                                 "its own blocks (set system.library=off to pad)")

        def uses_library(self, world_size: int) -> bool:
            """Whether a run of ``world_size`` ranks runs the megablocks library (never with a
            compressed payload: the library sends no rows to compress)."""
            if self.library == "off" or self.compressed():
                return False
            return library_available() and world_size == 1

        def impl_for(self, world_size: int) -> str:
            return "library" if self.uses_library(world_size) else "harness"

    def __init__(self, ep, placement, config):
        super().__init__(ep, placement, config)
        self._dmoe = None          # the library's experts module, made on first use (library path)

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        if not self.config.uses_library(self.ep.world_size):
            return super().forward_moe(x_TD, topk_ids_TK, topk_weights_TK, experts, layer=layer, recorder=recorder)
        from occult.ep.accounting import span
        with span(recorder, layer, "moe"):
            return library_experts(self._library_module(x_TD, topk_ids_TK.shape[1], experts), x_TD, topk_ids_TK,
                                   topk_weights_TK, experts)

    def _library_module(self, x_TD, top_k: int, experts):
        """megablocks' dropless experts for this layer's shape (made once per dispatcher)."""
        if self._dmoe is None:
            self._dmoe = make_library_experts(self.placement.num_experts, top_k, experts, x_TD)
        return self._dmoe

    def plan(self, topk_ids_TK, topk_weights_TK, **kwargs):
        """Naive EP's exchange (the block padding is computed, never sent); none where the
        library runs the layer (EP=1)."""
        if self.config.uses_library(self.ep.world_size):
            return []
        return super().plan(topk_ids_TK, topk_weights_TK, **kwargs)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        routed_RD, counts_e, naive = super().dispatch(x_TD, topk_ids_TK, topk_weights_TK, layer=layer,
                                                      recorder=recorder)
        # device-to-host: the pair count for the dropped-pairs counter (the split sizes already synced)
        routed = int((topk_ids_TK >= 0).sum())
        if self.config.block_size == 0:
            return routed_RD, counts_e, MegaBlocksHandle(naive, None, 0, routed)
        padded_row_R, padded_e = block_padded_rows(counts_e, self.config.block_size)
        B = int(padded_e.sum())
        padded_BD = scatter_add_rows(B, padded_row_R, routed_RD)
        return padded_BD, padded_e, MegaBlocksHandle(naive, padded_row_R, B - routed_RD.shape[0], routed)

    def combine(self, y_BD, handle: MegaBlocksHandle):
        """``y_BD``: the experts' rows, block-padded when ``block_size`` > 0 (B = R otherwise)."""
        y_RD = y_BD if handle.padded_row_R is None else gather_rows(y_BD, handle.padded_row_R)
        return super().combine(y_RD, handle.naive)

    def stats(self, handle: MegaBlocksHandle) -> dict:
        """This rank's load figures of one call: the pairs the routing asked for that no row
        carried (dropless: 0, counted from the splits that were sent, not assumed), and the
        zero rows added for block padding."""
        return {"dropped_pairs": handle.routed_pairs - sum(handle.naive.send_P), "padding_rows": handle.padding_rows}
