"""A system is one typed config and one class.

Each system class (a :class:`occult.ep.dispatcher.Dispatcher`) nests its options as a
dataclass named ``Config``, a subclass of :class:`SystemConfig`; every option and its
default are declared there, once. ``conf/system/<name>.yaml`` names the system and
its class (``name``, ``_target_``); :func:`occult.config.register` puts every such
class's ``Config`` in Hydra's ConfigStore, so a misspelt or mistyped option fails
when the config is composed.

:meth:`SystemConfig.build` is the one way to make a system for an MoE layer (tasks,
models, parity and the benchmark all call it): the layer's placement, then the class.
A system that keeps the model's own MoE blocks (the no-EP reference) is a config
whose ``build`` returns None. A system whose rows may cross compressed nests a
:class:`PayloadConfig` (the wire codec itself is :mod:`occult.ep.payload`, beside the
collectives that use it).

The core knows no system by name: it imports a system's class from ``_target_``.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..columns import LATER
from ..errors import ConfigError
from .capabilities import Capabilities, check_declared
from .payload import PAYLOADS
from .placement import Placement
from .replica_rules import REPLICA_POLICIES

if TYPE_CHECKING:          # the collectives' group, for typing only: comm.py is below systems' configs
    from .comm import EPGroup


def import_object(path: str):
    """``'pkg.mod.Name'`` -> the object (nested names allowed: ``'pkg.mod.Cls.Inner'``)."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ImportError(f"no module named {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        outer = import_object(module)        # 'pkg.mod.Cls' + 'Inner'
        return getattr(outer, name)


def divisors(n: int) -> list[int]:
    return [p for p in range(1, n + 1) if n % p == 0]


@dataclass
class SystemConfig:
    """The options of one system; subclasses add theirs (typed, with their defaults).

    ``name`` is the system's config name (the ``system`` column of every row),
    ``_target_`` its class. The methods say what the options mean for a run; what the
    class can do is its :class:`occult.ep.capabilities.Capabilities` record
    (:meth:`capabilities`).
    """

    name: str = MISSING
    _target_: str = MISSING

    def system_class(self) -> type:
        """The class that ``_target_`` names."""
        return import_object(self._target_)

    def capabilities(self) -> Capabilities:
        """The system's capability record: its class's (a wrapper answers with its base's
        where the base runs the layer)."""
        return check_declared(self.system_class())

    @property
    def expert_parallel(self) -> bool:
        """Whether build() makes a dispatcher (False: the model's own MoE blocks, no EP)."""
        return self.capabilities().expert_parallel

    @property
    def accepts_dropped_pairs(self) -> bool:
        """Whether the system takes routing with dropped pairs (ids = occult.ep.router.NO_EXPERT)."""
        return self.capabilities().dropped_pairs

    @property
    def slot_placements(self) -> bool:
        """Whether the system runs on a slot placement (:class:`occult.ep.placement.SlotPlacement`:
        copies of experts, each pair served by the copy its replica rule picks)."""
        return bool(self.capabilities().replica_rules)

    def is_static(self) -> bool:
        """Whether the options ask for the static dispatch (:class:`occult.ep.static.StaticConfig`)."""
        return False

    def compressed(self) -> bool:
        """Whether either exchange's rows cross compressed (:class:`PayloadConfig`)."""
        return False

    def replica_rule(self) -> str:
        """The replica rule that picks a copy on a slot placement (:class:`ReplicaConfig`);
        a system without slots has one device per expert: ``round_robin`` picks it."""
        return "round_robin"

    @property
    def impl(self) -> str:
        """``harness`` or ``library``: who runs the scheme (the ``impl`` column)."""
        return self.capabilities().impl

    def impl_for(self, world_size: int) -> str:
        """Who runs the scheme in a run of ``world_size`` ranks (a system that uses a library
        only where it can says so here)."""
        return self.impl

    @property
    def precision(self) -> str:
        """``float64`` or ``float32``: the floating-point type of the system's own arithmetic
        (``Dispatcher.precision``), the key of its parity tolerance."""
        return self.capabilities().precision

    def options(self) -> dict:
        """Every option but ``name`` and ``_target_``, and an option added later
        (:func:`occult.columns.later`) while it holds the value results were written with
        before it existed: rows of one config keep one ``system_options``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("name", "_target_")
                and not (LATER in f.metadata and getattr(self, f.name) == f.metadata[LATER])}

    def options_json(self) -> str:
        """The options as canonical JSON (sorted keys): the ``system_options`` column."""
        return json.dumps(self.options(), sort_keys=True, default=str)

    def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
        """Raises ``ValueError`` naming the field (one line) when this system cannot run
        the shape with these options. Subclasses add their option checks."""
        if num_experts % world_size:
            raise ValueError(
                f"model.num_experts={num_experts} is not divisible by the world size {world_size} "
                f"(cluster); system '{self.name}' needs equal expert groups. "
                f"Allowed world sizes: {divisors(num_experts)}")

    def check_task(self, task: str) -> None:
        """Raises ``ValueError`` (one line) when this system cannot run ``task`` with these
        options (e.g. a file that only some tasks make for it)."""

    def is_exact(self) -> bool:
        """Whether the system with these options returns exactly top-k MoE (False for
        schemes that drop tokens or change the routing)."""
        return self.capabilities().exact_forward

    def lossless_options(self) -> dict:
        """For a lossy system: the options that switch its loss off (with them it must be
        exact, and the parity suite checks it against the reference); ``{}`` when it
        is exact already or its loss cannot be switched off."""
        return {}

    def sized(self, tokens_per_rank: int, force: bool = False) -> "SystemConfig":
        """The config for calls of at most ``tokens_per_rank`` tokens per rank: a system with
        fixed-size buffers (:class:`occult.ep.static.StaticConfig`) sizes them by it where its own
        option leaves them unset (always, with ``force``); the others are as they are."""
        return self

    def other_exact_paths(self) -> list:
        """Options that run the same exact result through other code (e.g. another kernel
        path): each dict of options is checked against the reference by the parity suite
        beside the defaults. ``[]`` when the system has one path."""
        return []

    def plan_refusal(self) -> str:
        """Why this system has no traffic plan (:meth:`occult.ep.dispatcher.Dispatcher.plan`),
        or "" when it has one."""
        return self.capabilities().why_not("traffic_plan")

    def layer_placement(self, layer: int, num_experts: int, world_size: int) -> Placement:
        """The placement of MoE layer ``layer`` (contiguous unless a system says otherwise,
        e.g. from a placement artifact named in its options)."""
        return Placement.contiguous(num_experts, world_size)

    def build(self, ep: "EPGroup", layer: int, num_experts: int, placement: Optional[Placement] = None):
        """This rank's system for MoE layer ``layer``: a dispatcher with the layer's
        placement (``placement`` overrides it), or None for a system without one."""
        placement = (placement or self.layer_placement(layer, num_experts, ep.world_size)).to(ep.device)
        return self.system_class()(ep, self.bind_placement(placement), self)

    def bind_placement(self, placement):
        """The placement the system runs on (a system with a replica rule binds it to a slot
        placement: :class:`ReplicaConfig`); this one as it is by default."""
        return placement


@dataclass
class PayloadConfig(SystemConfig):
    """Options mixin of a system whose dispatch and combine rows may cross compressed
    (the wire formats: :mod:`occult.ep.payload`)."""

    payload: str = "fp32"      # fp32 (rows as they are) | bf16 | int8 | fp8 (per-row scale)
    # the combine's payload; null: as ``payload`` (DeepEP's low-latency mode: fp8 / bf16)
    combine_payload: Optional[str] = None

    def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
        super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
        takes = [p for p in PAYLOADS if p in self.capabilities().payloads]
        for key, value in (("payload", self.payload), ("combine_payload", self.combine_payload)):
            if value not in takes and not (key == "combine_payload" and value is None):
                raise ValueError(f"system.{key}={value!r}: allowed values are {takes}"
                                 + (" or null (as payload)" if key == "combine_payload" else ""))

    def lossless_options(self) -> dict:
        return {} if self.is_exact() else self.payload_off()

    def payload_off(self) -> dict:
        """The options that send the rows as they are (``{}`` when they already do)."""
        return {"payload": "fp32", "combine_payload": None} if self.compressed() else {}

    def payload_of(self, phase: str) -> str:
        """The payload of the ``dispatch`` or the ``combine`` rows."""
        return self.combine_payload or self.payload if phase == "combine" else self.payload

    def compressed(self) -> bool:
        """Whether either exchange's rows cross compressed."""
        return self.payload != "fp32" or self.payload_of("combine") != "fp32"

    def is_exact(self) -> bool:
        return not self.compressed() and super().is_exact()


@dataclass
class ReplicaConfig(SystemConfig):
    """Options mixin of a system that runs on a slot placement (copies of experts,
    :class:`occult.ep.placement.SlotPlacement`): which copy serves each pair
    (:mod:`occult.ep.replica_rules`). On a placement without copies every rule is the
    placement's one device per expert (the run logs a note, :meth:`replica_note`)."""

    replica_policy: str = "round_robin"    # round_robin | local_first | grace | collaborative
    slack: float = 0.1                     # collaborative: per-device cap (1 + slack) x mean load

    def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
        super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
        rules = [r for r in REPLICA_POLICIES if r in self.capabilities().replica_rules]
        if self.replica_policy not in rules:
            raise ValueError(f"system.replica_policy={self.replica_policy!r}: allowed values are {rules}")
        if not self.slack >= 0:
            raise ValueError(f"system.slack={self.slack}: must be >= 0 (the collaborative rule's per-device "
                             "load cap is (1 + slack) x the mean)")

    def replica_rule(self) -> str:
        return self.replica_policy

    def bind_placement(self, placement):
        return placement.with_rule(self.replica_policy, self.slack) if hasattr(placement, "with_rule") else placement

    def replica_note(self, has_copies: bool) -> str:
        """A note for a replica rule that has nothing to choose ("" otherwise)."""
        if has_copies or self.replica_policy == "round_robin":
            return ""
        return (f"system.replica_policy={self.replica_policy} has no effect here: the placement has no copies "
                "(task.placement=eplb with task.num_redundant > 0 makes some; not an error)")


def system_schema(cls: type) -> type:
    """The typed config class of a system class (its nested ``Config``); a class without a
    nested ``Config`` or its own capability record is not a system (one-line error)."""
    check_declared(cls)
    schema = getattr(cls, "Config", None)
    if not (isinstance(schema, type) and issubclass(schema, SystemConfig)):
        raise ConfigError(f"{cls.__module__}.{cls.__qualname__} is not a system: it needs a nested "
                          "Config dataclass that subclasses occult.ep.system.SystemConfig")
    return schema


def system_config(system) -> SystemConfig:
    """The typed config of a system from a ``SystemConfig``, a dict or a DictConfig
    (``name``, ``_target_`` and options). Errors are one line naming the field."""
    if isinstance(system, SystemConfig):
        return system
    d = OmegaConf.to_container(system, resolve=True) if isinstance(system, DictConfig) else dict(system)
    name, target = d.get("name"), d.get("_target_")
    if not name or not target or name == MISSING or target == MISSING:
        raise ConfigError("system: needs 'name' and '_target_' (see conf/system)")
    try:
        cls = import_object(target)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"system={name}: cannot import {target!r} ({exc})") from exc
    schema = system_schema(cls)
    allowed = [f.name for f in dataclasses.fields(schema) if f.name not in ("name", "_target_")]
    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), d)
        return OmegaConf.to_object(typed)
    except ConfigKeyError as exc:
        key = str(getattr(exc, "key", "") or "").split(".")[-1]
        raise ConfigError(f"system.{key}: unknown option of system '{name}'; allowed: {allowed}") from exc
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "key", "") or "")
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"system.{key}: {msg} (system '{name}'; options: {allowed})") from exc
