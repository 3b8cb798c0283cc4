"""CUDA graphs of the static decode step of an MoE layer (``task.cuda_graph=true``).

A static dispatch (:mod:`occult.ep.static`) has fixed shapes and reads nothing on the host,
so one call of an MoE block on a decode step's [B, D] can be captured once in a CUDA graph
(router, the fixed-buffer exchanges, the experts, the combine) and replayed on every
later step with the new hidden states copied into the captured input. Capture and replay
run without a recorder (a recorder's clock synchronises the device, which a capture may
not do): the replayed steps log no collectives (their traffic is the captured step's, the
same fixed buffers), only the task's step times.

Needs CUDA (NCCL collectives are captured as they are; gloo's cannot be): validation
refuses ``task.cuda_graph=true`` elsewhere (:func:`refusal`). Checked by ``make gpu-check``
(step ``cuda_graphs``), never run on this project's CPU machine.

Shapes: T tokens of a call (B on a decode step), D hidden.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .accounting import recording
from .static import runs_static


def refusal(backend: str, static: bool, cuda: bool) -> str:
    """Why a run with ``task.cuda_graph=true`` cannot capture its decode steps ("" when it can):
    ``backend``: the cluster's; ``static``: the system's dispatch is static; ``cuda``:
    torch sees a CUDA device."""
    if not cuda or backend != "nccl":
        why = "torch.cuda.is_available() is False" if not cuda else f"cluster.backend={backend} runs on the CPU"
        return (f"task.cuda_graph=true captures the decode step in a CUDA graph, which needs CUDA ranks "
                f"(cluster=gpuN, backend nccl); {why}. Allowed value here: false")
    if not static:
        return ("task.cuda_graph=true needs system.dispatch_mode=static (a dynamic dispatch reads split sizes "
                "on the host, which a CUDA graph cannot capture); allowed: a system with dispatch_mode=static, "
                "or task.cuda_graph=false")
    return ""


class GraphedCall:
    """``fn(*inputs)`` captured once in a CUDA graph on copies of ``example``; calling it copies
    new inputs (same shapes) into the captured ones, replays, and returns a copy of the output."""

    def __init__(self, fn: Callable, example: Sequence[torch.Tensor], warmup: int = 2):
        self.inputs = [x.detach().clone() for x in example]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), recording(None):
            for _ in range(warmup):          # allocations and lazy initialisation, outside the capture
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), recording(None):
            self.output = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for captured, new in zip(self.inputs, inputs):
            captured.copy_(new)
        self.graph.replay()
        return self.output.clone()


class GraphedBlock(nn.Module):
    """An expert-parallel MoE block whose static calls without gradients run as CUDA graphs,
    one per input shape (a decode step's); every other call (the prompt, training) runs
    the block itself."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.graphs: dict = {}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not runs_static(self.block.dispatcher.config) \
                or hidden_states.device.type != "cuda":
            return self.block(hidden_states)
        key = (tuple(hidden_states.shape), hidden_states.dtype)
        if key not in self.graphs:
            self.graphs[key] = GraphedCall(self.block, [hidden_states])
        return self.graphs[key](hidden_states)


def graph_blocks(model: nn.Module, block_type: type) -> int:
    """Wraps every ``block_type`` module of ``model`` (in place) in a :class:`GraphedBlock`;
    returns how many."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, block_type) and not isinstance(parent, GraphedBlock)]
    for parent, name, child in found:
        setattr(parent, name, GraphedBlock(child))
    return len(found)
