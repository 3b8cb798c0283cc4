"""What a static step may not do: read a tensor on the host, or wait for the device.

A static step (:mod:`occult.ep.static`) runs without one synchronisation of the host with
the device, so that a GPU runs it ahead of the host and a CUDA graph can capture it. On
CUDA, ``torch.cuda.set_sync_debug_mode("error")`` refuses what synchronises (``make
gpu-check``); on any device, :func:`no_host_sync` refuses by name, inside its block, what
would synchronise on a GPU:

* host reads: ``item``, ``tolist``, ``numpy``, a Python number, truth value, index or
  string of a tensor, ``cpu`` / ``cuda`` / ``pin_memory``, ``to`` or ``copy_`` naming a
  device (a static step's tensors are on the rank's device from the start: placements and
  their tables move when the system is built), a tensor made from host data
  (``torch.tensor``, ``as_tensor``, ``new_tensor``: a host-to-device copy);
* answers given on the host: ``torch.equal``, ``allclose``, ``is_nonzero``;
* outputs whose shape depends on the data (their size is read back before the output is
  made): ``nonzero``, ``argwhere``, one-argument ``where``, ``masked_select``, ``unique``,
  ``unique_consecutive``, ``bincount``, ``histc``, ``repeat_interleave`` of tensor repeats
  without ``output_size``, and indexing (read or write) with a boolean mask;
* the synchronised clock (:func:`occult.ep.measure.clock`, :func:`~occult.ep.measure.between`):
  a static step's recorder times by marks (``Recorder(marks=True)``).

It is a :class:`torch.overrides.TorchFunctionMode` (every torch function and tensor method
called in the block's thread, the autograd backward of Python functions included) and a
hook of :mod:`occult.ep.measure`. What it cannot see: a kernel's own synchronisation
inside a library, and a ``.to`` of a host tensor that the code does not call because the
tensor already is on this CPU rank's device (set_sync_debug_mode sees both on a GPU).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from . import measure


class HostSync(RuntimeError):
    """Something inside :func:`no_host_sync` would synchronise the host with the device."""


READS = frozenset({"item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__complex__",
                   "__repr__", "__str__", "__format__", "__array__", "__contains__", "cpu", "cuda", "pin_memory"})
HOST_ANSWERS = frozenset({"equal", "allclose", "is_nonzero"})
DATA_SHAPED = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "histc",
                         "_unique", "_unique2"})
FROM_HOST = frozenset({"tensor", "as_tensor", "new_tensor", "asarray", "from_numpy"})
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_", "index"})


def _names_a_device(args, kwargs) -> bool:
    """Whether a ``to`` call's arguments name a device (a string, a device, a tensor whose
    device it copies), not only a dtype."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args)


def _has_mask(index) -> bool:
    """Whether an index (a tensor, or a tuple / list of them) holds a boolean mask."""
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_has_mask(i) for i in index)
    return False


def sync_of(name: str, args: tuple, kwargs: dict) -> str:
    """Why calling torch function ``name`` with ``args`` and ``kwargs`` would synchronise a GPU
    (``""``: it would not)."""
    if name in READS:
        return f"Tensor.{name} reads a tensor on the host"
    if name in HOST_ANSWERS:
        return f"torch.{name} answers on the host"
    if name in DATA_SHAPED:
        return f"torch.{name} makes an output whose shape depends on the data"
    if name in FROM_HOST:
        return f"torch.{name} copies host data to the device"
    if name == "to" and _names_a_device(args[1:], kwargs):
        return "Tensor.to names a device (a copy between host and device)"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].device != args[0].device:
        return "Tensor.copy_ copies between devices"
    if name == "where" and len(args) + len(kwargs) == 1:
        return "torch.where(condition) makes an output whose shape depends on the data"
    if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
        if isinstance(repeats, torch.Tensor):
            return "torch.repeat_interleave without output_size makes an output whose shape depends on the data"
    if name in INDEXING and len(args) > 1 and _has_mask(args[1]):
        return f"Tensor.{name} with a boolean mask makes a shape that depends on the data"
    return ""


class _Refusing(TorchFunctionMode):
    """Raises :class:`HostSync` at the first torch call that :func:`sync_of` names."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = sync_of(getattr(func, "__name__", ""), args, kwargs)
        if why:
            raise HostSync(f"{why} inside {self.where}")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync(where: str = "a static step"):
    """Inside, what would synchronise a GPU raises :class:`HostSync` (the module docstring)
    naming it and ``where``; the synchronised clock too."""
    def refuse(what: str) -> None:
        raise HostSync(f"{what} inside {where}")

    previous, measure.ON_SYNC = measure.ON_SYNC, refuse
    try:
        with _Refusing(where):
            yield
    finally:
        measure.ON_SYNC = previous
