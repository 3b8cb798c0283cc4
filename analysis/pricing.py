"""Pricing on a machine's links: what one collective and one experts step cost.

The cost model's arithmetic, on a :class:`occult.ep.links.Link` (one world size of a
projection profile); :mod:`analysis.projection` applies it to measured runs.

One collective, P ranks:

    time = latency + max over ranks r of max(t_intra(r), t_inter(r))     (sum: links in series)
    t_intra(r) = max(sent_intra(r), received_intra(r)) / (NVLink bandwidth x efficiency)
                 + intra-node messages(r) x per-message cost within a node
    t_inter(r) = max(sent_inter(r), received_inter(r)) / (per-device NIC share x efficiency)
                 + inter-node messages(r) x per-message cost across nodes

where bytes a rank keeps for itself are free, ``latency`` is the inter-node latency
when any byte crosses nodes (else the intra-node one), and a device's NIC share is
``inter_node_GBps * nics_per_node / devices_per_node``. A message is a peer the rank sends
a non-empty block to (``task=simulate``'s ``messages`` and ``inter_node_messages``; from
the peer pairs when a run wrote them); the profile's per-message costs are 0 unless it
states them, and its ``overlap_links=false`` adds a rank's NVLink and NIC times instead of
taking their max (a kernel that does not overlap them). Several calls of one collective
(decode steps) pay the latency per call; their bytes are summed (the max over ranks of a
sum: a lower bound on the sum of the per-call maxima), their messages counted per call.
Broadcasts and reduces cross the slowest link they need once per root (:func:`rooted_seconds`).

Experts (SwiGLU, three D x F matmuls): ``6 D F`` FLOPs per (token, expert) row forward,
twice that backward; time = the busiest rank's FLOPs over the device's achieved
throughput, or its weight and row traffic over the memory bandwidth when that is longer.

Shapes: P ranks.
"""
from __future__ import annotations

import numpy as np

from occult.ep.links import Link


def node_of(world_size: int, devices_per_node: int) -> np.ndarray:
    """Node index of each rank: [P]."""
    per = devices_per_node or world_size
    return np.arange(world_size) // per


def a2a_seconds(bytes_PP: np.ndarray, link: Link, calls: int = 1, collectives: int = 0) -> float:
    """Projected time of ``calls`` all-to-alls whose summed bytes are ``bytes_PP[src, dst]``.
    ``collectives``: how many collectives those bytes came from (0: ``calls``); each sends a
    message to every peer with bytes (an upper bound when they do not all reach the same peers)."""
    bytes_PP = np.asarray(bytes_PP, dtype=float)
    P = bytes_PP.shape[0]
    if P <= 1:
        return 0.0
    node = node_of(P, link.devices_per_node)
    remote = ~np.eye(P, dtype=bool)
    same = (node[:, None] == node[None, :]) & remote
    cross = node[:, None] != node[None, :]
    sent, n = bytes_PP > 0, collectives or calls
    messages = n * ((sent & same).sum(1) + (sent & cross).sum(1))
    return a2a_seconds_of_totals((bytes_PP * same).sum(1), (bytes_PP * same).sum(0), (bytes_PP * cross).sum(1),
                                 (bytes_PP * cross).sum(0), link, calls, multi_node=bool(cross.any()),
                                 messages_P=messages, inter_messages_P=n * (sent & cross).sum(1))


def a2a_seconds_of_totals(sent_intra_P, received_intra_P, sent_inter_P, received_inter_P, link: Link,
                          calls: int = 1, multi_node: bool = True, messages_P=None, inter_messages_P=None) -> float:
    """:func:`a2a_seconds` from each rank's bytes sent to and received from the other ranks of
    its node and the other nodes ([P] each): the same price, for worlds whose peer pairs are
    not written (a simulated world of 256 ranks: ``task.peer_rows=false``). ``multi_node``:
    the world has more than one node (the call pays the inter-node latency). ``messages_P``,
    ``inter_messages_P``: the peers each rank sends a non-empty block to, in all and across
    nodes ([P] each; None: no message is priced)."""
    intra = np.maximum(np.asarray(sent_intra_P, dtype=float), np.asarray(received_intra_P, dtype=float))
    inter = np.maximum(np.asarray(sent_inter_P, dtype=float), np.asarray(received_inter_P, dtype=float))
    if intra.size <= 1:
        return 0.0
    t_intra, t_inter = intra / link.intra_Bps, inter / link.inter_Bps if inter.any() else np.zeros_like(inter)
    if messages_P is not None:
        inter_msgs = np.asarray(inter_messages_P if inter_messages_P is not None else 0.0, dtype=float)
        t_intra = t_intra + (np.asarray(messages_P, dtype=float) - inter_msgs) * link.intra_message_s
        t_inter = t_inter + inter_msgs * link.inter_message_s
    t_rank = np.maximum(t_intra, t_inter) if link.overlap else t_intra + t_inter
    latency = link.inter_latency_s if multi_node and link.inter_latency_s else link.intra_latency_s
    return calls * latency + float(t_rank.max())


def rooted_seconds(bytes_PP: np.ndarray, link: Link, calls: int = 1, kind: str = "broadcast") -> float:
    """Projected time of ``calls`` broadcasts (or reduces, ``kind="reduce"``) whose summed
    logical bytes are ``bytes_PP[src, dst]``: each root's payload crosses the slowest link
    it needs once (a pipelined tree or ring moves a broadcast's bytes once per link, not
    once per peer), one root after another, plus the latency of every call."""
    bytes_PP = np.asarray(bytes_PP, dtype=float)
    P = bytes_PP.shape[0]
    if P <= 1:
        return 0.0
    remote = bytes_PP * ~np.eye(P, dtype=bool)
    payload = remote.max(1) if kind == "broadcast" else remote.max(0)     # per root
    multi_node = link.devices_per_node and link.devices_per_node < P
    bandwidth = link.slowest_Bps if multi_node else link.intra_Bps
    latency = link.inter_latency_s if multi_node and link.inter_latency_s else link.intra_latency_s
    return calls * latency + float(payload.sum()) / bandwidth


ROOTED = ("broadcast", "reduce")


def collective_seconds(bytes_PP: np.ndarray, link: Link, calls: int, kind: str, collectives: int = 0) -> float:
    """A collective of any kind: rooted ones (broadcast, reduce) by :func:`rooted_seconds`,
    the others (all-to-all, all-gather, reduce-scatter: every rank sends its blocks to its
    peers) by :func:`a2a_seconds` on their per-peer bytes (``collectives``: see there)."""
    if kind in ROOTED:
        return rooted_seconds(bytes_PP, link, calls, kind)
    return a2a_seconds(bytes_PP, link, calls, collectives)


def swiglu_flops(rows: float, hidden: int, ffn: int, backward: bool = False) -> float:
    """FLOPs of SwiGLU experts on ``rows`` (token, expert) rows: 6 D F each forward, x2 backward."""
    return (12.0 if backward else 6.0) * rows * hidden * ffn


def expert_seconds(rows_P, hidden: int, ffn: int, link: Link, backward: bool = False,
                   local_experts: int = 0, element_bytes: int = 2, calls: int = 1) -> float:
    """Projected expert time: the busiest rank's FLOPs over the device's achieved throughput
    or, when the profile gives a memory bandwidth, the bytes its experts read and write
    over it if that takes longer (a roofline: few rows per expert are memory-bound); plus
    the profile's per-expert overhead for each of the ``local_experts`` (x2 backward).
    ``calls``: layer calls the rows came in (decode steps); each call reads the weights of
    at most min(local experts, rows per call) experts (an upper bound: every expert that
    could have been hit is read)."""
    rows_P = np.asarray(rows_P, dtype=float)
    rows = float(rows_P.max()) if rows_P.size else 0.0
    passes = 2 if backward else 1
    compute_s = swiglu_flops(rows, hidden, ffn, backward) / link.flops
    active = min(float(local_experts), rows / max(calls, 1))
    moved = passes * (calls * active * 3 * hidden * ffn + rows * (2 * hidden + 3 * ffn)) * element_bytes
    return max(compute_s, moved / link.memory_Bps) + passes * local_experts * link.expert_call_s
