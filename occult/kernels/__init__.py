"""Optional GPU kernels (Triton), imported lazily: nothing here is needed on a CPU."""
from __future__ import annotations

import importlib.util
import os

# the row dtypes the Triton kernels take (tl.dot has no float64: such rows take the PyTorch path)
TRITON_DTYPES = ("float16", "bfloat16", "float32")


def triton_takes(dtype) -> bool:
    """True when the Triton kernels have a path for ``dtype`` (a torch dtype)."""
    return str(dtype).removeprefix("torch.") in TRITON_DTYPES


def triton_available() -> bool:
    """True when the triton package imports (CUDA, or its interpreter with TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor) -> bool:
    """The Triton path runs only on CUDA tensors (or under the Triton interpreter)."""
    if not triton_available():
        return False
    return bool(tensor.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1"
