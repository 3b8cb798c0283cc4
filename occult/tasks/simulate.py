"""task=simulate: the traffic of a world that is not here, every rank's plan in one process.

    python run.py task=simulate model=olmoe_proxy cluster.world_size=64 cluster.devices_per_node=8 system=occult

The world is ``cluster.world_size`` ranks grouped ``cluster.devices_per_node`` to a node; it is
never started. For each MoE layer of the model, the world's tokens (``task.tokens_per_rank``
on every rank) are routed by the routing source, the system's routing transform is applied as
the layer applies it (:func:`occult.ep.layer.transformed_routing`), and the system's traffic
plan of every rank is added up (:func:`occult.ep.plan.plan_world`, on this process's
device). Each simulated rank's collectives are then written by the writer of a real run
(:func:`occult.tasks.common.comm_rows`), so the rows are the ones a run of that world would
write: ``tests/test_plans.py`` holds the plans equal to the rows real runs log.

The routing sources (``task.routing``: ``router``, ``trace``, ``uniform``, ``zipf``) and the
sharing of a source's tokens over the world: :mod:`occult.tasks.world`.

Rows (``clock=simulated``; the only times are the planner's own): per simulated rank, what
:func:`occult.tasks.common.comm_rows` writes for a real rank (``rows``, ``bytes`` and
``meta_bytes`` per peer pair unless ``task.peer_rows=false``, ``<kind>_calls``), and per rank,
phase and pass ``received_rows`` (rows that arrive, itself included), ``intra_node_bytes`` and
``inter_node_bytes`` (bytes sent to other ranks of its node, and to other nodes); C_T, the
intra-collaboration ratio and tokens per rank and over all ranks, ``rows_per_token``; per layer
``planning_time`` (ms, the world's plan), ``planning_peak_memory`` (bytes: the process's peak
during it on a CPU, the device allocator's on CUDA) and ``planning_added_memory`` (that peak
less the memory in use when planning began). Not simulated: the dispatchers' counters
(dropped pairs, padding rows) and every time.

Shapes: N source tokens, W = T P world tokens, T tokens of a rank, K top-k, E experts, P ranks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ep import Recorder, system_config
from ..ep.accounting import token_devices
from ..ep.comm import EPGroup
from ..ep.layer import transformed_routing
from ..ep.measure import stopwatch
from ..ep.plan import RowShape, WorldCollective, plan_world, rank_events
from ..memory import peak_memory
from ..records import row
from ..spec import RunSpec
from .common import comm_rows, rows_per_token_row, token_rows_of
from .world import one_thread, rank_routing, task_layers, world_source
from .schema import WithBackward
from .world import RoutedWorld


@dataclass
class Config(RoutedWorld, WithBackward):
    """task=simulate: the traffic of a world that is not here (``cluster.world_size`` ranks,
    ``cluster.devices_per_node`` a node), every rank's plan in one process
    (:mod:`occult.tasks.simulate`), on the routing of :class:`RoutedWorld`. ``backward``:
    plan the backward's collectives too; ``peer_rows``: a row per peer pair (false:
    per-rank totals only)."""

    peer_rows: bool = True

    entry: ClassVar[str] = "occult.tasks.simulate.run"
    plans_system: ClassVar[bool] = True


# ---------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------


# per rank, phase and pass: what node_rows writes (name, unit)
NODE_METRICS = (("received_rows", "rows"), ("intra_node_bytes", "bytes"), ("inter_node_bytes", "bytes"),
                ("received_intra_node_bytes", "bytes"), ("received_inter_node_bytes", "bytes"),
                ("messages", "messages"), ("inter_node_messages", "messages"))


def node_rows(world: list, world_size: int, devices_per_node: int, layer: int, prefix: str = "") -> list:
    """Per rank, phase and pass (:data:`NODE_METRICS`): rows it receives (its own included),
    bytes it sends to and receives from the other ranks of its node and the other nodes,
    and the messages it sends (peers other than itself with a non-empty block), in all and
    across nodes: what the cost model prices a collective by when the world's peer pairs
    are too many to write (``task.peer_rows=false``); and per phase and pass (rank -1) the
    bytes of one of its rows (``row_bytes``, metadata included). ``prefix``: before every
    metric's name (``valid_``: a static buffer's valid rows, :func:`valid_world`)."""
    P = world_size
    node_P = torch.arange(P, device="cpu") // (devices_per_node or P)
    same_PP = node_P.unsqueeze(1) == node_P.unsqueeze(0)
    intra_PP = same_PP & ~torch.eye(P, dtype=torch.bool, device="cpu")
    totals: dict = {}
    for c in world:
        rows_PP = c.rows_PP.cpu()
        bytes_PP = rows_PP * c.row_bytes
        sent_PP = rows_PP > 0
        key = (c.phase, c.direction)
        got = (rows_PP.sum(0), (bytes_PP * intra_PP).sum(1), (bytes_PP * ~same_PP).sum(1),
               (bytes_PP * intra_PP).sum(0), (bytes_PP * ~same_PP).sum(0),
               (sent_PP & (intra_PP | ~same_PP)).sum(1), (sent_PP & ~same_PP).sum(1))
        totals[key] = got if key not in totals else tuple(a + b for a, b in zip(totals[key], got))
    out = []
    for (phase, direction), values in totals.items():
        for (name, unit), v_P in zip(NODE_METRICS, values):
            out += [row(prefix + name, v, unit, layer=layer, rank=r, phase=phase, direction=direction)
                    for r, v in enumerate(v_P.tolist())]
    sizes = {(c.phase, c.direction): c.row_bytes for c in world}
    out += [row(prefix + "row_bytes", b, "bytes", layer=layer, rank=-1, phase=phase, direction=direction)
            for (phase, direction), b in sizes.items()]
    return out


def dynamic_twin(config):
    """A static-buffer system's config in the dynamic mode (the same system sending only its
    valid rows, split sizes exchanged); None for a system without fixed buffers."""
    return dataclasses.replace(config, dispatch_mode="dynamic") if config.is_static() else None


def valid_world(world: list, twin_world: list) -> list:
    """A static system's world collectives carrying only their valid rows: each fixed-buffer
    collective (``dispatch``, ``combine``) with the rows its dynamic twin's same phase puts
    on every pair (a fixed buffer's valid rows are the rows the dynamic mode sends:
    ``tests/test_published.py`` holds them equal to the static path's own marks), at the
    static row's bytes. What a one-sided transport writes into the padded receive buffer."""
    twin = {(c.phase, c.direction): c for c in twin_world}
    return [WorldCollective(c.phase, c.kind, c.direction, twin[(c.phase, c.direction)].rows_PP, c.row_bytes,
                            c.meta_row_bytes) for c in world if (c.phase, c.direction) in twin]


def layer_rows(cfg, world: list, routing: list, placement, layer: int) -> list:
    """A simulated layer's rows (see the module docstring), from its world traffic and every
    rank's routing (after the transform)."""
    t, c = cfg.task, cfg.cluster
    P = c.world_size
    out = []
    for rank in range(P):
        rec = Recorder(rank=rank)
        rec.comm = rank_events(world, rank, layer)
        out += comm_rows(rec, per_peer=t.peer_rows)
    out += node_rows(world, P, c.devices_per_node, layer)
    ids = [ids_TK.cpu() for ids_TK, _ in routing]
    home = [torch.full((x.shape[0],), r, dtype=torch.long, device="cpu") for r, x in enumerate(ids)]
    stats = token_devices(torch.cat(ids), placement.to("cpu"), torch.cat(home))     # once, sliced per rank
    start = 0
    for rank in range(P):
        out += token_rows_of(stats.rows(start, start + ids[rank].shape[0]), layer, rank)
        start += ids[rank].shape[0]
    out += token_rows_of(stats, layer, -1)
    out += node_ct_rows(ids, placement.to("cpu"), home, c.devices_per_node or P, layer)
    tokens = sum(x.shape[0] for x in ids)
    for w in world:
        if w.phase in ("dispatch", "combine"):
            out += rows_per_token_row(int(w.rows_PP.sum()), tokens, layer, w.phase, w.direction)
    return out


def node_ct_rows(ids: list, placement, home: list, devices_per_node: int, layer: int) -> list:
    """Per rank (and -1: all ranks) ``ct_nodes``: the mean number of distinct nodes a token's
    experts lie on, its own node included (C_T over nodes: the (token, node) pairs of a
    node-deduplicated exchange, per token). ``ids[r]``: rank r's [T, K] expert ids."""
    out, total, count = [], 0.0, 0
    for rank, (ids_TK, home_T) in enumerate(zip(ids, home)):
        dev_TK = torch.where(ids_TK >= 0, placement.pair_devices(ids_TK, home_T), -1)
        node_TK = torch.where(dev_TK >= 0, dev_TK // devices_per_node, -1).sort(dim=1).values
        n_T = (node_TK[:, :1] >= 0).long().sum(1) + ((node_TK[:, 1:] != node_TK[:, :-1]) & (node_TK[:, 1:] >= 0)).sum(1)
        total, count = total + float(n_T.sum()), count + n_T.numel()
        out.append(row("ct_nodes", float(n_T.float().mean()) if n_T.numel() else float("nan"), "nodes/token",
                       layer=layer, rank=rank))
    out.append(row("ct_nodes", total / count if count else float("nan"), "nodes/token", layer=layer, rank=-1))
    return out


def run(ctx, spec: RunSpec) -> list:
    """The whole simulated world on this one process, at one intra-op thread; returns its rows."""
    with one_thread():
        return _simulate(ctx, spec)


def _simulate(ctx, spec: RunSpec) -> list:
    """:func:`run`'s work: every MoE layer's routing, world plan and rows."""
    m, t, c = spec.model, spec.task, spec.cluster
    ep = EPGroup(0, c.world_size, None, str(ctx.device), c.devices_per_node)    # never started: nothing is sent
    shape = RowShape(m.hidden_size, m.expert_ffn_size, getattr(torch, m.dtype))
    source = world_source(spec)
    rows = []
    if source is not None:
        rows += [row("source_size", source.tokens, "tokens"),
                 row("resampled_tokens", float(source.resampled), "bool")]
    for layer in task_layers(m, t.sample_layers):
        T = t.rank_tokens(c.world_size)
        dispatcher = system_config(spec.system).sized(T).build(ep, layer, m.num_experts)
        need_probs = dispatcher.routing_transform(layer) is not None
        routing = []
        for rank in range(c.world_size):
            ids_TK, w_TK, probs_TE = rank_routing(spec, source, layer, rank, ctx.device, need_probs=need_probs)
            routing.append(transformed_routing(dispatcher, layer, probs_TE, ids_TK, w_TK))
        with peak_memory(ctx.device) as mem, stopwatch() as sw:
            world = plan_world(dispatcher, routing, shape, training=t.backward, backward=t.backward)
        rows += [row("planning_time", sw.seconds * 1e3, "ms", layer=layer, phase="plan"),
                 row("planning_peak_memory", mem.peak, "bytes", layer=layer, phase="plan"),
                 row("planning_added_memory", max(mem.peak - mem.start, 0) if mem.peak >= 0 else -1, "bytes",
                     layer=layer, phase="plan")]
        rows += layer_rows(spec, world, routing, dispatcher.placement, layer)
        twin = dynamic_twin(system_config(spec.system).sized(T))
        if twin is not None:
            twin_world = plan_world(twin.build(ep, layer, m.num_experts), routing, shape, training=t.backward,
                                    backward=t.backward)
            rows += node_rows(valid_world(world, twin_world), c.world_size, c.devices_per_node, layer, "valid_")
    return rows
