"""system=reference: the model as the transformers library runs it, without expert parallelism.

The paper's "HuggingFace" row. Every rank holds the whole model, every expert
included, and runs the library's own MoE block (its router, its per-expert loop)
on its own sequences; nothing is exchanged between ranks in the MoE layers. In
``task=train`` all gradients are averaged over ranks (plain data parallelism),
so a step is the step on all ranks' sequences together, as for the EP systems.

It runs whole models only (``task=prefill``, ``decode``, ``train``); ``task=layer``
needs a dispatcher and is refused at validation time.
"""
from __future__ import annotations

from dataclasses import dataclass

from occult.ep import SystemConfig
from occult.ep.capabilities import Capabilities


class ReferenceModel:
    """The single-device model system: no dispatcher (its config builds none), no options."""

    capabilities = Capabilities(
        impl="library", precision="float64", expert_parallel=False, exact_forward=True, exact_backward=True,
        static_dispatch="it runs no expert parallelism (the model's own MoE blocks)",
        co_execution=True,
        yields=True,
        traffic_plan="it runs no expert parallelism (the model's own MoE blocks)",
        migration="it runs no expert parallelism (the model's own MoE blocks)",
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(SystemConfig):
        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            """Any expert count runs on any number of ranks: each holds all experts."""

        def build(self, ep, layer, num_experts, placement=None):
            """None: every rank keeps the model's own MoE blocks."""
            return None
