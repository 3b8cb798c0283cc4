"""The routing of a world that is not here, computed in one process: what task=simulate,
task=place and task=placement_load run on (their shared option group: :class:`RoutedWorld`). The world is ``cluster.world_size`` ranks of
``task.tokens_per_rank`` tokens each (or ``task.total_tokens`` shared out); the MoE layers
computed are :func:`task_layers`.

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
``resampled_tokens`` is 1 (0 otherwise), ``source_size`` is N.

Also the checks of a source at validation (:func:`check_source`), the routers' model of
``task.routers`` (:func:`routers_spec`), and :func:`one_thread` (planning is many small
operations).

Shapes: N source tokens, W = T P world tokens, T tokens of a rank, K top-k, E experts, P ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Optional

import torch

from ..columns import later
from ..ep import system_config
from ..ep.comm import EPGroup
from ..ep.router import gate_weights
from ..errors import ConfigError
from ..routing_traces import ROUTING_FILE, load_trace, trace_layers
from ..schemas import ModelConf, plain, typed
from ..spec import RunSpec
from ..synthetic import expert_popularity, gumbel_keys, sample_router
from .schema import Corpus, Drawn, HeldOut, at_least


SIMULATED_ROUTINGS = ("router", "trace", "uniform", "zipf")


@dataclass
class RoutedWorld(Drawn, Corpus, HeldOut):
    """The routing of a world that is not here (``cluster.world_size`` ranks), for the tasks
    that compute it in one process (:mod:`occult.tasks.world`): the model's routers on
    ``source_tokens`` tokens of held-out text (``router``), a run's routing trace (``trace``:
    the run folder in ``trace``), or synthetic (``uniform``, ``zipf``); ``sample_layers``:
    how many MoE layers to compute (0: every one; :func:`occult.tasks.world.task_layers`);
    ``routers``: route with another model's routers (a trained proxy of a full config that
    has none here); ``total_tokens``: the world's tokens (strong
    scaling; 0: ``tokens_per_rank`` on every rank). ``tokens_per_rank``, ``zipf_s``, ``trace``:
    :class:`occult.tasks.schema.Drawn`; ``corpus``, ``seq_len``: :class:`occult.tasks.schema.Corpus`;
    ``split``: :class:`occult.tasks.schema.HeldOut`."""

    total_tokens: int = later(0)        # the world's tokens, T = total_tokens / P (0: tokens_per_rank)
    routing: str = "router"             # router | trace | uniform | zipf
    source_tokens: int = 32768          # routing=router: held-out tokens the model routes
    routers: Optional[str] = later(None)    # routing=router: the conf/model whose routers route (a trained proxy
                                        # of the model's E and K; null: the model's own)
    sample_layers: int = later(0)       # MoE layers computed: 0 every one, n evenly spaced (1: the middle one)
    synthetic_tokens: int = later(0)    # uniform | zipf: 0 every rank draws its own; N: N tokens per layer,
                                        # the world's drawn from them (with replacement where it needs more)

    prepare: ClassVar[str] = "occult.tasks.model.routed_prepare"
    expert_parallel_only: ClassVar[bool] = True
    one_process: ClassVar[bool] = True
    clock: ClassVar[str] = "simulated"
    # the task plans the top-level system's traffic (task=simulate): the system needs a traffic
    # plan, and a trace its router logits where the system's routing transform reads them
    plans_system: ClassVar[bool] = False

    def check(self) -> None:
        super().check()
        if self.routing not in SIMULATED_ROUTINGS:
            raise ConfigError(f"task.routing={self.routing!r}: allowed values are {list(SIMULATED_ROUTINGS)}")
        for name in ("tokens_per_rank", "source_tokens"):
            at_least(name, getattr(self, name), 1)
        at_least("total_tokens", self.total_tokens, 0)
        if self.routing == "trace" and not self.trace:
            raise ConfigError("task.trace is not set: task.routing=trace needs a run folder holding routing.parquet "
                              "(a run with task.save_routing=true)")
        at_least("sample_layers", self.sample_layers, 0)
        at_least("synthetic_tokens", self.synthetic_tokens, 0)

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.routing != "zipf":
            out["zipf_s"] = "read only with task.routing=zipf"
        if self.routing != "trace":
            out["trace"] = "read only with task.routing=trace"
        if self.routing != "router":
            for name in ("source_tokens", "corpus", "split", "seq_len", "routers"):
                out[name] = "read only with task.routing=router"
        if self.routing not in ("uniform", "zipf"):
            out["synthetic_tokens"] = "read only with task.routing=uniform or zipf"
        if self.total_tokens:
            out["tokens_per_rank"] = "not read with task.total_tokens set (tokens per rank = total_tokens / world size)"
        return out

    def check_run(self, cfg) -> None:
        check_source(self, cfg)

    def columns(self, world_size: int) -> Dict[str, Any]:
        out = super().columns(world_size)
        out["tokens_per_rank"] = self.rank_tokens(world_size)
        return out

    def rank_tokens(self, world_size: int) -> int:
        """Tokens of every simulated rank of a ``world_size``-rank world: ``total_tokens / P``
        (strong scaling) or ``tokens_per_rank``."""
        return self.total_tokens // world_size if self.total_tokens else self.tokens_per_rank

    def replayed_trace(self) -> Optional[str]:
        return self.trace if self.routing == "trace" else None

    def routers_model_name(self) -> Optional[str]:
        return self.routers


def moe_layers(m) -> list:
    """The MoE layers of model config ``m``: its layers after the first ``first_k_dense``."""
    return list(range(m.first_k_dense, m.num_layers))


def task_layers(model, sample_layers: int) -> list:
    """The MoE layers a task computes of ``model``: every MoE layer (``sample_layers`` 0 or
    at least their number), else that many evenly spaced (1: the middle layer; 2: the first
    and the last; 3: first, middle, last)."""
    layers, n = moe_layers(model), sample_layers
    if n == 0 or n >= len(layers):
        return layers
    if n == 1:
        return [layers[len(layers) // 2]]
    step = (len(layers) - 1) / (n - 1)
    return sorted({layers[int(i * step + 0.5)] for i in range(n)})         # halves round up, as n = 1 does


# ---------------------------------------------------------------------------
# checking the source (at validation) and preparing it (in the launching process)
# ---------------------------------------------------------------------------


def check_source(task, cfg) -> None:
    """The routing source fits the run: a model with routers for ``router``; for ``trace``, a
    trace of this model's layers, K and E (and router logits where the system's routing
    transform reads router probabilities). One line each (:class:`ConfigError`)."""
    m = cfg.model
    check_world(task, cfg)
    refusal = system_config(cfg.system).plan_refusal() if task.plans_system else None
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
    if task.plans_system and not logits and _transform_of(cfg, layers[0]) is not None:
        raise ConfigError(f"system={cfg.system.name} applies a routing transform that reads router probabilities; "
                          f"task.trace={task.trace!r} has no router logits (a run with task.save_routing=true on a "
                          "whole model writes them)")


def check_world(task, cfg) -> None:
    """``task.total_tokens`` shares out evenly over the world's ranks; ``task.routers`` names a
    model whose routers can route this one (one line each, :class:`ConfigError`)."""
    P = cfg.cluster.world_size
    if task.routing == "router" and task.routers:
        m = cfg.model
        r = _model_yaml(task.routers)
        if not r.family:
            raise ConfigError(f"task.routers={task.routers}: a layer-only config has no routers; give a whole model "
                              "(a trained proxy)")
        if (r.num_experts, r.top_k) != (m.num_experts, m.top_k) or len(moe_layers(r)) < len(task_layers(m, task.sample_layers)):
            raise ConfigError(f"task.routers={task.routers} routes E={r.num_experts}, top-{r.top_k} in "
                              f"{len(moe_layers(r))} MoE layers; model={m.name} needs E={m.num_experts}, "
                              f"top-{m.top_k} and routers for {len(task_layers(m, task.sample_layers))} layer(s) "
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


def routers_spec(spec: RunSpec) -> RunSpec:
    """The run's spec with ``model`` replaced by the model whose routers route
    (``task.routers``, its config resolved by the runner into ``routers_model``; the run's
    own model when unset)."""
    if not spec.task.routers:
        return spec
    if spec.routers_model is None:
        raise ValueError(f"task.routers={spec.task.routers}: its model config was not resolved "
                         "(occult.runner.build_spec does)")
    return spec.with_model(spec.routers_model)


def _model_yaml(name: str):
    """``conf/model/<name>.yaml`` through the model's schema (its defaults filled in), a
    one-line error for a missing file or a bad field."""
    import yaml

    from .. import CONF_DIR
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ConfigError(f"task.routers={name}: no such model config; available: {', '.join(names)}")
    try:
        return typed(ModelConf, yaml.safe_load(path.read_text()) or {})
    except Exception as exc:  # noqa: BLE001 - an OmegaConf error: one line naming the field
        raise ConfigError(f"task.routers={name}: {str(exc).splitlines()[0]}") from exc


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
    routed = routers_spec(cfg)
    layers = cached_routing(routed, lambda: _route_held_out(routed))
    if not t.routers:
        return layers
    # the routers' MoE layers, sampled as the model's are, stand for the model's sampled layers
    mine = task_layers(cfg.model, t.sample_layers)
    theirs = task_layers(routed.model, len(mine))
    return {layer: layers[other] for layer, other in zip(mine, theirs)}


ROUTING_CACHE = Path(__file__).resolve().parents[2] / "runs" / "cache" / "routing"


def routing_key(cfg) -> str:
    """What the routers' output depends on: the checkpoint's bytes (sha256), the model
    config, the text (corpus, split), the tokens, the window length and the seed."""
    import hashlib
    import json

    ckpt = cfg.checkpoint
    digest = checkpoint_digest(Path(ckpt)) if ckpt else "untrained"
    t = cfg.task
    # the typed model as a dict (dataclasses.asdict: the same dict as plain(), without building
    # an OmegaConf schema, 0.1 s in a fresh rank process, once per sweep point)
    model = dataclasses.asdict(cfg.model) if dataclasses.is_dataclass(cfg.model) else plain(cfg.model)
    key = {"checkpoint": digest, "model": model,
           "corpus": t.corpus,
           "split": t.split, "source_tokens": t.source_tokens, "seq_len": t.seq_len, "seed": cfg.seed,
           "tokenizer_vocab": cfg.pretrain.tokenizer_vocab}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def checkpoint_digest(ckpt: Path) -> str:
    """sha256 over a checkpoint's files (names and bytes), remembered in
    ``runs/cache/routing/digests.json`` under each file's path, size, modification time and
    inode (a sweep's every point read and hashed the whole checkpoint: 0.4 s of a 1.3 s
    point); a file that changed in any of them is hashed again."""
    import hashlib
    import json

    files = [f for f in (sorted(ckpt.rglob("*")) if ckpt.is_dir() else [ckpt]) if f.is_file()]
    stamp = json.dumps([[str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino] for f in files
                        for st in [f.stat()]])
    memo_path = ROUTING_CACHE / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if stamp in memo:
        return memo[stamp]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    memo[stamp] = h.hexdigest()
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo))
    tmp.replace(memo_path)               # atomic; a concurrent writer's entry may be lost and is hashed again
    return memo[stamp]


def cached_routing(cfg, compute) -> dict:
    """``compute()`` (``{layer: (ids_NK, weights_NK, logits_NE)}``), read from
    ``runs/cache/routing/<key>.pt`` when a run with the same :func:`routing_key` wrote it."""
    return _cached(ROUTING_CACHE / f"{cfg.model.name}_{routing_key(cfg)}.pt", compute)


def _route_held_out(cfg) -> dict:
    """The model's routers on ``task.source_tokens`` tokens of ``task.corpus`` / ``task.split``."""
    t = cfg.task
    from ..data.batches import token_ids
    from ..data.tokenizer import get_tokenizer
    from ..models.families import family_of
    from ..models.runtime import base_model
    from .profiling import route_text

    tok = get_tokenizer(cfg.pretrain.tokenizer_vocab, corpus=cfg.pretrain.corpus)
    model = base_model(cfg, cfg.model.vocab_size or tok.vocab_size, cfg.checkpoint)
    return route_text(model, family_of(cfg.model.family), token_ids(t.corpus, t.split, tok), t.source_tokens,
                      t.seq_len, seed=cfg.seed + 11)


def synthetic_source(cfg, salt: int = 0) -> dict:
    """``task.synthetic_tokens`` synthetic tokens per sampled layer, drawn once (seeded by the
    layer and ``salt``): ``{layer: (ids_NK, weights_NK, logits_NE)}``, the Gumbel keys as
    the logits (see :func:`rank_routing`). Cached on disk (:func:`cached_synthetic`): every
    point of a sweep over systems and world sizes draws the same tokens, and the draw (N x E
    keys, a softmax and a top-k per layer) was most of a small point's time."""
    return cached_synthetic(cfg, salt, lambda: _draw_synthetic(cfg, salt))


# bump when _draw_synthetic draws differently: cached draws of older versions are then not read
SYNTHETIC_VERSION = 1


def synthetic_key(cfg, salt: int) -> str:
    """What a synthetic draw depends on: the model's E, K and gate normalisation, the
    popularity (``task.routing``, ``task.zipf_s``), the tokens, the sampled layers, the seed,
    the salt, torch's version (its generator), :data:`SYNTHETIC_VERSION` and the code that
    draws (:func:`draw_code_digest`)."""
    import hashlib
    import json

    m, t = cfg.model, cfg.task
    key = {"num_experts": m.num_experts, "top_k": m.top_k, "norm_topk_prob": m.norm_topk_prob,
           "routing": t.routing, "zipf_s": t.zipf_s if t.routing == "zipf" else None,
           "tokens": t.synthetic_tokens, "layers": task_layers(m, t.sample_layers), "seed": cfg.seed, "salt": salt,
           "torch": torch.__version__, "version": SYNTHETIC_VERSION, "code": draw_code_digest()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


@functools.lru_cache(maxsize=1)
def draw_code_digest() -> str:
    """sha256 of the source of the functions a synthetic draw runs (the draw, the Gumbel keys,
    the popularity, the gate weights): a change to any of them makes earlier draws unread."""
    import hashlib
    import inspect

    parts = [_draw_synthetic, gumbel_keys, expert_popularity, gate_weights]
    return hashlib.sha256("".join(inspect.getsource(f) for f in parts).encode()).hexdigest()[:16]


def cached_synthetic(cfg, salt: int, compute) -> dict:
    """``compute()`` (a synthetic draw), read from ``runs/cache/routing/synthetic_<key>.pt``
    when a run with the same :func:`synthetic_key` wrote it."""
    return _cached(ROUTING_CACHE / f"synthetic_{synthetic_key(cfg, salt)}.pt", compute)


def _cached(path: Path, compute) -> dict:
    """``compute()``'s tensors, saved at ``path`` (atomically) or read from it, memory-mapped:
    the router logits (N x E per layer, 100 MB for three layers of 256 experts) are read only
    where a routing transform reads them."""
    if path.is_file():
        return torch.load(path, map_location="cpu", mmap=True)
    layers = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(layers, tmp)
    tmp.replace(path)                    # atomic: a concurrent run reads a whole file or none
    return layers


def _draw_synthetic(cfg, salt: int) -> dict:
    """:func:`synthetic_source`'s draw."""
    m, t = cfg.model, cfg.task
    popularity_E = expert_popularity(t.routing, m.num_experts, t.zipf_s)
    out = {}
    for layer in task_layers(m, t.sample_layers):
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
    elif t.synthetic_tokens:
        layers = synthetic_source(cfg, salt)
    else:
        return None
    N = next(iter(layers.values()))[0].shape[0]
    W = cfg.task.rank_tokens(cfg.cluster.world_size) * cfg.cluster.world_size
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
    T = t.rank_tokens(cfg.cluster.world_size)
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
