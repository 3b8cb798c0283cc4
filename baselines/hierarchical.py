"""system=hierarchical: a two-stage exchange, between nodes then within them.

HetuMoE's hierarchical all-to-all and DeepEP's internode layout: ranks are grouped into
nodes of G ranks (``cluster.devices_per_node``; rank ``n G + g`` is local rank g of node n).
A rank talks across nodes only to its *rail peers*, the ranks with its own local index in
the other nodes, so every node pair is joined by G messages (one per rail) instead of
G x G, each carrying everything one rank sends to that node:

  dispatch  ``dispatch_inter``: each unit goes to the rail peer in its destination node
            (rank ``m G + g`` for node m); ``dispatch_intra``: that peer forwards it inside
            its node to the devices that hold the unit's experts; the experts run there
  combine   each expert output is weighted by its gate weight on the expert's device and
            summed there per received row; ``combine_intra`` returns the rows to the rail
            peer, which sums the rows of one unit; ``combine_inter`` returns them home,
            where each token's rows are summed

``dedup`` decides what a unit is (what each stage sends once):

* ``none``: one row per (token, expert) on both stages (HetuMoE's hierarchical all-to-all:
  the same rows as naive EP, in fewer, larger inter-node messages);
* ``node``: one row per (token, destination node) across nodes, then one per (token,
  expert) inside the destination node; the rail peer sums the expert outputs of a token
  before it returns one row home;
* ``device``: one row per (token, node) across nodes and one per (token, device) inside
  the node (DeepEP's internode dispatch: over RDMA once per node, then forwarded over
  NVLink to each GPU that needs it); the experts' outputs of a token are summed on each
  device and on the rail peer.

Beside each row travels its metadata (``*_meta``: the gate weights and top-k ids of the
row's experts in the destination, others masked, float64 [R, 2K]: exact for the ids,
differentiable for the weights), and each stage is preceded by its counts exchange
(``counts_inter`` with the rail peers, ``counts_intra`` within the node). A stage that cannot move anything is not run: with
one node there is no inter-node stage, with one rank per node no intra-node one.

Inter-node bytes and messages are what this scheme trades for: fewer, larger messages
between nodes (and with dedup, fewer bytes there) at the price of a second hop inside
the node and a second latency per direction. On one node (``devices_per_node`` 0 or P)
it is naive EP (``none``) or an Occult-like per-device exchange (``device``).

Exact top-k MoE: every (token, expert) pair is computed once, weighted once, and the
partial sums are regroupings of the same terms.

``kernels``, the experts step on the final stage's rows: ``torch``: each local expert reads
its rows through the pair index and adds its gate-weighted outputs straight into the rows
(:func:`occult.ep.merged.merged_swiglu`, the step Occult's ``kernels=torch`` runs), so neither
the [Q, D] gather nor the experts' [Q, D] outputs exist; ``epd``: the pairs are gathered, the
grouped experts run on them and combine sums them with their gate weights; ``auto`` (the
default): torch on a CPU once the pairs [Q, D] would exceed
:data:`occult.ep.merged.FUSE_FROM_BYTES`, else epd (always epd on a GPU).

The plan (:meth:`HierarchicalDispatcher.plan`) splits the first stage of a rank's tokens
with the dispatch's function, and the second from the (unit, slot) pairs the first stage's
rows carry, each on the rank that receives it: what that rank's dispatch splits of the units
it gets (:func:`split_pairs`, which :func:`split_units` runs on them).

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, U units a stage starts
from (its rows), S rows a stage sends, V (unit, slot) pairs a stage carries, Q (row, local
expert) pairs on the expert's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.columns import column, later
from occult.ep import Exchange, Recorder, SplitDispatcher, SystemConfig, all_to_all_rows, exchange_counts
from occult.ep.merged import GatheredRows, epd_exceeds, merged_swiglu
from occult.ep.permute import gather_rows, scatter_add_rows, weighted_scatter_add
from occult.ep.plan import forwarded, metadata_sends, returned, sends
from occult.ep.capabilities import Capabilities

DEDUP = ("none", "node", "device")
# the experts step on the final stage's pairs: merged into the rows (torch) or on the gathered
# pairs (epd); auto takes torch on a CPU once the pairs [Q, D] exceed FUSE_FROM_BYTES
KERNELS = ("auto", "torch", "epd")
# the dtype of the rows' metadata (gate weights and top-k ids): exact for the ids
META_DTYPE = torch.float64


@dataclass(frozen=True)
class Units:
    """Rows at one stage: hidden states and, per row, the gate weights (float64) and top-k ids
    of the experts it carries (-1: not carried by this row)."""

    x_UD: torch.Tensor
    w_UK: torch.Tensor
    ids_UK: torch.Tensor


@dataclass(frozen=True)
class Split:
    """What one stage sends (:func:`split_pairs`): the unit each row comes from, its
    destination and the rows per destination; and the (unit, expert slot) pairs it was made
    of, with the row that carries each (``row_V``, ``slot_V``, ``id_V``: the pair's expert)."""

    unit_S: torch.Tensor
    dest_S: torch.Tensor
    send: torch.Tensor     # [P]: rows to each rank; [P, P] with holders: from each holder to each rank
    row_V: torch.Tensor
    slot_V: torch.Tensor
    id_V: torch.Tensor
    top_k: int

    def keep_SK(self) -> torch.Tensor:
        """The expert slots each row carries (bool [S, K])."""
        keep_SK = torch.zeros(self.unit_S.numel(), self.top_k, dtype=torch.bool, device=self.unit_S.device)
        keep_SK[self.row_V, self.slot_V] = True
        return keep_SK


@dataclass(frozen=True)
class Leg:
    """One stage of the exchange: the unit each sent row came from, and its splits."""

    unit_S: torch.Tensor
    send_P: list
    recv_P: list
    num_units: int         # rows the stage started from (where combine sums back into)
    name: str              # "inter" or "intra"


@dataclass(frozen=True)
class HierarchicalHandle:
    legs: tuple            # the stages that ran, in dispatch order
    row_Q: torch.Tensor    # final-stage row of each expert pair (grouped by local expert)
    weight_Q: torch.Tensor
    num_rows: int          # final-stage rows on the expert's device
    layer: int
    recorder: Optional[Recorder]
    merged: bool           # the experts step summed each row's weighted outputs (merged_swiglu)


def split_units(ids_UK: torch.Tensor, dest_UK: torch.Tensor, per_pair: bool, world_size: int,
                holder_U: Optional[torch.Tensor] = None) -> Split:
    """The rows one stage sends of units ``ids_UK`` (-1: a slot the unit does not carry) whose
    pairs go to ``dest_UK``: :func:`split_pairs` of their carried pairs."""
    u_V, k_V = torch.nonzero(ids_UK >= 0, as_tuple=True)
    return split_pairs(u_V, k_V, ids_UK[u_V, k_V], dest_UK[u_V, k_V], ids_UK.shape, per_pair, world_size, holder_U)


def split_pairs(u_V: torch.Tensor, k_V: torch.Tensor, id_V: torch.Tensor, d_V: torch.Tensor, shape_UK: tuple,
                per_pair: bool, world_size: int, holder_U: Optional[torch.Tensor] = None) -> Split:
    """The rows one stage sends: one per (unit, expert) (``per_pair``) or one per (unit,
    destination), ordered by destination (:class:`Split`), from the stage's (unit, slot)
    pairs (``u_V``, ``k_V``; expert ``id_V``, destination ``d_V``) of units [U, K]
    (``shape_UK``). ``holder_U`` (the plan of units that sit on several ranks): the rank each
    unit is on; ``send`` is then [P, P], the rows each holder sends to each rank, not [P]."""
    U, K = shape_UK
    span = U * K if per_pair else U
    key_V = d_V * span + (u_V * K + k_V if per_pair else u_V)
    keys_S, s_V = torch.unique(key_V, sorted=True, return_inverse=True)
    unit_S = (keys_S % span) // K if per_pair else keys_S % span
    dest_S = keys_S // max(span, 1)
    P = world_size
    if holder_U is None:
        send = torch.bincount(dest_S, minlength=P)
    else:
        send = torch.bincount(holder_U[unit_S] * P + dest_S, minlength=P * P).view(P, P)
    return Split(unit_S, dest_S, send, s_V, k_V, id_V, K)


def carried_ids(ids_UK: torch.Tensor, unit_S: torch.Tensor, keep_SK: torch.Tensor) -> torch.Tensor:
    """The top-k ids each sent row carries (-1 in the slots it does not): the units of the
    next stage."""
    return ids_UK[unit_S].masked_fill_(~keep_SK, -1)


class HierarchicalDispatcher(SplitDispatcher):
    """``dedup``: ``none`` | ``node`` | ``device`` (what each stage sends once) and ``kernels``:
    ``auto`` | ``torch`` | ``epd`` (the experts step), see the module docstring; the node
    layout comes from the group (``cluster.devices_per_node``)."""

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
        dedup: str = column("device", absent="")    # none | node | device; a column of every row
        # auto | torch | epd; later: configs at auto hash as before the option existed
        kernels: str = later("auto")

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if self.dedup not in DEDUP:
                raise ValueError(f"system.dedup={self.dedup!r}: allowed values are {list(DEDUP)}")
            if self.kernels not in KERNELS:
                raise ValueError(f"system.kernels={self.kernels!r}: allowed values are {list(KERNELS)}")

        def other_exact_paths(self) -> list:
            # the path this config does not take on the parity suite's small problems
            # (auto takes epd there)
            return super().other_exact_paths() + [{"kernels": "epd" if self.kernels == "torch" else "torch"}]

    def _destinations(self, ids_UK: torch.Tensor, stage: str, holder) -> torch.Tensor:
        """Each (unit, expert)'s destination rank at ``stage``: the rail peer in the expert's
        node of ``holder``, the rank the unit is on (``inter``), or the expert's device
        (``intra``); -1 where no expert is carried. ``holder``: a rank, or a tensor of ranks
        of ``ids_UK``'s shape (any shape: units [U, K] or pairs [V])."""
        ep, pl = self.ep, self.placement
        device_UK = pl.device_E[ids_UK.clamp(min=0)]
        if stage == "inter":
            device_UK = device_UK // ep.per_node * ep.per_node + holder % ep.per_node
        return device_UK.masked_fill_(ids_UK < 0, -1)

    def _per_pair(self, stage: str) -> bool:
        """Whether ``stage`` sends a row per (unit, expert) rather than per (unit, destination)."""
        return self.config.dedup == "none" or (stage == "intra" and self.config.dedup == "node")

    def _split(self, ids_UK: torch.Tensor, stage: str, rank: int) -> Split:
        """What ``stage`` sends of the units ``ids_UK`` on rank ``rank``: the dispatch's split
        sizes, and the plan's of a rank's own tokens."""
        return split_units(ids_UK, self._destinations(ids_UK, stage, rank), self._per_pair(stage),
                           self.ep.world_size)

    def _forwarded(self, sent: Split, stage: str) -> Split:
        """What ``stage`` sends of the rows an earlier stage sent (``sent``), each on the rank
        that received it: the same split of the same pairs as the receivers' :meth:`_split`
        of the units they got, with each row's receiver as its holder (the plan's)."""
        holder_V = sent.dest_S[sent.row_V]
        d_V = self._destinations(sent.id_V, stage, holder_V)
        return split_pairs(sent.row_V, sent.slot_V, sent.id_V, d_V, (sent.unit_S.numel(), sent.top_k),
                           self._per_pair(stage), self.ep.world_size, sent.dest_S)

    def _peers(self, stage: str, rank: int) -> list:
        """The ranks ``rank`` talks to at ``stage``: its rail peers (``inter``) or its node."""
        G = self.ep.per_node
        same = (lambda j: j % G == rank % G) if stage == "inter" else (lambda j: j // G == rank // G)
        return [same(j) for j in range(self.ep.world_size)]

    def _stage(self, units: Units, stage: str, layer: int, rec) -> tuple[Units, Leg]:
        """Sends ``units`` one stage on (``inter`` or ``intra``); returns the received units."""
        K = units.ids_UK.shape[1]
        split = self._split(units.ids_UK, stage, self.ep.rank)
        unit_S, keep_SK = split.unit_S, split.keep_SK()
        recv_P = exchange_counts(split.send.view(-1, 1), self.ep, Exchange(layer, f"counts_{stage}", rec),
                                 self._peers(stage, self.ep.rank))
        # device-to-host sync: split sizes go to the collectives as Python ints
        send, recv = split.send.tolist(), recv_P.flatten().tolist()
        ids_SK = carried_ids(units.ids_UK, unit_S, keep_SK)
        meta_SX = torch.cat([units.w_UK[unit_S] * keep_SK, ids_SK.to(META_DTYPE)], dim=1)
        x_RD = all_to_all_rows(gather_rows(units.x_UD, unit_S), send, recv, self.ep,
                               Exchange(layer, f"dispatch_{stage}", rec))
        meta_RX = all_to_all_rows(meta_SX, send, recv, self.ep,
                                  Exchange(layer, f"dispatch_{stage}_meta", rec, metadata=True))
        got = Units(x_RD, meta_RX[:, :K], meta_RX[:, K:].detach().round().long())
        return got, Leg(unit_S, send, recv, units.x_UD.shape[0], stage)

    def _stages(self) -> list:
        """The stages that can move anything in this node layout."""
        ep = self.ep
        return [s for s, useful in (("inter", ep.num_nodes > 1), ("intra", ep.per_node > 1)) if useful]

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        units = Units(x_TD, topk_weights_TK.to(torch.float64), topk_ids_TK)
        legs = []
        for stage in self._stages():
            units, leg = self._stage(units, stage, layer, recorder)
            legs.append(leg)
        pl = self.placement
        row_Q, k_Q = torch.nonzero(units.ids_UK >= 0, as_tuple=True)
        slot_Q = pl.slot_E[units.ids_UK[row_Q, k_Q]]
        order_Q = torch.argsort(slot_Q, stable=True)
        row_Q, k_Q = row_Q[order_Q], k_Q[order_Q]
        counts_e = torch.bincount(slot_Q, minlength=pl.num_local)
        weight_Q = units.w_UK[row_Q, k_Q].to(x_TD.dtype)
        merged = self._merges(units.x_UD, row_Q.numel())
        handle = HierarchicalHandle(tuple(legs), row_Q, weight_Q, units.x_UD.shape[0], layer, recorder, merged)
        routed = GatheredRows(units.x_UD, row_Q) if merged else gather_rows(units.x_UD, row_Q)
        return routed, counts_e, handle

    def _merges(self, x_UD: torch.Tensor, pairs: int) -> bool:
        """Whether this call's experts step merges into the rows (``kernels``; ``auto``: on a
        CPU, when the ``pairs`` gathered rows [Q, D] would exceed ``FUSE_FROM_BYTES``)."""
        if self.config.kernels != "auto":
            return self.config.kernels == "torch"
        return x_UD.device.type == "cpu" and epd_exceeds(pairs, x_UD)

    def run_experts(self, experts, routed, counts_e, handle: HierarchicalHandle):
        """The experts on the final stage's pairs: [Q, D] outputs, or (``handle.merged``) the
        rows' gate-weighted sums [U, D] (:func:`occult.ep.merged.merged_swiglu`)."""
        if handle.merged:
            return merged_swiglu(experts, routed, counts_e, handle.weight_Q)
        return experts(routed, counts_e)

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """Each stage's ``counts_*`` (one int64 per peer of the stage), ``dispatch_*`` and
        ``dispatch_*_meta`` (2K values of float64 per row), then the ``combine_*`` stages in
        reverse order, each its dispatch returned. The first stage's units are this rank's
        tokens; the second's are the rows the first sent, on the ranks that received them
        (the units a rail peer forwards), split by the same function as at run time."""
        K = topk_ids_TK.shape[1]
        x_bytes, meta_bytes = shape.bytes_of(shape.hidden), 2 * K * META_DTYPE.itemsize
        out, at, split = [], [], None
        for stage in self._stages():
            if split is None:                # this rank's tokens
                split = self._split(topk_ids_TK, stage, rank)
                rows = [sends(f"dispatch_{stage}", rank, split.send, x_bytes),
                        sends(f"dispatch_{stage}_meta", rank, split.send, meta_bytes, meta_row_bytes=meta_bytes)]
            else:                            # the rows the first stage sent, sent on by their receivers
                src_S = torch.unique(split.dest_S)          # the receivers that forward
                split = self._forwarded(split, stage)
                rows = [forwarded(f"dispatch_{stage}", src_S, split.send[src_S], x_bytes),
                        forwarded(f"dispatch_{stage}_meta", src_S, split.send[src_S], meta_bytes,
                                  meta_row_bytes=meta_bytes)]
            out.append(metadata_sends(f"counts_{stage}", rank, [int(p) for p in self._peers(stage, rank)],
                                      split.send.element_size()))
            at.append((stage, len(out)))
            out += rows
        for stage, i in reversed(at):
            out.append(returned(f"combine_{stage}", len(out) - i, x_bytes))
        return out

    def combine(self, y_QD, handle: HierarchicalHandle):
        rec, layer = handle.recorder, handle.layer
        y_UD = y_QD if handle.merged else weighted_scatter_add(handle.num_rows, handle.row_Q, y_QD, handle.weight_Q)
        for leg in reversed(handle.legs):
            back_SD = all_to_all_rows(y_UD, leg.recv_P, leg.send_P, self.ep, Exchange(layer, f"combine_{leg.name}", rec))
            y_UD = scatter_add_rows(leg.num_units, leg.unit_S, back_SD)
        return y_UD
