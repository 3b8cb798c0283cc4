"""What every task's config is made of: :class:`TaskConf`, the option groups tasks share, and
reading a task's config.

A task is one YAML file under ``conf/task`` (its ``name``, its ``schema`` and the defaults it
changes) and one module of ``occult/tasks`` that nests its ``Config`` (a subclass of
:class:`TaskConf`, as a system class nests its typed ``Config``) beside its entry ``run(ctx,
spec)``. The ``Config`` is the task's declaration: its fields are the options the task reads
(a field it does not read is not there, so setting one fails when the config is composed:
``task.backward: task=bench does not read it; its fields: ...``), and its class attributes say
what the runner needs to know (the rank function, the set-up in the launching process,
whether it runs a whole model, an expert-parallel layer, the top-level ``system``).
:func:`occult.config.register` stores every task's schema as ``task_schema/<name>``;
``conf/config.yaml`` merges the chosen task's schema under its YAML, as it does for systems.

The option groups here (:class:`Timed`, :class:`Gated`, :class:`Exchanges`,
:class:`Drawn`, :class:`LayerInputs`, :class:`AffinityPacked`, :class:`Placed`,
:class:`LoadCapped`, :class:`Corpus`, :class:`Text`, :class:`MicroBatched`, :class:`HeldOut`,
:class:`Compared`, :class:`Migrated`, :class:`Trained`, :class:`Generates`,
:class:`WithBackward`, :class:`SavesRouting`, :class:`Served`; the simulated world's
:class:`occult.tasks.world.RoutedWorld`) declare each shared field and its default once, with its checks. Some
fields are read only with some values of others (``task=bench_model`` reads
``task.new_tokens`` only for ``task.workload=decode``); :meth:`TaskConf.unread` names them,
and validation refuses one set away from its default.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf

from .. import CONF_DIR
from ..columns import column, later
from ..errors import ConfigError
from ..schemas import field_default
from ..synthetic import ROUTINGS
from ..workloads import MAX_OVER_MEAN_CAP


WORKLOAD_NAMES = ("prefill", "decode", "train")


def at_least(name: str, value, low) -> None:
    """Raises :class:`ConfigError` (one line naming the field) for ``value`` below ``low``."""
    if value < low:
        raise ConfigError(f"task.{name}={value}: must be at least {low}")


@dataclass
class TaskConf:
    """The fields every task has: its config name and the dotted path of its schema."""

    name: str = MISSING
    schema: str = MISSING

    # the rank function (``run(ctx, spec) -> rows``, spec: occult.spec.RunSpec) and the set-up
    # run once in the launching process first (``fn(spec) -> spec``; "" for none)
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
    # the task writes a file that later points of a sweep read (a placement): a launcher that
    # runs points side by side starts no later point before it ends
    writes_artifact: ClassVar[bool] = False

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

    # the context columns of every row that give the task's shape (occult.runner.run_context;
    # the settings among the columns are declared on their fields, occult.columns), each with
    # the value a task without that field writes
    NO_FIELD_COLUMNS: ClassVar[Dict[str, Any]] = {"tokens_per_rank": -1, "routing": "", "batch_size": -1,
                                                  "seq_len": -1}

    def columns(self, world_size: int) -> Dict[str, Any]:
        """This task's values of the context columns (:data:`NO_FIELD_COLUMNS` where it has
        no such field; a whole model without a ``routing`` field is routed by its routers)."""
        have = {f.name for f in dataclasses.fields(self)}
        out = {k: getattr(self, k) if k in have else v for k, v in self.NO_FIELD_COLUMNS.items()}
        if self.whole_model and "routing" not in have:
            out["routing"] = "router"
        return out

    def replayed_trace(self) -> Optional[str]:
        """The routing trace the task replays (None: it replays none)."""
        return None

    def routers_model_name(self) -> Optional[str]:
        """The conf/model whose routers route this task's world (None: the run's own model);
        the runner resolves it into :attr:`occult.spec.RunSpec.routers_model`."""
        return None

    def compared_names(self) -> List[str]:
        """The names of the systems the task compares (none: it runs the top-level system)."""
        return []

    def schedule(self) -> Dict[str, Any]:
        """The task's schedule of a whole model that the whole-model parity gate runs too
        (``microbatches``, ``grad_sync``: :func:`occult.parity.check_model`); none here."""
        return {}

    def schedule_changes(self) -> List[str]:
        """The task's settings, set away from their defaults, that make a whole model compute
        other than layer by layer, each layer as alone (what the whole-model gate checks)."""
        return []

    def trains(self) -> bool:
        """Whether the task's timed work trains (the whole-model gate then checks the backward)."""
        return False

    def is_default(self, name: str) -> bool:
        """Whether field ``name`` holds its schema default."""
        return getattr(self, name) == field_default(type(self), name)


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
        at_least("parity_tokens", self.parity_tokens, 1)

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
class Drawn(TaskConf):
    """The tokens of every rank and the routing sources the layer tasks (:class:`LayerInputs`)
    and the simulated world (:class:`occult.tasks.world.RoutedWorld`) share; each says which
    ``routing`` reads them."""

    tokens_per_rank: int = 512          # T of every rank
    zipf_s: float = 1.2                 # skew of routing=zipf
    trace: Optional[str] = None         # routing=trace: a routing.parquet, or a run folder holding one

    def check(self) -> None:
        super().check()
        if self.zipf_s < 0:
            raise ConfigError(f"task.zipf_s={self.zipf_s}: must be >= 0 (0 is uniform routing; larger is more skewed)")


@dataclass
class LayerInputs(Drawn):
    """One MoE layer's inputs: seeded tokens and synthetic (or router) routing; the load
    workloads (``imbalance``, ``incast``, ``trace``: :mod:`occult.workloads`)."""

    routing: str = "uniform"            # router | uniform | zipf | imbalance | incast | trace
    max_over_mean: float = later(2.0)   # routing=imbalance: dispatch received rows max / mean (contiguous)
    incast_device: int = later(0)       # routing=incast: the device whose experts draw ...
    incast_share: float = later(0.5)    # ... this share of every token's choices

    def check(self) -> None:
        super().check()
        if self.routing not in ROUTINGS:
            raise ConfigError(f"task.routing={self.routing!r}: allowed values are {list(ROUTINGS)}")
        at_least("tokens_per_rank", self.tokens_per_rank, 0)
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

    def replayed_trace(self) -> Optional[str]:
        return self.trace if self.routing == "trace" else None

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
class AffinityPacked(TaskConf):
    """The affinity-aware EPLB packing's weight (:mod:`occult.placement.affinity`)."""

    affinity_weight: float = 0.25       # eplb_affinity: the co-activation bonus (occult.placement.affinity)

    def check(self) -> None:
        super().check()
        if not self.affinity_weight >= 0:
            raise ConfigError(f"task.affinity_weight={self.affinity_weight}: must be >= 0")


@dataclass
class Placed(AffinityPacked):
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

    def check(self) -> None:
        super().check()
        if self.placement not in PLACEMENTS and not self.placement.endswith(".json"):
            raise ConfigError(f"task.placement={self.placement!r}: allowed values are {list(PLACEMENTS)} or the "
                              "path of a slot placement artifact (.json)")
        if self.num_redundant < 0:
            raise ConfigError(f"task.num_redundant={self.num_redundant}: must be >= 0 (extra physical slots)")

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
class LoadCapped(TaskConf):
    """The placement optimisers' load cap (:mod:`occult.placement`)."""

    load_cap: Optional[float] = 1.25    # max / mean device load (null: none)

    def check(self) -> None:
        super().check()
        if self.load_cap is not None and self.load_cap < 1.0:
            raise ConfigError(f"task.load_cap={self.load_cap}: allowed values are null (no cap) or a number >= 1.0 "
                              "(max / mean device load)")


@dataclass
class Corpus(TaskConf):
    """Windows of ``seq_len`` tokens of a text corpus."""

    seq_len: int = 128
    corpus: str = "shakespeare"

    def check(self) -> None:
        super().check()
        at_least("seq_len", self.seq_len, 1)


@dataclass
class Text(Corpus):
    """Sequences of a text corpus (held-out windows, or training batches)."""

    batch_size: int = 4                 # sequences per rank

    def check(self) -> None:
        super().check()
        at_least("batch_size", self.batch_size, 1)

    def call_tokens(self) -> int:
        """The most tokens one rank's layer call holds in the timed work (what a system with
        fixed buffers is sized by): the batch, B S."""
        return self.batch_size * self.seq_len


@dataclass
class MicroBatched(Text, Exchanges):
    """Micro-batch co-execution (DHelix; two-batch overlap): the rank's ``batch_size``
    sequences cut into ``microbatches`` micro-batches that run as strands, one's collectives
    in flight while another computes (:mod:`occult.ep.strands`); 1: the batch at once."""

    microbatches: int = column(1, later=1)

    def schedule(self) -> Dict[str, Any]:
        return {**super().schedule(), "microbatches": self.microbatches}

    def schedule_changes(self) -> List[str]:
        mine = [] if self.is_default("microbatches") else [f"task.microbatches={self.microbatches}"]
        return mine + super().schedule_changes()

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


@dataclass
class Compared(TaskConf):
    """Systems side by side in one world (:mod:`occult.tasks.bench`): ``compare``, each a
    conf/system name or a system config (``{name: occult, kernels: epd}``); the first is the
    baseline. Such a task runs no top-level system."""

    compare: List[Any] = field(default_factory=lambda: ["naive", "occult"])

    uses_system: ClassVar[bool] = False

    def compared_names(self) -> List[str]:
        return [s if isinstance(s, str) else s.get("name", "?") for s in self.compare]


@dataclass
class Migrated(TaskConf):
    """Luffy's sequence migration (:mod:`occult.tasks.migration`): before the first decoder
    block each sequence moves, once per step, to the rank that holds most of its (token,
    expert) pairs (predicted from the previous step's routing); its outputs return home."""

    migration: bool = column(False, later=False)

    def schedule_changes(self) -> List[str]:
        mine = [] if self.is_default("migration") else [f"task.migration={str(self.migration).lower()}"]
        return super().schedule_changes() + mine

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
class Trained(TaskConf):
    """The optimiser's learning rate (AdamW)."""

    lr: float = 1e-3


@dataclass
class Generates(TaskConf):
    """Greedy generation: ``new_tokens`` tokens after the prompts."""

    new_tokens: int = 16

    def check(self) -> None:
        super().check()
        at_least("new_tokens", self.new_tokens, 0)


@dataclass
class WithBackward(TaskConf):
    """The backward pass too (task=layer times it; task=simulate plans its collectives)."""

    backward: bool = True


@dataclass
class SavesRouting(TaskConf):
    """A whole model's routing written to the run folder."""

    save_routing: bool = False          # write routing.parquet (+ router logits)


@dataclass
class Served(Timed, Gated, Placed, MicroBatched, HeldOut, Migrated, SavesRouting):
    """A whole model serving held-out prompts (task=prefill, task=decode: the iterations of
    :mod:`occult.tasks.model`)."""

    prepare: ClassVar[str] = "occult.tasks.model.prepare"
    whole_model: ClassVar[bool] = True


def task_schema(path: str) -> type:
    """The schema class a task YAML's ``schema`` names (a task module's ``Config``)."""
    from ..ep.system import import_object

    try:
        schema = import_object(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"task.schema={path!r} cannot be imported ({exc})") from exc
    if not (isinstance(schema, type) and issubclass(schema, TaskConf)):
        raise ConfigError(f"task.schema={path!r} is not a task schema (a subclass of occult.tasks.schema.TaskConf)")
    return schema


def task_config(task) -> TaskConf:
    """The typed config of a task from a ``TaskConf``, a dict or a DictConfig."""
    if isinstance(task, TaskConf):
        return task
    d = OmegaConf.to_container(task, resolve=True) if isinstance(task, DictConfig) else dict(task)
    if not d.get("schema") or d["schema"] == MISSING:
        raise ConfigError(f"task={d.get('name')}: its YAML needs a 'schema' (the dotted path of its task module's Config)")
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
    for name, why in typed.unread().items():
        default = field_default(type(typed), name)
        value = getattr(typed, name)
        if value != default:
            raise ConfigError(f"task.{name}={value!r}: task={typed.name} does not read it here ({why}); "
                              f"leave it at {default!r}")
    return typed


def named_task_schema(name: str) -> type:
    """The schema of the task ``conf/task/<name>.yaml`` declares (its ``schema``): the tasks'
    registry, as the runner reads it."""
    path = CONF_DIR / "task" / f"{name}.yaml"
    return task_schema((yaml.safe_load(path.read_text()) or {}).get("schema", ""))


def workload_task(t: TaskConf, workload: str) -> TaskConf:
    """The config of ``workload``'s own task (prefill, decode or train: :data:`WORKLOAD_NAMES`)
    with task ``t``'s values of the fields the two share and that task's defaults for the
    rest (its schedule: the batch at once, the gradient sync at the end; nothing saved):
    what a task that runs a workload's iterations (task=bench_model, task=finetune's timing
    probe) hands them."""
    cls = named_task_schema(workload)
    mine = {f.name for f in dataclasses.fields(t)} - {"name", "schema"}
    shared = {f.name: getattr(t, f.name) for f in dataclasses.fields(cls) if f.name in mine}
    return cls(name=workload, schema=f"{cls.__module__}.{cls.__qualname__}", **shared)
