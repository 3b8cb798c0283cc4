"""Compressed payloads for the row exchanges: rows cross as bfloat16, int8 or fp8 (with a
per-row scale) instead of their own dtype, and every byte is counted at its wire size.

Wire formats, one row each (a row of ``D`` hidden values; ``X`` trailing metadata
values that travel exactly, e.g. Occult's gate weights):

* ``fp32``: the rows as they are, in their own dtype (uncompressed; the name of the
  default, exact setting: a float32 run's rows cross as float32);
* ``bf16``: D bfloat16 values, then the X metadata values as float32 bit patterns
  (2 bfloat16 slots each);
* ``int8``: D int8 values ``round(x / s)`` with s = max|x| / 127 (symmetric, per row),
  then s and the X metadata values as float32 bytes: D + 4 + 4X bytes;
* ``fp8``: D float8 (e4m3) values ``x / s`` with s = max|x| / 448, then s and the
  metadata as float32 bytes: D + 4 + 4X bytes.

:func:`occult.ep.comm.all_to_all_rows` with a ``payload`` other than ``fp32`` runs an
accounted all-to-all of the rows encoded here (:func:`encode`) and decodes them
(:func:`decode`); its backward sends the gradients in the same payload (the metadata's
gradients exactly). A system's payload options are :class:`occult.ep.system.PayloadConfig`.
This module is the codec only: it imports nothing of the project. Shapes: R rows, D hidden
values, X metadata values, W wire columns.
"""
from __future__ import annotations

import torch

PAYLOADS = ("fp32", "bf16", "int8", "fp8")
_FP8 = torch.float8_e4m3fn
_QMAX = {"int8": 127.0, "fp8": float(torch.finfo(_FP8).max)}
SCALE_BYTES = 4


def _bytes_of(t_RX: torch.Tensor) -> torch.Tensor:
    """float32 values as their bytes: [R, X] -> [R, 4X] (uint8)."""
    return t_RX.float().contiguous().view(torch.uint8)


def encode(x_RD: torch.Tensor, payload: str, meta_RX: torch.Tensor) -> torch.Tensor:
    """The wire rows of ``x_RD`` (and ``meta_RX``, exact) in ``payload``: [R, W]."""
    if payload == "bf16":
        return torch.cat([x_RD.to(torch.bfloat16), meta_RX.float().contiguous().view(torch.bfloat16)], dim=1)
    qmax = _QMAX[payload]
    scale_R1 = (x_RD.detach().abs().amax(dim=1, keepdim=True).float() / qmax).clamp_min(1e-30)
    scaled_RD = x_RD.float() / scale_R1
    if payload == "int8":
        q_RD = scaled_RD.round().clamp(-qmax, qmax).to(torch.int8).view(torch.uint8)
    else:
        q_RD = scaled_RD.clamp(-qmax, qmax).to(_FP8).view(torch.uint8)
    return torch.cat([q_RD, _bytes_of(scale_R1), _bytes_of(meta_RX)], dim=1)


def decode(wire_RW: torch.Tensor, payload: str, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_RD, meta_RX)`` from wire rows: the hidden values in ``dtype``, the metadata as float32."""
    D = hidden
    if payload == "bf16":
        return wire_RW[:, :D].to(dtype), wire_RW[:, D:].contiguous().view(torch.float32)
    q_RD = wire_RW[:, :D]
    scale_R1 = wire_RW[:, D:D + SCALE_BYTES].contiguous().view(torch.float32)
    meta_RX = wire_RW[:, D + SCALE_BYTES:].contiguous().view(torch.float32)
    values = q_RD.contiguous().view(torch.int8).float() if payload == "int8" else q_RD.contiguous().view(_FP8).float()
    return (values * scale_R1).to(dtype), meta_RX


def meta_bytes_per_row(payload: str, meta_cols: int) -> int:
    """Wire bytes of a row that are not hidden values: the scale and the metadata."""
    if payload == "bf16":
        return 4 * meta_cols
    return SCALE_BYTES + 4 * meta_cols


def wire_row_bytes(payload: str, hidden: int, meta_cols: int, element_bytes: int) -> tuple[int, int]:
    """``(row bytes, metadata bytes)`` of one row of ``hidden`` values and ``meta_cols``
    metadata values (``element_bytes`` each in the rows' own dtype) as it crosses in
    ``payload``: what :func:`encode` makes of it (``fp32``: the row as it is)."""
    if payload == "fp32":
        return (hidden + meta_cols) * element_bytes, meta_cols * element_bytes
    if payload == "bf16":
        return 2 * (hidden + 2 * meta_cols), meta_bytes_per_row(payload, meta_cols)
    return hidden + SCALE_BYTES + 4 * meta_cols, meta_bytes_per_row(payload, meta_cols)
