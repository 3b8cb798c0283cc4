"""ScMoE's shortcut-connected MoE (arXiv 2404.05019; LongCat-Flash uses the design).

In a shortcut-connected model the routed experts of MoE block l take the representation
of the preceding MoE block (its post-attention, normalised hidden states: what block l-1's
experts and shared expert read), while block l's shared expert processes block l's own:

    out_l = shared_l(r_l) + routed_l(r_{l-1})        (the first MoE block: routed_0(r_0))

so block l's dispatch depends on nothing computed in block l and can start one block
early, overlapping block l-1's remaining work and block l's attention and shared expert
(the overlapped schedule: a system whose dispatcher can ``start`` a dispatch, e.g.
``system=scmoe``; any other system runs the same model step by step).

The model is the family's transformers model (Qwen2-MoE's classes: routed experts plus
one gated shared expert) whose MoE blocks are wrapped, in place, by :class:`ShortcutMLP`;
``moe_blocks`` sees the wrapped blocks, so checkpoints, the expert-parallel conversion and
pre-training work on it as on any model. Each forward carries r_{l-1} (and a started
dispatch) from block to block in a :class:`Shortcut` of its own, opened by the first MoE
block and held in a context variable, not on the model: co-executed micro-batches
(:mod:`occult.ep.strands`, one thread and context each) run the same blocks at once, and
each strand's blocks read its own forward's representation.

Shapes: B batch, S sequence, T = B * S tokens, D hidden.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

import torch
import torch.nn.functional as nnf
from torch import nn

from .ep_block import EPMoEBlock


class Shortcut:
    """What passes from one MoE block to the next within one forward: the previous block's
    representation (r_{l-1}, [B, S, D]) and, under the overlapped schedule, the dispatch of
    the next block already started on it (an object of the next block's ``start``).
    ``chain``: the model whose blocks it links (what a block checks it is reading)."""

    def __init__(self, chain: object):
        self.chain = chain
        self.previous: Optional[torch.Tensor] = None
        self.started = None


# the running forward's Shortcut in this context (each strand's thread runs in a context of its own)
_CARRIED: ContextVar[Optional[Shortcut]] = ContextVar("occult_shortcut", default=None)


class ShortcutMLP(nn.Module):
    """The MLP slot of a decoder layer whose MoE block ``moe`` is shortcut-connected:
    routed experts on the previous MoE block's representation, shared expert on this
    one's. ``chain``: an object naming the model's chain of blocks (shared by its blocks;
    it holds no state); ``first``: the model's first MoE block (routed on its own
    representation; it opens the forward's :class:`Shortcut`); ``next_mlp``: the next
    block's ShortcutMLP (None for the last), whose dispatch this block starts early when
    its system can."""

    def __init__(self, moe: nn.Module, chain: object, first: bool):
        super().__init__()
        self.moe = moe
        self.first = first
        self._chain = chain
        self._next: list = []          # a list, so that the next block is not a submodule of this one

    def forward(self, r_BSD: torch.Tensor) -> torch.Tensor:
        carrier = self._carrier()
        routed_in = r_BSD if self.first else carrier.previous
        started = None if self.first else carrier.started      # the first block: nothing started for it
        nxt = self._next[0].moe if self._next else None
        carrier.previous, carrier.started = (r_BSD if nxt is not None else None), None
        if nxt is None:
            _CARRIED.set(None)                                 # the last block lets go of the forward's tensors
        if started is None and self.first and isinstance(self.moe, EPMoEBlock):
            started = self.moe.start(routed_in)                # nothing before the first block to hide it behind
        if nxt is not None and isinstance(nxt, EPMoEBlock):
            carrier.started = nxt.start(r_BSD)                 # block l+1's routed input is this block's r_l (or None)
        shared = shared_output(self.moe, r_BSD)
        routed = self.moe.finish(started) if started is not None else routed_output(self.moe, routed_in)
        return routed + shared

    def _carrier(self) -> Shortcut:
        """This forward's Shortcut: a new one for the first block, else the one the previous
        block left in this context (an error when it is another model's, or none)."""
        if self.first:
            carrier = Shortcut(self._chain)
            _CARRIED.set(carrier)
            return carrier
        carrier = _CARRIED.get()
        if carrier is None or carrier.chain is not self._chain or carrier.previous is None:
            raise RuntimeError("a shortcut-connected MoE block ran without the previous MoE block of its model "
                               "in the same forward (thread and context)")
        return carrier


def routed_output(moe: nn.Module, x_BSD: torch.Tensor) -> torch.Tensor:
    """The routed experts of ``moe`` (the transformers block, or the expert-parallel block)
    on ``x``, without the shared expert. [B, S, D]."""
    if isinstance(moe, EPMoEBlock):
        return moe.routed(x_BSD)
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    _, weights_TK, ids_TK = moe.gate(x_TD)
    return moe.experts(x_TD, ids_TK, weights_TK).reshape(x_BSD.shape)


def shared_output(moe: nn.Module, x_BSD: torch.Tensor) -> torch.Tensor:
    """The gated shared expert of ``moe`` on ``x``: sigmoid(g(x)) * shared(x). [B, S, D]."""
    return nnf.sigmoid(moe.shared_expert_gate(x_BSD)) * moe.shared_expert(x_BSD)


def connect_shortcuts(model: nn.Module, is_moe_block) -> nn.Module:
    """Wraps every MoE block of ``model`` (``is_moe_block(module)``) in a :class:`ShortcutMLP`
    of one chain (in place; the weights keep their names but for the ``.moe`` in their path)."""
    chain = object()
    wrapped = []
    for layer in model.model.layers:
        if is_moe_block(layer.mlp):
            layer.mlp = ShortcutMLP(layer.mlp, chain, first=not wrapped)
            wrapped.append(layer.mlp)
    for mlp, nxt in zip(wrapped, wrapped[1:]):
        mlp._next.append(nxt)
    return model


def shortcut_error(num_layers: int, first_k_dense: int) -> str:
    """Why a shortcut-connected model of this depth cannot be built ("" when it can): the
    shortcut feeds a block from the one before it, so it needs two MoE blocks."""
    moe = num_layers - first_k_dense
    if moe < 2:
        return (f"model.num_layers={num_layers}: a shortcut-connected model (family scmoe) feeds each MoE block "
                f"from the MoE block before it; with {moe} MoE layer(s) there is none to feed (allowed: "
                f"num_layers >= first_k_dense + 2)")
    return ""
