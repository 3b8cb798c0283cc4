"""Memory, measured: the bytes autograd keeps from forward for backward, and the peak
memory of a block of work.

Every tensor that the forward pass saves for backward passes through a
``saved_tensors_hooks`` pack hook; their distinct storages, minus the module's
parameters, are the activation memory that lives between forward and backward.
:func:`peak_memory` measures a block's peak: the device allocator's on CUDA, the
process's resident set on a CPU (Linux: its high-water mark, reset before the block).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


def saved_activation_bytes(module: nn.Module, *args, **kwargs) -> int:
    """Runs ``module(*args, **kwargs)`` once and returns the bytes of distinct
    non-parameter storages saved for its backward."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    del out
    return int(sum(seen.values()))


@dataclass
class PeakMemory:
    """What :func:`peak_memory` measured, in bytes: ``peak`` during the block (the whole
    process's on a CPU, the device allocator's on CUDA), ``start`` when it began (so
    ``peak - start`` is what the block added at its worst); -1 where it cannot be measured."""

    peak: int = -1
    start: int = -1


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else -1


@contextmanager
def peak_memory(device) -> Iterator[PeakMemory]:
    """Measures the peak memory of the enclosed block on ``device``: ``with peak_memory(dev)
    as mem: ...; mem.peak``."""
    device = torch.device(device)
    out = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out.start = torch.cuda.memory_allocated(device)
        try:
            yield out
        finally:
            torch.cuda.synchronize(device)
            out.peak = torch.cuda.max_memory_allocated(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")     # resets the high-water mark (Linux)
        out.start = _status_kib("VmRSS") * 1024
    except OSError:                                        # not Linux: not measured (-1)
        yield out
        return
    try:
        yield out
    finally:
        out.peak = _status_kib("VmHWM") * 1024
