"""One plan per system: the split sizes of every collective of an MoE layer, for any world.

A system's **plan** (:meth:`occult.ep.dispatcher.Dispatcher.plan`) is the metadata half of
its layer: from the top-k ids and gate weights of one rank's tokens, the placement and the
node layout (the dispatcher's ``placement`` and ``ep``), it says, for each collective the
layer runs in its forward pass, how many rows go from which rank to which. Its dispatch
sizes its collectives with the same functions at run time; the simulator
(:func:`plan_world`) calls the plan for every rank of a world that is not here (expert
parallelism 32 to 256 on one process) and adds the ranks' plans up. The rows a simulated
rank logs (:func:`rank_events`) then go through the same writer as a real run's
(:func:`occult.tasks.common.comm_rows`); ``tests/test_plans.py`` holds them equal to the
rows real runs log, per peer pair, forward and backward.

A plan is the list of the collectives every rank runs, in the same order on every rank
(:class:`Planned`): each says its phase, its kind, the bytes of one row, whether it runs
again (transposed) in the backward, and either

* ``traffic``: the rows this rank's tokens put on pairs of ranks, a block ``rows_SP`` for
  the source ranks ``src_S`` (most collectives: this rank's own sends, S = 1; a staged
  exchange in which a rank forwards other ranks' rows puts rows on those ranks' sends), or
* ``back``: k > 0, this collective sends back the world traffic of the collective k places
  before it in the plan, transposed (a combine returns what its dispatch received).

World traffic is the sum of the ranks' blocks: the rows of one collective are additive over
the tokens that cause them (a deduplicated row belongs to one token). What a rank needs to
know of the others before it can plan (Tutel's capacity, FasterMoE's popular experts) is
its *facts* (:meth:`Dispatcher.plan_facts`), a vector each rank sends to every peer at run
time; the simulator stacks every rank's into ``facts_PX`` and hands the plan the same.

The backward runs every differentiable collective again with its traffic transposed, as
:mod:`occult.ep.comm` does (:data:`occult.ep.comm.BACKWARD_KIND`: an all-to-all's backward
is an all-to-all, an all-gather's a reduce-scatter, a broadcast's a reduce, and back).

Shapes: P ranks, S source ranks of a block, T tokens of a rank, K top-k, X facts per rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .accounting import CommEvent
from .comm import ALL_TO_ALL, BACKWARD_KIND


@dataclass(frozen=True)
class RowShape:
    """What the rows of a layer's collectives are made of: ``hidden`` values (D) of ``dtype``
    (the layer's activations and weights), and the experts' FFN width F (weight rows of
    the systems that move experts: 3 D F values)."""

    hidden: int
    ffn: int
    dtype: torch.dtype

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype, device="meta").element_size()

    def bytes_of(self, values: int) -> int:
        """Bytes of a row of ``values`` elements of this dtype."""
        return values * self.element_bytes

    @staticmethod
    def of(x_TD: torch.Tensor, ffn: int = 0) -> "RowShape":
        return RowShape(x_TD.shape[1], ffn, x_TD.dtype)


@dataclass(frozen=True)
class Planned:
    """One collective of a layer's forward pass, as every rank of the world runs it once.

    ``traffic``: ``(src_S, rows_SP)``, rows that this rank's tokens put on (``src_S[s]``, j);
    ``back``: instead (k > 0), this one returns the world traffic of the collective k places
    before it, transposed. ``meta_row_bytes``: of ``row_bytes``, the metadata riding with each
    row (:class:`occult.ep.comm.Exchange`); ``differentiable``: it runs again, transposed, in
    the backward (its rows carry activations, gate weights or expert weights)."""

    phase: str
    kind: str
    row_bytes: int
    meta_row_bytes: int = 0
    differentiable: bool = True
    traffic: Optional[tuple] = None
    back: int = 0

    def key(self) -> tuple:
        """What every rank's plan agrees on for this collective."""
        return self.phase, self.kind, self.row_bytes, self.meta_row_bytes, self.differentiable, self.back


def sends(phase: str, rank: int, rows_P, row_bytes: int, *, kind: str = ALL_TO_ALL, meta_row_bytes: int = 0,
          differentiable: bool = True) -> Planned:
    """A collective in which this rank sends ``rows_P[j]`` rows to rank j (a tensor, or a
    list: host integers)."""
    device = rows_P.device if torch.is_tensor(rows_P) else "cpu"
    rows_1P = torch.as_tensor(rows_P, dtype=torch.long, device=device).reshape(1, -1)
    src_1 = torch.tensor([rank], dtype=torch.long, device=rows_1P.device)
    return Planned(phase, kind, row_bytes, meta_row_bytes, differentiable, (src_1, rows_1P))


def metadata_sends(phase: str, rank: int, rows_P, row_bytes: int, kind: str = ALL_TO_ALL) -> Planned:
    """A collective of metadata only (counts, routing ids): every byte is metadata
    (``Exchange.metadata``), nothing flows back in the backward."""
    return sends(phase, rank, rows_P, row_bytes, kind=kind, meta_row_bytes=row_bytes, differentiable=False)


def forwarded(phase: str, src_S: torch.Tensor, rows_SP: torch.Tensor, row_bytes: int, *,
              meta_row_bytes: int = 0, differentiable: bool = True, kind: str = ALL_TO_ALL) -> Planned:
    """A collective in which rank ``src_S[s]`` sends ``rows_SP[s, j]`` rows of this rank's
    tokens to rank j (rows it received from this rank, or computed from them, and sends on)."""
    return Planned(phase, kind, row_bytes, meta_row_bytes, differentiable, (src_S, rows_SP))


def returned(phase: str, back: int, row_bytes: int, *, kind: str = ALL_TO_ALL, meta_row_bytes: int = 0,
             differentiable: bool = True) -> Planned:
    """A collective that returns the world traffic of the collective ``back`` places before it
    in the plan, transposed."""
    if back < 1:
        raise ValueError(f"returned({phase!r}): back={back} must name an earlier collective (>= 1)")
    return Planned(phase, kind, row_bytes, meta_row_bytes, differentiable, None, back)


@dataclass(frozen=True)
class WorldCollective:
    """One collective of a world: the rows every rank sends every rank, ``rows_PP[src, dst]``."""

    phase: str
    kind: str
    direction: str
    rows_PP: torch.Tensor
    row_bytes: int
    meta_row_bytes: int


def world_traffic(plans: Sequence[Sequence[Planned]], world_size: int, backward: bool = True,
                  device="cpu") -> list[WorldCollective]:
    """Every rank's plan (``plans[r]``: rank r's) added up on ``device``: the world's
    collectives, forward then (``backward``) the backward's, each the transpose of a
    differentiable forward one."""
    if len(plans) != world_size:
        raise ValueError(f"world_traffic: {len(plans)} plans for a world of {world_size} ranks")
    keys = [p.key() for p in plans[0]]
    for rank, plan in enumerate(plans):
        if [p.key() for p in plan] != keys:
            raise ValueError(f"world_traffic: rank {rank}'s plan lists other collectives than rank 0's "
                             f"({[p.key() for p in plan]} != {keys}); every rank runs the same collectives")
    P = world_size
    forward: list[WorldCollective] = []
    for i, first in enumerate(plans[0]):
        if first.back:
            if first.back > i:
                raise ValueError(f"world_traffic: collective {i} ({first.phase}) returns the one {first.back} "
                                 "places before it, which is not in the plan")
            rows_PP = forward[i - first.back].rows_PP.t().contiguous()
        else:
            rows_PP = torch.zeros(P, P, dtype=torch.long, device=device)
            for plan in plans:
                src_S, rows_SP = plan[i].traffic
                rows_PP.index_add_(0, src_S.to(device), rows_SP.to(device=device, dtype=torch.long))
        forward.append(WorldCollective(first.phase, first.kind, "forward", rows_PP, first.row_bytes,
                                       first.meta_row_bytes))
    out = list(forward)
    if backward:
        out += [WorldCollective(c.phase, BACKWARD_KIND[c.kind], "backward", c.rows_PP.t().contiguous(),
                                c.row_bytes, c.meta_row_bytes)
                for c, p in zip(forward, plans[0]) if p.differentiable]
    return out


def rank_events(world: Sequence[WorldCollective], rank: int, layer: int) -> list[CommEvent]:
    """What rank ``rank`` logs of a simulated layer: one event per collective it runs, its row
    of each collective's traffic (no times: ``seconds`` is NaN)."""
    return [CommEvent(layer, c.phase, c.direction, rank, tuple(c.rows_PP[rank].tolist()), c.row_bytes,
                      float("nan"), meta_row_bytes=c.meta_row_bytes, collective=c.kind) for c in world]


def plan_world(dispatcher, routing: Sequence[tuple], shape: RowShape, *, training: bool = True,
               backward: bool = True) -> list[WorldCollective]:
    """The world traffic of one MoE layer: ``dispatcher.plan`` for every rank r of its world on
    ``routing[r] = (topk_ids_TK, topk_weights_TK)`` (after the system's routing transform),
    with every rank's facts first (what each sends every peer before it plans)."""
    P = dispatcher.ep.world_size
    if len(routing) != P:
        raise ValueError(f"plan_world: routing for {len(routing)} ranks, the world has {P}")
    facts = [dispatcher.plan_facts(ids_TK, w_TK) for ids_TK, w_TK in routing]
    facts_PX = None if facts[0] is None else torch.stack(facts)
    plans = [dispatcher.plan(ids_TK, w_TK, rank=r, shape=shape, facts_PX=facts_PX, training=training)
             for r, (ids_TK, w_TK) in enumerate(routing)]
    return world_traffic(plans, P, backward, dispatcher.ep.device)


def traffic_of(events: Sequence[CommEvent]) -> dict:
    """A rank's logged collectives reduced to what a plan states: ``(layer, phase, direction,
    kind) -> (calls, rows per peer, bytes per peer, metadata bytes per peer)`` (the key of
    the equality of simulated and measured rows)."""
    out: dict = {}
    for ev in events:
        key = (ev.layer, ev.phase, ev.direction, ev.collective)
        calls, rows, nbytes, meta = out.get(key, (0, [0] * len(ev.rows_P), [0] * len(ev.rows_P),
                                                  [0] * len(ev.rows_P)))
        out[key] = (calls + 1, [a + r for a, r in zip(rows, ev.rows_P)],
                    [a + r * ev.row_bytes for a, r in zip(nbytes, ev.rows_P)],
                    [a + r * ev.meta_row_bytes for a, r in zip(meta, ev.rows_P)])
    return out
