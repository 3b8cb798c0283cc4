"""Activation memory, measured: the bytes autograd keeps from forward for backward.

Every tensor that the forward pass saves for backward passes through a
``saved_tensors_hooks`` pack hook; their distinct storages, minus the module's
parameters, are the activation memory that lives between forward and backward.
"""
from __future__ import annotations

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
