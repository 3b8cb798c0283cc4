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


class ReferenceModel:
    """Marker class of the single-device model system: no dispatcher, no options."""

    name = "reference"
    impl = "library"
    exact = True
    expert_parallel = False

    def __init__(self) -> None:
        pass

    @classmethod
    def check_config(cls, *, num_experts: int, top_k: int, world_size: int, **options) -> None:
        """Any expert count runs on any number of ranks: each holds all experts."""
        if options:
            raise ValueError(f"system=reference takes no options; got {sorted(options)}")
