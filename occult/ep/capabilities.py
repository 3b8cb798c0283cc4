"""What a system can do: one frozen record per system class.

Every system class declares ``capabilities = Capabilities(...)`` in its own body, every
field given (the record has no defaults and is never inherited: a class that declares none
is refused when its config is read, :func:`check_declared`). A capability a system may
lack holds ``True`` (it has it) or the one-line reason it does not (a ``str``);
:func:`refusal` turns that into the one-line error validation raises, naming the system
and the capability. Validation, the model's blocks, the traffic-plan checks, the
combination matrix (:mod:`occult.matrix`) and ``docs/systems.md``'s table read the
record; nothing probes a system's class or config for attributes.

A record is the class's answer for its default options; options narrow it (a config's
``is_exact``, a lossy option switched on) and a wrapper (``baselines/wrapped.py``) answers
with its base's record where the base runs the layer (:meth:`SystemConfig.capabilities`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple, Union

from ..errors import ConfigError

# True, or the reason the system does not have the capability
Can = Union[bool, str]

IMPLS = ("harness", "library")
PRECISIONS = ("float64", "float32")

# capability -> what a refusal says the system does not do
PHRASES = {
    "static_dispatch": "take system.dispatch_mode=static",
    "co_execution": "co-execute micro-batches",
    "traffic_plan": "have a traffic plan",
    "yields": "yield its collectives to another strand",
    "migration": "run with sequence migration (task.migration=true)",
    "exact_backward": "have an exact backward",
    "slots": "run on physical slots (task.placement=eplb)",
    "shortcut_overlap": "start a block's dispatch ahead of it on a shortcut model",
    "dropped_pairs": "take routing with dropped pairs",
    "expert_parallel": "run expert parallelism",
}


@dataclass(frozen=True)
class Capabilities:
    """One system class's capabilities (its default options). No field has a default."""

    impl: str                   # harness | library: who runs the scheme (the ``impl`` column)
    precision: str              # float64 | float32: its own arithmetic on a float64 problem
    expert_parallel: bool       # False: the model's own MoE blocks (the no-EP reference)
    exact_forward: bool         # returns exactly top-k MoE
    exact_backward: bool        # its gradients are the reference's
    static_dispatch: Can        # system.dispatch_mode=static (fixed buffers, no host read)
    co_execution: Can           # micro-batches as strands (task.microbatches > 1)
    yields: Can                 # its collectives yield to another strand (a library's do not)
    traffic_plan: Can           # Dispatcher.plan states its rows before it runs
    migration: Can              # task.migration=true (sequences moved before the first block)
    replica_rules: Tuple[str, ...]   # the replica rules it runs slot placements with; (): one device per expert
    payloads: Tuple[str, ...]        # the wire payloads it takes; ("fp32",): rows as they are
    dropped_pairs: bool         # takes routing with dropped pairs (a routing transform's)
    shortcut_overlap: bool      # starts a block's dispatch ahead of it on a shortcut model (ScMoE)

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"Capabilities.impl={self.impl!r}: allowed values are {list(IMPLS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Capabilities.precision={self.precision!r}: allowed values are {list(PRECISIONS)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "Can" and not (value is True or (isinstance(value, str) and value)):
                raise ValueError(f"Capabilities.{f.name}={value!r}: True or the reason the system lacks it")
        if "fp32" not in self.payloads:
            raise ValueError(f"Capabilities.payloads={self.payloads!r}: must hold 'fp32' (rows as they are)")

    def has(self, capability: str) -> bool:
        """Whether the record grants ``capability`` (a field of the record)."""
        value = getattr(self, capability)
        if capability == "slots":
            return bool(self.replica_rules)
        return value is True

    def why_not(self, capability: str) -> str:
        """The reason the system lacks ``capability`` ("" when it has it)."""
        if capability == "slots":
            return "" if self.replica_rules else "it runs one copy of each expert, on its own placement"
        value = getattr(self, capability)
        if value is True:
            return ""
        if value is False:
            return "its record says so"
        return value

    def as_row(self) -> dict:
        """The record as table cells (``docs/systems.md``): yes / no, the names in a tuple."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                out[f.name] = ", ".join(value) if value else "-"
            elif f.name in ("impl", "precision"):
                out[f.name] = value
            else:
                out[f.name] = "yes" if value is True else "no"
        return out


def refusal(system: str, caps: Capabilities, capability: str) -> str:
    """The one-line refusal of ``capability`` for ``system`` ("" when the record grants it):
    ``system=tutel does not co-execute micro-batches (...): <reason>``."""
    why = caps.why_not(capability)
    if not why:
        return ""
    return f"system={system} does not {PHRASES[capability]}: {why}"


class NoCapabilities(ConfigError):
    """A system class without its own capability record (refused when it is registered)."""


def check_declared(cls: type) -> Capabilities:
    """The record ``cls`` declares in its own body; :class:`NoCapabilities` (one line) when it
    declares none (an inherited record does not count) or declares something else."""
    caps = cls.__dict__.get("capabilities")
    where = f"{cls.__module__}.{cls.__qualname__}"
    if caps is None:
        raise NoCapabilities(f"system class {where} declares no capabilities: set capabilities = "
                        "occult.ep.capabilities.Capabilities(...) in its class body (every field; none is inherited)")
    if not isinstance(caps, Capabilities):
        raise NoCapabilities(f"system class {where}: capabilities must be an occult.ep.capabilities.Capabilities, "
                        f"not {type(caps).__name__}")
    return caps
