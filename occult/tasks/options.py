"""Each task's typed options: the fields it reads, and no others.

A task is one YAML file under ``conf/task`` (its ``name``, its ``schema`` and the defaults
it changes) and one dataclass here, a subclass of :class:`TaskConf`. The dataclass is the
task's declaration: its fields are the options the task reads (a field it does not read
is not there, so setting one fails when the config is composed: ``task.backward: task=bench
does not read it; its fields: ...``), and its class attributes say what the runner needs
to know (the rank function, the set-up in the launching process, whether it runs a whole
model, an expert-parallel layer, the top-level ``system``). :func:`occult.config.register`
stores every task's schema as ``task_schema/<name>``; ``conf/config.yaml`` merges the
chosen task's schema under its YAML, as it does for systems.

Some fields are read only with some values of others (``task=bench_model`` reads
``task.new_tokens`` only for ``task.workload=decode``); :meth:`TaskConf.unread` names them,
and validation refuses one set away from its default.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from ..columns import column, later
from ..errors import ConfigError
from ..synthetic import ROUTINGS
from ..workloads import MAX_OVER_MEAN_CAP

WORKLOAD_NAMES = ("prefill", "decode", "train")


def _at_least(name: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"task.{name}={value}: must be at least {low}")


@dataclass
class TaskConf:
    """The fields every task has: its config name and the dotted path of its schema."""

    name: str = MISSING
    schema: str = MISSING

    # the rank function (``fn(ctx, cfg_dict) -> rows``) and the set-up run once in the
    # launching process first (``fn(cfg_dict) -> cfg_dict``; "" for none)
    entry: ClassVar[str] = ""
    prepare: ClassVar[str] = ""
    # the task runs a whole model (needs model.family) / needs an expert-parallel dispatcher
    whole_model: ClassVar[bool] = False
    expert_parallel_only: ClassVar[bool] = False
    # the task runs the top-level ``system`` (False: it compares systems of its own, or runs none)
    uses_system: ClassVar[bool] = True
    # the task runs in one process whatever ``cluster.world_size`` (it simulates that world),
    # and what times its rows (the ``clock`` column; "": the cluster's clock)
    one_process: ClassVar[bool] = False
    clock: ClassVar[str] = ""

    @classmethod
    def option_names(cls) -> list:
        """The task's options: every field but ``name`` and ``schema``."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in ("name", "schema")]

    def check(self) -> None:
        """Raises :class:`ConfigError` (one line naming the field) for values this task
        cannot run with. Subclasses add their checks."""

    def unread(self) -> Dict[str, str]:
        """Fields these values leave unread: name -> why (validation refuses each one that is
        set away from its default)."""
        return {}

    def check_run(self, cfg) -> None:
        """Raises :class:`ConfigError` (one line) for values that cannot run with this run's
        model and cluster (``cfg``: the composed config), e.g. an input file of another shape."""

    def has_copies(self) -> bool:
        """Whether the task's placement holds copies of some expert (a task without a
        placement option: none)."""
        return False


@dataclass
class Timed(TaskConf):
    """Warm-up, then timed iterations (every sample kept)."""

    warmup: int = 2
    iters: int = 5

    def check(self) -> None:
        super().check()
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"task.iters={self.iters}, task.warmup={self.warmup}: need iters >= 1, warmup >= 0")


@dataclass
class Gated(TaskConf):
    """The parity gate: before anything is timed, the system against the single-device
    reference on a float64 problem of ``parity_tokens`` tokens per rank, drawn from the run's
    seed (:func:`occult.tasks.common.parity_gate`); where a whole-model run changes what the
    model computes beyond one layer (micro-batches, a shortcut model, migration, an
    overlapped gradient sync), also the whole model under that schedule, float64, on
    ``parity_tokens`` tokens per rank (:func:`occult.tasks.common.model_parity_gate`)."""

    check_parity: bool = True
    parity_tokens: int = 32

    def check(self) -> None:
        super().check()
        _at_least("parity_tokens", self.parity_tokens, 1)

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if not self.check_parity:
            out["parity_tokens"] = "read only with task.check_parity=true"
        return out


@dataclass
class Exchanges(TaskConf):
    """How the collectives are timed."""

    sync_collectives: bool = False      # barrier before each collective: a2a_time = transfer only


@dataclass
class LayerInputs(TaskConf):
    """One MoE layer's inputs: seeded tokens and synthetic (or router) routing; the load
    workloads (``imbalance``, ``incast``, ``trace``: :mod:`occult.workloads`)."""

    tokens_per_rank: int = 512          # T
    routing: str = "uniform"            # router | uniform | zipf | imbalance | incast | trace
    zipf_s: float = 1.2                 # skew of routing=zipf
    max_over_mean: float = later(2.0)   # routing=imbalance: dispatch received rows max / mean (contiguous)
    incast_device: int = later(0)       # routing=incast: the device whose experts draw ...
    incast_share: float = later(0.5)    # ... this share of every token's choices
    trace: Optional[str] = None         # routing=trace: a routing.parquet, or a run folder holding one

    def check(self) -> None:
        super().check()
        if self.routing not in ROUTINGS:
            raise ConfigError(f"task.routing={self.routing!r}: allowed values are {list(ROUTINGS)}")
        if self.zipf_s < 0:
            raise ConfigError(f"task.zipf_s={self.zipf_s}: must be >= 0 (0 is uniform routing; larger is more skewed)")
        _at_least("tokens_per_rank", self.tokens_per_rank, 0)
        if self.max_over_mean < 1.0:
            raise ConfigError(f"task.max_over_mean={self.max_over_mean}: allowed values are 1.0 to "
                              f"{MAX_OVER_MEAN_CAP:g} (received rows max / mean over ranks; 1 is balanced)")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        for name, routing in (("zipf_s", "zipf"), ("max_over_mean", "imbalance"), ("incast_device", "incast"),
                              ("incast_share", "incast"), ("trace", "trace")):
            if self.routing != routing:
                out[name] = f"read only with task.routing={routing}"
        return out

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        from ..workloads import incast_error, max_over_mean_error, trace_error

        E, K, P = cfg.model.num_experts, cfg.model.top_k, cfg.cluster.world_size
        err = ""
        if self.routing == "imbalance":
            err = max_over_mean_error(self.max_over_mean, E, K, P)
        elif self.routing == "incast":
            err = incast_error(self.incast_device, self.incast_share, E, K, P)
        elif self.routing == "trace":
            err = trace_error(self.trace, E, K, self.tokens_per_rank, P)
        if err:
            raise ConfigError(err)


PLACEMENTS = ("contiguous", "eplb", "eplb_affinity")


@dataclass
class Placed(TaskConf):
    """Where the experts sit: ``placement``: ``contiguous`` (the system's own placement),
    ``eplb`` (physical slots built by DeepSeek's EPLB from the loads of a profiling set, with
    ``num_redundant`` extra slots: :mod:`occult.placement.eplb`; the artifact is written to the
    run folder as ``placement_eplb.json``), ``eplb_affinity`` (EPLB's replica counts, the slots
    packed onto GPUs by load with a co-activation bonus of weight ``affinity_weight``:
    :mod:`occult.placement.affinity`; ``placement_eplb_affinity.json``), or the path of a slot
    placement artifact. Systems
    whose config says ``slot_placements`` run on slots (``naive``, ``occult``)."""

    placement: str = column("contiguous", absent="", later="contiguous")
    num_redundant: int = later(0)
    affinity_weight: float = 0.25       # eplb_affinity: the co-activation bonus (occult.placement.affinity)

    def check(self) -> None:
        super().check()
        if self.placement not in PLACEMENTS and not self.placement.endswith(".json"):
            raise ConfigError(f"task.placement={self.placement!r}: allowed values are {list(PLACEMENTS)} or the "
                              "path of a slot placement artifact (.json)")
        if self.num_redundant < 0:
            raise ConfigError(f"task.num_redundant={self.num_redundant}: must be >= 0 (extra physical slots)")
        if not self.affinity_weight >= 0:
            raise ConfigError(f"task.affinity_weight={self.affinity_weight}: must be >= 0")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.placement not in ("eplb", "eplb_affinity"):
            out["num_redundant"] = "read only with task.placement=eplb or eplb_affinity"
        if self.placement != "eplb_affinity":
            out["affinity_weight"] = "read only with task.placement=eplb_affinity"
        return out

    def has_copies(self) -> bool:
        """Whether the placement holds copies of some expert (EPLB's with redundant slots, or
        an artifact with copies)."""
        if self.placement == "contiguous":
            return False
        if self.placement in ("eplb", "eplb_affinity"):
            return self.num_redundant > 0
        from ..placement.eplb import load_slot_placements
        return any(bool((pl.copies_E() > 1).any()) for pl in load_slot_placements(self.placement)[0].values())

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if self.placement == "contiguous":
            return
        from ..ep import system_config
        from ..placement.eplb import load_slot_placements, num_redundant_error

        config = system_config(cfg.system) if self.uses_system else None
        if config is None:
            raise ConfigError(f"task.placement={self.placement!r}: task={self.name} runs no system on physical slots")
        if not config.slot_placements:
            from ..ep.capabilities import refusal
            why = refusal(config.name, config.capabilities(), "slots")
            raise ConfigError(f"task.placement={self.placement!r}: {why}")
        E, P = cfg.model.num_experts, cfg.cluster.world_size
        if self.placement in ("eplb", "eplb_affinity"):
            err = num_redundant_error(self.num_redundant, E, P)
            if err:
                raise ConfigError(err)
            return
        try:
            placements, doc = load_slot_placements(self.placement)
        except ValueError as exc:
            raise ConfigError(f"task.placement={self.placement!r}: {exc}") from exc
        if (doc["num_experts"], doc["num_devices"]) != (E, P):
            raise ConfigError(f"task.placement={self.placement!r} places {doc['num_experts']} experts on "
                              f"{doc['num_devices']} devices; the run has {E} on {P}")


@dataclass
class Text(TaskConf):
    """Sequences of a text corpus (held-out windows, or training batches)."""

    batch_size: int = 4                 # sequences per rank
    seq_len: int = 128
    corpus: str = "shakespeare"

    def check(self) -> None:
        super().check()
        _at_least("batch_size", self.batch_size, 1)
        _at_least("seq_len", self.seq_len, 1)


@dataclass
class MicroBatched(Text, Exchanges):
    """Micro-batch co-execution (DHelix; two-batch overlap): the rank's ``batch_size``
    sequences cut into ``microbatches`` micro-batches that run as strands, one's collectives
    in flight while another computes (:mod:`occult.ep.strands`); 1: the batch at once."""

    microbatches: int = column(1, later=1)

    def check(self) -> None:
        super().check()
        if not 1 <= self.microbatches <= self.batch_size:
            raise ConfigError(f"task.microbatches={self.microbatches}: allowed values are 1..task.batch_size="
                              f"{self.batch_size} (micro-batches of at least one sequence)")
        if self.microbatches > 1 and self.sync_collectives:
            raise ConfigError("task.sync_collectives=true: a barrier before every collective stops the "
                              f"micro-batches' overlap; allowed only with task.microbatches=1 (not {self.microbatches})")

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if self.microbatches == 1:
            return
        from ..ep import system_config

        config = system_config(cfg.system)
        from ..ep.capabilities import refusal
        why = refusal(config.name, config.capabilities(), "co_execution") if config.expert_parallel else ""
        if why:
            raise ConfigError(f"task.microbatches={self.microbatches}: {why}; allowed with it: 1")


@dataclass
class HeldOut(TaskConf):
    """Which split of the corpus the task reads."""

    split: str = "validation"


# ---------------------------------------------------------------------------
# the tasks
# ---------------------------------------------------------------------------


@dataclass
class LayerTask(Timed, Gated, Exchanges, Placed, LayerInputs):
    """task=layer: one MoE layer, timed per phase (:mod:`occult.tasks.layer`)."""

    backward: bool = True
    calibrate: bool = False             # measure the world's loopback first (the cost-model check)

    entry: ClassVar[str] = "occult.tasks.layer.run_rank"
    expert_parallel_only: ClassVar[bool] = True


@dataclass
class BenchTask(Timed, Gated, Exchanges, LayerInputs):
    """task=bench: systems side by side on one MoE layer, forward and backward
    (:mod:`occult.tasks.bench`). ``compare``: the systems, each a conf/system name or a
    system config (``{name: occult, kernels: epd}``); the first is the baseline."""

    compare: List[Any] = field(default_factory=lambda: ["naive", "occult"])

    entry: ClassVar[str] = "occult.tasks.bench.run_rank"
    prepare: ClassVar[str] = "occult.tasks.bench.prepare"
    expert_parallel_only: ClassVar[bool] = True
    uses_system: ClassVar[bool] = False


@dataclass
class Migrated(TaskConf):
    """Luffy's sequence migration (:mod:`occult.tasks.migration`): before the first decoder
    block each sequence moves, once per step, to the rank that holds most of its (token,
    expert) pairs (predicted from the previous step's routing); its outputs return home."""

    migration: bool = column(False, later=False)

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        from ..ep import system_config
        from ..ep.capabilities import refusal
        config = system_config(cfg.system)
        if self.migration and not config.expert_parallel:
            raise ConfigError(f"task.migration=true: system={cfg.system.name} runs no expert parallelism, so no "
                              "sequence has experts elsewhere to move to; allowed with an expert-parallel system")
        why = refusal(config.name, config.capabilities(), "migration") if self.migration else ""
        if why:
            raise ConfigError(f"task.migration=true: {why}; allowed with it: false")


@dataclass
class PrefillTask(Timed, Gated, Placed, MicroBatched, HeldOut, Migrated):
    """task=prefill: one forward over the prompts (:mod:`occult.tasks.model`)."""

    save_routing: bool = False          # write routing.parquet (+ router logits)

    entry: ClassVar[str] = "occult.tasks.model.prefill_rank"
    prepare: ClassVar[str] = "occult.tasks.model.prepare"
    whole_model: ClassVar[bool] = True


@dataclass
class DecodeTask(PrefillTask):
    """task=decode: greedy generation with a KV cache after the prompts. ``cuda_graph``: each
    MoE block's static decode step captured in a CUDA graph and replayed
    (:mod:`occult.ep.graphs`; CUDA ranks and ``system.dispatch_mode=static`` only)."""

    new_tokens: int = 16
    cuda_graph: bool = False

    entry: ClassVar[str] = "occult.tasks.model.decode_rank"

    def check(self) -> None:
        super().check()
        _at_least("new_tokens", self.new_tokens, 0)
        if self.migration:
            raise ConfigError("task.migration=true: task=decode would move each migrated sequence's KV cache, "
                              "which is not implemented; allowed values here: false (migration runs with "
                              "task=prefill and task=train)")

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if not self.cuda_graph:
            return
        import torch

        from ..ep import system_config
        from ..ep.graphs import refusal

        system = system_config(cfg.system)
        why = refusal(cfg.cluster.backend, system.is_static(),
                      torch.cuda.is_available())
        if why:
            raise ConfigError(why)


@dataclass
class TrainTask(Timed, Gated, Placed, MicroBatched, Migrated):
    """task=train: forward, backward, gradient sync and an AdamW step on training batches
    of ``corpus`` (its train split). ``grad_sync``: when the replicated weights' gradients
    are averaged (``end``, ``overlap``, ``lina``: :mod:`occult.models.grad_sync`)."""

    lr: float = 1e-3
    save_routing: bool = False
    grad_sync: str = column("end", absent="", later="end")

    def check(self) -> None:
        super().check()
        from ..models.grad_sync import GRAD_SYNCS

        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"task.grad_sync={self.grad_sync!r}: allowed values are {list(GRAD_SYNCS)}")

    entry: ClassVar[str] = "occult.tasks.model.train_rank"
    prepare: ClassVar[str] = "occult.tasks.model.prepare"
    whole_model: ClassVar[bool] = True


@dataclass
class BenchModelTask(Timed, Gated, Exchanges, Text, HeldOut):
    """task=bench_model: systems side by side on a whole model's ``workload`` (the
    prefill, decode or train task's own iterations)."""

    compare: List[Any] = field(default_factory=lambda: ["naive", "occult"])
    workload: str = "prefill"           # prefill | decode | train
    new_tokens: int = 16                # workload=decode
    lr: float = 1e-3                    # workload=train

    entry: ClassVar[str] = "occult.tasks.bench.model_rank"
    prepare: ClassVar[str] = "occult.tasks.bench.prepare"
    whole_model: ClassVar[bool] = True
    uses_system: ClassVar[bool] = False

    def check(self) -> None:
        super().check()
        if self.workload not in WORKLOAD_NAMES:
            raise ConfigError(f"task.workload={self.workload!r}: allowed values are {list(WORKLOAD_NAMES)}")
        _at_least("new_tokens", self.new_tokens, 0)

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.workload != "decode":
            out["new_tokens"] = "read only with task.workload=decode"
        if self.workload != "train":
            out["lr"] = "read only with task.workload=train"
        else:
            out["split"] = "not read with task.workload=train (training batches come from the train split)"
        return out


@dataclass
class FinetuneTask(Gated, Text, HeldOut):
    """task=finetune: Occult's modified fine-tuning, then held-out evaluation on both
    domains (:mod:`occult.tasks.finetune`). ``tokens_per_rank``: held-out tokens per rank
    and domain (0: the whole split); ``timing_iters``: timed prefill forwards after it."""

    steps: int = 100
    lr: float = 1e-3
    tokens_per_rank: int = 4096
    timing_iters: int = 0

    entry: ClassVar[str] = "occult.tasks.finetune.run_rank"
    prepare: ClassVar[str] = "occult.tasks.finetune.prepare"
    whole_model: ClassVar[bool] = True
    expert_parallel_only: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        for name in ("steps", "tokens_per_rank", "timing_iters"):
            _at_least(name, getattr(self, name), 0)

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if not self.steps:
            out["lr"] = "not read with task.steps=0 (no fine-tuning)"
        return out


@dataclass
class PlacementStudyTask(Gated, HeldOut):
    """task=placement_study: placement optimisers judged on held-out routing
    (:mod:`occult.tasks.placement_study`). ``tokens_per_rank``: profiling tokens per rank,
    in windows of ``seq_len`` tokens of ``corpus`` / ``split``; ``held_out_tokens``: held-out
    tokens per rank of the corpus's validation split (null: the whole split)."""

    corpus: str = "shakespeare"
    seq_len: int = 128
    tokens_per_rank: int = 1024
    held_out_tokens: Optional[int] = later(None)
    # the optimisers (occult.placement) run at every load cap (null: none; max / mean device
    # load on the profiling set), and swap_search's time limit per (layer, cap)
    optimisers: List[str] = later(["contiguous", "random", "greedy", "swap_search"])
    load_caps: List[Optional[float]] = later([None, 1.25, 1.15, 1.1])
    swap_time_limit_s: float = later(10.0)

    entry: ClassVar[str] = "occult.tasks.placement_study.run_rank"
    prepare: ClassVar[str] = "occult.tasks.model.prepare"
    whole_model: ClassVar[bool] = True
    expert_parallel_only: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        _at_least("seq_len", self.seq_len, 1)
        _at_least("tokens_per_rank", self.tokens_per_rank, 1)
        if self.held_out_tokens is not None:
            _at_least("held_out_tokens", self.held_out_tokens, 1)
        from ..placement import OPTIMISERS

        unknown = [o for o in self.optimisers if o not in OPTIMISERS]
        if not self.optimisers or unknown:
            raise ConfigError(f"task.optimisers={list(self.optimisers)}: allowed values are {sorted(OPTIMISERS)} "
                              "(at least one)")
        if not self.load_caps or any(c is not None and c < 1.0 for c in self.load_caps):
            raise ConfigError(f"task.load_caps={list(self.load_caps)}: allowed values are null (no cap) or "
                              "numbers >= 1.0 (max / mean device load), at least one")
        if self.swap_time_limit_s <= 0:
            raise ConfigError(f"task.swap_time_limit_s={self.swap_time_limit_s}: must be > 0 seconds")


SIMULATED_ROUTINGS = ("router", "trace", "uniform", "zipf")


@dataclass
class RoutedWorld(TaskConf):
    """The routing of a world that is not here (``cluster.world_size`` ranks), for the tasks
    that compute it in one process (:mod:`occult.tasks.simulate`): the model's routers on
    ``source_tokens`` tokens of held-out text (``router``), a run's routing trace (``trace``:
    the run folder in ``trace``), or synthetic (``uniform``, ``zipf``); ``sample_layers``:
    how many MoE layers to compute (0: every one; :func:`occult.tasks.simulate.task_layers`);
    ``routers``: route with another model's routers (a trained proxy of a full config that
    has none here); ``total_tokens``: the world's tokens (strong
    scaling; 0: ``tokens_per_rank`` on every rank)."""

    tokens_per_rank: int = 512          # T of every simulated rank
    total_tokens: int = later(0)        # the world's tokens, T = total_tokens / P (0: tokens_per_rank)
    routing: str = "router"             # router | trace | uniform | zipf
    zipf_s: float = 1.2                 # routing=zipf
    trace: Optional[str] = None         # routing=trace: a run folder holding routing.parquet
    source_tokens: int = 32768          # routing=router: held-out tokens the model routes
    corpus: str = "shakespeare"         # routing=router: the held-out text
    split: str = "validation"
    seq_len: int = 128
    routers: Optional[str] = later(None)    # routing=router: the conf/model whose routers route (a trained proxy
                                        # of the model's E and K; null: the model's own)
    sample_layers: int = later(0)       # MoE layers computed: 0 every one, n evenly spaced (1: the middle one)
    synthetic_tokens: int = later(0)    # uniform | zipf: 0 every rank draws its own; N: N tokens per layer,
                                        # the world's drawn from them (with replacement where it needs more)

    prepare: ClassVar[str] = "occult.tasks.simulate.prepare"
    expert_parallel_only: ClassVar[bool] = True
    one_process: ClassVar[bool] = True
    clock: ClassVar[str] = "simulated"

    def check(self) -> None:
        super().check()
        if self.routing not in SIMULATED_ROUTINGS:
            raise ConfigError(f"task.routing={self.routing!r}: allowed values are {list(SIMULATED_ROUTINGS)}")
        if self.zipf_s < 0:
            raise ConfigError(f"task.zipf_s={self.zipf_s}: must be >= 0 (0 is uniform routing; larger is more skewed)")
        for name in ("tokens_per_rank", "source_tokens", "seq_len"):
            _at_least(name, getattr(self, name), 1)
        _at_least("total_tokens", self.total_tokens, 0)
        if self.routing == "trace" and not self.trace:
            raise ConfigError("task.trace is not set: task.routing=trace needs a run folder holding routing.parquet "
                              "(a run with task.save_routing=true)")
        _at_least("sample_layers", self.sample_layers, 0)
        _at_least("synthetic_tokens", self.synthetic_tokens, 0)

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
        from .simulate import check_source
        check_source(self, cfg)


@dataclass
class SimulateTask(RoutedWorld):
    """task=simulate: the traffic of a world that is not here (``cluster.world_size`` ranks,
    ``cluster.devices_per_node`` a node), every rank's plan in one process
    (:mod:`occult.tasks.simulate`), on the routing of :class:`RoutedWorld`. ``backward``:
    plan the backward's collectives too; ``peer_rows``: a row per peer pair (false:
    per-rank totals only)."""

    backward: bool = True
    peer_rows: bool = True

    entry: ClassVar[str] = "occult.tasks.simulate.run_rank"


@dataclass
class PlaceTask(RoutedWorld):
    """task=place: a placement artifact for a world that is not here, in one process
    (:mod:`occult.tasks.place`): each MoE layer's experts grouped onto ``cluster.world_size``
    devices by ``optimiser`` (a placement optimiser, :data:`occult.placement.OPTIMISERS`) at
    ``load_cap`` (max / mean device load; null: none), swap_search stopping after
    ``time_limit_s`` per layer, from the routing of :class:`RoutedWorld` (by default the
    routers on the *training* split: a profiling set, not the held-out text simulate
    routes). Writes ``placements.json`` into the run folder, for ``system.placement_file``."""

    split: str = "train"
    optimiser: str = "swap_search"
    load_cap: Optional[float] = 1.25
    time_limit_s: float = 10.0

    entry: ClassVar[str] = "occult.tasks.place.run_rank"
    uses_system: ClassVar[bool] = False          # it places experts; no system runs

    def check(self) -> None:
        super().check()
        from ..placement import OPTIMISERS

        if self.optimiser not in OPTIMISERS:
            raise ConfigError(f"task.optimiser={self.optimiser!r}: allowed values are {sorted(OPTIMISERS)}")
        if self.load_cap is not None and self.load_cap < 1.0:
            raise ConfigError(f"task.load_cap={self.load_cap}: allowed values are null (no cap) or a number >= 1.0 "
                              "(max / mean device load)")
        if self.time_limit_s <= 0:
            raise ConfigError(f"task.time_limit_s={self.time_limit_s}: must be > 0 seconds")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.optimiser != "swap_search":
            out["time_limit_s"] = "read only with task.optimiser=swap_search"
        return out


@dataclass
class PlacementLoadTask(RoutedWorld):
    """task=placement_load: C_T and load of every placement and replica rule for a world that
    is computed in one process (:mod:`occult.tasks.placement_load`). The routing of
    :class:`RoutedWorld` (the placements built from ``profiling_split``, judged on ``split``),
    or ``max_over_mean`` > 0: the ``imbalance`` workload at that target (profiling set drawn
    at seed + 1). Occult's optimisers run at ``load_cap``, swap_search for ``time_limit_s``
    per layer; the affinity-aware EPLB packing at ``affinity_weight``."""

    max_over_mean: float = 0.0          # > 0: the imbalance workload at this received max / mean
    profiling_split: str = "train"
    load_cap: Optional[float] = 1.25
    time_limit_s: float = 2.0
    affinity_weight: float = 0.25

    entry: ClassVar[str] = "occult.tasks.placement_load.run_rank"
    uses_system: ClassVar[bool] = False          # it plans naive and occult itself

    def check(self) -> None:
        super().check()
        if self.max_over_mean and self.max_over_mean < 1.0:
            raise ConfigError(f"task.max_over_mean={self.max_over_mean}: allowed values are 0 (the routing) or "
                              ">= 1.0 (the imbalance workload)")
        if self.load_cap is not None and self.load_cap < 1.0:
            raise ConfigError(f"task.load_cap={self.load_cap}: allowed values are null (no cap) or a number >= 1.0")
        if self.time_limit_s <= 0:
            raise ConfigError(f"task.time_limit_s={self.time_limit_s}: must be > 0 seconds")
        if not self.affinity_weight >= 0:
            raise ConfigError(f"task.affinity_weight={self.affinity_weight}: must be >= 0")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.max_over_mean:
            for name in ("routing", "profiling_split", "sample_layers", "zipf_s", "trace", "source_tokens", "corpus",
                         "split", "seq_len", "routers", "synthetic_tokens", "total_tokens"):
                out.setdefault(name, "not read with task.max_over_mean set (the imbalance workload)")
        elif self.routing != "router":
            out["profiling_split"] = "read only with task.routing=router"
        return out

    def check_run(self, cfg) -> None:
        if self.max_over_mean:
            from ..workloads import max_over_mean_error
            err = max_over_mean_error(self.max_over_mean, cfg.model.num_experts, cfg.model.top_k,
                                      cfg.cluster.world_size)
            if err:
                raise ConfigError(err)
            return
        super().check_run(cfg)


@dataclass
class CalibrateTask(TaskConf):
    """task=calibrate: this world's loopback and matmul rate, for the cost model
    (:mod:`occult.tasks.calibrate`): ``iters`` timed calls per message size."""

    iters: int = 8

    entry: ClassVar[str] = "occult.tasks.calibrate.run_rank"
    uses_system: ClassVar[bool] = False

    def check(self) -> None:
        super().check()
        _at_least("iters", self.iters, 3)


@dataclass
class PretrainTask(TaskConf):
    """task=pretrain: pre-train a CPU proxy (one process; its settings are the top-level
    ``pretrain`` fields) and cache it (:mod:`occult.tasks.pretrain`)."""

    entry: ClassVar[str] = "occult.tasks.pretrain.run_rank"
    whole_model: ClassVar[bool] = True
    uses_system: ClassVar[bool] = False


# ---------------------------------------------------------------------------
# reading a task's config
# ---------------------------------------------------------------------------


def task_schema(path: str) -> type:
    """The schema class a task YAML's ``schema`` names."""
    from ..ep.system import import_object

    try:
        schema = import_object(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"task.schema={path!r} cannot be imported ({exc})") from exc
    if not (isinstance(schema, type) and issubclass(schema, TaskConf)):
        raise ConfigError(f"task.schema={path!r} is not a task schema (a subclass of occult.tasks.options.TaskConf)")
    return schema


def task_config(task) -> TaskConf:
    """The typed config of a task from a ``TaskConf``, a dict or a DictConfig."""
    if isinstance(task, TaskConf):
        return task
    d = OmegaConf.to_container(task, resolve=True) if isinstance(task, DictConfig) else dict(task)
    if not d.get("schema") or d["schema"] == MISSING:
        raise ConfigError(f"task={d.get('name')}: its YAML needs a 'schema' (the dotted path of its TaskConf)")
    schema = task_schema(d["schema"])
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), d))
    except Exception as exc:  # noqa: BLE001 - an OmegaConf error: one line naming the field
        raise ConfigError(f"task={d.get('name')}: {str(exc).splitlines()[0]}; its fields: "
                          f"{schema.option_names()}") from exc


def check_task(task) -> TaskConf:
    """The task's typed config, after its checks and the refusal of fields these values
    leave unread but that are set away from their defaults."""
    typed = task_config(task)
    typed.check()
    defaults = {f.name: f for f in dataclasses.fields(typed)}
    for name, why in typed.unread().items():
        f = defaults[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(typed, name)
        if value != default:
            raise ConfigError(f"task.{name}={value!r}: task={typed.name} does not read it here ({why}); "
                              f"leave it at {default!r}")
    return typed
