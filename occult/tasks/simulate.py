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

Routing sources (``task.routing``):

* ``router``: the model's own routers (a proxy's trained checkpoint, pre-trained first when
  missing, or ``model.path``) on ``task.source_tokens`` tokens of random windows of held-out
  text (``task.corpus`` / ``task.split``, ``task.seq_len`` long): the gates' top-k ids and
  weights, what the model's MoE blocks would run with (one process, no expert parallelism);
* ``trace``: a run's routing trace (``task.trace``: a run folder holding ``routing.parquet``,
  with ``router_logits.npz`` when the run wrote one), every rank's tokens in rank order;
* ``uniform``, ``zipf``: synthetic, per layer and rank from the seed: K distinct experts by
  Gumbel top-k from the popularity (:func:`occult.synthetic.sample_router`), the Gumbel keys
  serving as router logits, so that the gate weights (:func:`occult.ep.router.gate_weights`)
  and a routing transform see router scores whose top-k are the ids.

A source holds N tokens; rank r takes tokens ``[r T, (r + 1) T)`` of the first T P. When the
world needs more than the source holds (T P > N), the world's T P tokens are drawn from the N
with replacement (seeded, the same tokens in every layer), and the rows say so:
``resampled_tokens`` is 1 (0 otherwise), ``source_tokens`` is N.

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
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from ..ep import Recorder, system_config
from ..ep.accounting import token_devices
from ..ep.comm import EPGroup
from ..ep.layer import transformed_routing
from ..ep.measure import stopwatch
from ..ep.plan import RowShape, WorldCollective, plan_world, rank_events
from ..ep.router import gate_weights
from ..errors import ConfigError
from ..memory import peak_memory
from ..records import row
from ..routing_traces import ROUTING_FILE, load_trace, trace_layers
from ..synthetic import expert_popularity, gumbel_keys, sample_router
from .common import comm_rows, rows_per_token_row, token_rows_of


def moe_layers(m) -> list:
    """The MoE layers of model config ``m``: its layers after the first ``first_k_dense``."""
    return list(range(m.first_k_dense, m.num_layers))


def task_layers(cfg) -> list:
    """The MoE layers the task computes: every MoE layer of the model (``task.sample_layers``
    0 or at least their number), else that many evenly spaced (1: the middle layer; 2: the
    first and the last; 3: first, middle, last)."""
    layers, n = moe_layers(cfg.model), int(cfg.task.get("sample_layers") or 0)
    if n == 0 or n >= len(layers):
        return layers
    if n == 1:
        return [layers[len(layers) // 2]]
    step = (len(layers) - 1) / (n - 1)
    return sorted({layers[int(i * step + 0.5)] for i in range(n)})         # halves round up, as n = 1 does


def rank_tokens(cfg) -> int:
    """Tokens of every simulated rank: ``task.total_tokens / P`` (strong scaling) or
    ``task.tokens_per_rank``."""
    t = cfg.task
    return t.total_tokens // cfg.cluster.world_size if t.get("total_tokens") else t.tokens_per_rank


# ---------------------------------------------------------------------------
# checking the source (at validation) and preparing it (in the launching process)
# ---------------------------------------------------------------------------


def check_source(task, cfg) -> None:
    """The routing source fits the run: a model with routers for ``router``; for ``trace``, a
    trace of this model's layers, K and E (and router logits where the system's routing
    transform reads router probabilities). One line each (:class:`ConfigError`)."""
    m = cfg.model
    check_world(task, cfg)
    refusal = system_config(cfg.system).plan_refusal() if task.name == "simulate" else None
    if refusal:
        raise ConfigError(f"system={cfg.system.name} has no traffic plan: {refusal}; systems with one: "
                          f"{planned_systems()}")
    if task.routing == "router" and not m.family and not task.routers:
        raise ConfigError(f"task.routing=router routes held-out text through the model's routers; model={m.name} "
                          "is a layer-only config (no model.family): use task.routing=uniform, zipf or trace")
    if task.routing != "trace":
        return
    folder = Path(task.trace)
    if not (folder / ROUTING_FILE).is_file():
        raise ConfigError(f"task.trace={task.trace!r} holds no {ROUTING_FILE} (a run with task.save_routing=true "
                          "writes one)")
    df, logits = load_trace(folder)
    E, K, layers = m.num_experts, m.top_k, moe_layers(m)
    if int(df.expert.max()) >= E or int(df.expert.min()) < -1:
        raise ConfigError(f"task.trace={task.trace!r} routes to expert ids {int(df.expert.min())}.."
                          f"{int(df.expert.max())}; model={m.name} has model.num_experts={E} (ids 0..{E - 1})")
    if int(df.slot.max()) + 1 != K:
        raise ConfigError(f"task.trace={task.trace!r} has top-{int(df.slot.max()) + 1} routing; model={m.name} has "
                          f"model.top_k={K}")
    found = sorted(int(x) for x in df.layer.unique())
    if found != layers:
        raise ConfigError(f"task.trace={task.trace!r} has {len(found)} MoE layer(s) {found}; model={m.name} has "
                          f"{len(layers)}: {layers}")
    if task.name == "simulate" and not logits and _transform_of(cfg, layers[0]) is not None:
        raise ConfigError(f"system={cfg.system.name} applies a routing transform that reads router probabilities; "
                          f"task.trace={task.trace!r} has no router logits (a run with task.save_routing=true on a "
                          "whole model writes them)")


def check_world(task, cfg) -> None:
    """``task.total_tokens`` shares out evenly over the world's ranks; ``task.routers`` names a
    model whose routers can route this one (one line each, :class:`ConfigError`)."""
    P = cfg.cluster.world_size
    if task.routing == "router" and task.routers:
        r, m = _model_yaml(task.routers), cfg.model
        if not r.family:
            raise ConfigError(f"task.routers={task.routers}: a layer-only config has no routers; give a whole model "
                              "(a trained proxy)")
        if (r.num_experts, r.top_k) != (m.num_experts, m.top_k) or len(moe_layers(r)) < len(task_layers(cfg)):
            raise ConfigError(f"task.routers={task.routers} routes E={r.num_experts}, top-{r.top_k} in "
                              f"{len(moe_layers(r))} MoE layers; model={m.name} needs E={m.num_experts}, "
                              f"top-{m.top_k} and routers for {len(task_layers(cfg))} layer(s) "
                              f"(task.sample_layers)")
    if task.total_tokens and task.total_tokens % P:
        raise ConfigError(f"task.total_tokens={task.total_tokens} does not share out over cluster.world_size={P} "
                          f"ranks: give a multiple of {P}")


def planned_systems() -> list:
    """The conf/system names of the systems that have a traffic plan."""
    import yaml

    from .. import CONF_DIR

    out = []
    for path in sorted((CONF_DIR / "system").glob("*.yaml")):
        config = system_config(yaml.safe_load(path.read_text()))
        if config.expert_parallel and not config.plan_refusal():
            out.append(path.stem)
    return out


def _transform_of(cfg, layer: int):
    """The system's routing transform of ``layer`` (None: it has none)."""
    ep = EPGroup(0, cfg.cluster.world_size, None, "cpu", cfg.cluster.devices_per_node)
    return system_config(cfg.system).build(ep, layer, cfg.model.num_experts).routing_transform(layer)


def prepare(cfg_dict: dict) -> dict:
    """``routing=router``: the checkpoint whose routers route (a proxy pre-trained first when
    missing: :func:`occult.tasks.model.prepare`); other sources read no weights."""
    if cfg_dict["task"]["routing"] != "router":
        cfg_dict["checkpoint"] = None
        return cfg_dict
    from .model import prepare as prepare_model
    routers = cfg_dict["task"].get("routers")
    if not routers:
        return prepare_model(cfg_dict)
    prepared = prepare_model(routers_config(cfg_dict))       # the routers' model: its checkpoint
    return {**cfg_dict, "checkpoint": prepared["checkpoint"], "setup_done": prepared.get("setup_done", [])}


def routers_config(cfg_dict: dict) -> dict:
    """The run's config with ``model`` replaced by the model whose routers route
    (``task.routers``, its config resolved by the runner into ``routers_model``; the run's
    own model when unset)."""
    routers = cfg_dict["task"].get("routers")
    if not routers:
        return cfg_dict
    if not cfg_dict.get("routers_model"):
        raise ValueError(f"task.routers={routers}: its model config was not resolved (occult.runner.run does)")
    return {**cfg_dict, "model": cfg_dict["routers_model"]}


def _model_yaml(name: str):
    """The fields of ``conf/model/<name>.yaml`` that validation reads (family, E, K, layers),
    as written, with the schema's defaults for the layers (a one-line error for a missing one)."""
    import yaml

    from .. import CONF_DIR
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ConfigError(f"task.routers={name}: no such model config; available: {', '.join(names)}")
    raw = yaml.safe_load(path.read_text()) or {}
    return OmegaConf.create({"name": name, "family": raw.get("family"), "num_experts": raw.get("num_experts"),
                             "top_k": raw.get("top_k"), "num_layers": raw.get("num_layers", 1),
                             "first_k_dense": raw.get("first_k_dense", 0)})


# ---------------------------------------------------------------------------
# the world's routing
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A routing source's tokens: ``{layer: (topk_ids_NK, weights_NK, logits_NE or None)}``
    (host tensors) and ``index_W``, the source token of each of the world's tokens."""

    layers: dict
    index_W: Optional[torch.Tensor]
    tokens: int

    @property
    def resampled(self) -> bool:
        return self.index_W is not None and self.index_W.numel() > self.tokens


def routed_source(cfg) -> dict:
    """The layers of the ``router`` or ``trace`` source (see the module docstring); the
    routers' output is cached on disk (:func:`cached_routing`), since every point of a
    sweep over systems and world sizes routes the same text through the same checkpoint."""
    t = cfg.task
    if t.routing == "trace":
        return trace_layers(t.trace)
    routed = OmegaConf.create(routers_config(OmegaConf.to_container(cfg, resolve=True)))
    layers = cached_routing(routed, lambda: _route_held_out(routed))
    if not t.get("routers"):
        return layers
    # the routers' MoE layers, sampled as the model's are, stand for the model's sampled layers
    mine = task_layers(cfg)
    theirs = task_layers(OmegaConf.merge(routed, {"task": {"sample_layers": len(mine)}}))
    return {layer: layers[other] for layer, other in zip(mine, theirs)}


ROUTING_CACHE = Path(__file__).resolve().parents[2] / "runs" / "cache" / "routing"


def routing_key(cfg) -> str:
    """What the routers' output depends on: the checkpoint's bytes (sha256), the model
    config, the text (corpus, split), the tokens, the window length and the seed."""
    import hashlib
    import json

    ckpt = cfg.get("checkpoint")
    digest = "untrained"
    if ckpt:
        h = hashlib.sha256()
        files = sorted(Path(ckpt).rglob("*")) if Path(ckpt).is_dir() else [Path(ckpt)]
        for f in (f for f in files if f.is_file()):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        digest = h.hexdigest()
    t = cfg.task
    key = {"checkpoint": digest, "model": OmegaConf.to_container(cfg.model, resolve=True), "corpus": t.corpus,
           "split": t.split, "source_tokens": t.source_tokens, "seq_len": t.seq_len, "seed": cfg.seed,
           "tokenizer_vocab": cfg.pretrain.tokenizer_vocab}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_routing(cfg, compute) -> dict:
    """``compute()`` (``{layer: (ids_NK, weights_NK, logits_NE)}``), read from
    ``runs/cache/routing/<key>.pt`` when a run with the same :func:`routing_key` wrote it."""
    path = ROUTING_CACHE / f"{cfg.model.name}_{routing_key(cfg)}.pt"
    if path.is_file():
        return torch.load(path, map_location="cpu")
    layers = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(layers, tmp)
    tmp.replace(path)                    # atomic: a concurrent run reads a whole file or none
    return layers


def _route_held_out(cfg) -> dict:
    """The model's routers on ``task.source_tokens`` tokens of ``task.corpus`` / ``task.split``."""
    t = cfg.task
    from ..data.batches import token_ids
    from ..data.tokenizer import get_tokenizer
    from ..models.families import family_of
    from ..models.runtime import base_model
    from .profiling import route_text

    tok = get_tokenizer(cfg.pretrain.tokenizer_vocab, corpus=cfg.pretrain.corpus)
    model = base_model(cfg, cfg.model.vocab_size or tok.vocab_size, cfg.get("checkpoint"))
    return route_text(model, family_of(cfg.model.family), token_ids(t.corpus, t.split, tok), t.source_tokens,
                      t.seq_len, seed=cfg.seed + 11)


def synthetic_source(cfg, salt: int = 0) -> dict:
    """``task.synthetic_tokens`` synthetic tokens per sampled layer, drawn once (seeded by the
    layer and ``salt``): ``{layer: (ids_NK, weights_NK, logits_NE)}``, the Gumbel keys as
    the logits (see :func:`rank_routing`)."""
    m, t = cfg.model, cfg.task
    popularity_E = expert_popularity(t.routing, m.num_experts, t.zipf_s)
    out = {}
    for layer in task_layers(cfg):
        g = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + 7919 * (layer + 1) + 15_485_863 * salt
                                                      + 31)
        keys_NE = gumbel_keys(t.synthetic_tokens, popularity_E, g)
        ids_NK = torch.topk(keys_NE, m.top_k, dim=1).indices
        out[layer] = (ids_NK, gate_weights(torch.softmax(keys_NE, dim=1).float(), ids_NK, m.norm_topk_prob),
                      keys_NE.float())
    return out


def world_source(cfg, salt: int = 0) -> Optional[Source]:
    """The source of a ``router`` or ``trace`` world (or a synthetic one of
    ``task.synthetic_tokens`` tokens), with the source token of each world token (the first
    T P, or T P drawn with replacement when the source holds fewer); None for synthetic
    routing drawn rank by rank. ``salt``: another synthetic stream (a profiling set)."""
    t = cfg.task
    if t.routing in ("router", "trace"):
        layers = routed_source(cfg)
    elif t.get("synthetic_tokens"):
        layers = synthetic_source(cfg, salt)
    else:
        return None
    N = next(iter(layers.values()))[0].shape[0]
    W = rank_tokens(cfg) * cfg.cluster.world_size
    if N >= W:
        return Source(layers, torch.arange(W, device="cpu"), N)
    g = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + 17)
    return Source(layers, torch.randint(0, N, (W,), generator=g, device="cpu"), N)


def rank_routing(cfg, source: Optional[Source], layer: int, rank: int, device, salt: int = 0,
                 need_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Rank ``rank``'s tokens in ``layer``: ``(topk_ids_TK, topk_weights_TK, probs_TE or None)``
    on ``device``, before the system's routing transform. ``salt``: another synthetic stream
    for the same seed (a profiling set beside the world it is judged on); ``need_probs``:
    False when no routing transform reads the probabilities (a source's are then not
    computed: a [T, E] softmax per rank)."""
    m, t = cfg.model, cfg.task
    T = rank_tokens(cfg)
    if source is None:
        g = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + 7919 * (layer + 1) + 104729 * (rank + 1)
                                                      + 15_485_863 * salt)
        ids_TK, probs_TE = sample_router(T, m.top_k, expert_popularity(t.routing, m.num_experts, t.zipf_s), g)
        weights_TK = gate_weights(probs_TE, ids_TK, m.norm_topk_prob)
    else:
        ids_NK, w_NK, logits_NE = source.layers[layer]
        pick_T = source.index_W[rank * T:(rank + 1) * T]
        ids_TK, weights_TK = ids_NK[pick_T], w_NK[pick_T]
        probs_TE = None if logits_NE is None or not need_probs else torch.softmax(logits_NE[pick_T].float(), dim=-1)
    move = lambda x: None if x is None else x.to(device)
    return move(ids_TK), move(weights_TK), move(probs_TE)


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


@contextmanager
def one_thread():
    """Torch's intra-op threads at one for the block (restored after): planning is many small
    operations per rank, for which more threads cost more than they save (a 256-rank layer
    took 0.75 s at one thread and 4 s at two on this project's 2-core machine, both cores busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_rank(ctx, cfg_dict: dict) -> list:
    """The whole simulated world on this one process, at one intra-op thread; returns its rows."""
    with one_thread():
        return _simulate(ctx, cfg_dict)


def _simulate(ctx, cfg_dict: dict) -> list:
    """:func:`run_rank`'s work: every MoE layer's routing, world plan and rows."""
    cfg = OmegaConf.create(cfg_dict)
    m, t, c = cfg.model, cfg.task, cfg.cluster
    ep = EPGroup(0, c.world_size, None, str(ctx.device), c.devices_per_node)    # never started: nothing is sent
    shape = RowShape(m.hidden_size, m.expert_ffn_size, getattr(torch, m.dtype))
    source = world_source(cfg)
    rows = []
    if source is not None:
        rows += [row("source_size", source.tokens, "tokens"),
                 row("resampled_tokens", float(source.resampled), "bool")]
    for layer in task_layers(cfg):
        T = t.total_tokens // c.world_size if t.total_tokens else t.tokens_per_rank
        dispatcher = system_config(cfg.system).sized(T).build(ep, layer, m.num_experts)
        need_probs = dispatcher.routing_transform(layer) is not None
        routing = []
        for rank in range(c.world_size):
            ids_TK, w_TK, probs_TE = rank_routing(cfg, source, layer, rank, ctx.device, need_probs=need_probs)
            routing.append(transformed_routing(dispatcher, layer, probs_TE, ids_TK, w_TK))
        with peak_memory(ctx.device) as mem, stopwatch() as sw:
            world = plan_world(dispatcher, routing, shape, training=t.backward, backward=t.backward)
        rows += [row("planning_time", sw.seconds * 1e3, "ms", layer=layer, phase="plan"),
                 row("planning_peak_memory", mem.peak, "bytes", layer=layer, phase="plan"),
                 row("planning_added_memory", max(mem.peak - mem.start, 0) if mem.peak >= 0 else -1, "bytes",
                     layer=layer, phase="plan")]
        rows += layer_rows(cfg, world, routing, dispatcher.placement, layer)
        twin = dynamic_twin(system_config(cfg.system).sized(T))
        if twin is not None:
            twin_world = plan_world(twin.build(ep, layer, m.num_experts), routing, shape, training=t.backward,
                                    backward=t.backward)
            rows += node_rows(valid_world(world, twin_world), c.world_size, c.devices_per_node, layer, "valid_")
    return rows
