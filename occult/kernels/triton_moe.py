"""Triton kernels for Occult's GPU path.

* ``gather_grouped_mm``: for expert-grouped rows given as indices into a source
  buffer (the received SFD rows), ``out[q] = src[index[q]] @ W[expert(q)]``,
  reading the rows straight from the source: EPD is never materialised.
* ``weighted_scatter_add``: ``out[index[q]] += w[q] * y[q]`` with FP32 atomic adds
  (the merge EPD -> SFD, and SFD -> ORI with w = 1).

Both take float16, bfloat16 or float32 rows and refuse float64 (``tl.dot`` has no float64
matrix instruction: the dispatcher's ``kernels=auto`` takes the PyTorch path for it). A
float32 product runs at IEEE precision (``input_precision="ieee"``), not Triton's default
TF32 (about 5e-4 relative error), so the float32 parity checks at 1e-4 hold on a GPU too.

Both are forward kernels; the autograd wrappers in :mod:`occult.kernels.fused`
compute the backward with PyTorch ops. Their logic is tested on the CPU under
the Triton interpreter (``TRITON_INTERPRET=1``).

Shapes: Q grouped rows, R source rows, D input width, N output width, e experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import TRITON_DTYPES

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32
# the dot products' precision per input dtype (one for each of TRITON_DTYPES): IEEE float32,
# not TF32; the half types take the tensor cores' products (the argument only matters for float32)
DOT_PRECISION = {torch.float32: "ieee", torch.bfloat16: "tf32", torch.float16: "tf32"}


def _check_dtype(what: str, dtype: torch.dtype) -> None:
    """Refuses a dtype the kernels have no path for (float64: ``tl.dot`` has none)."""
    if dtype not in DOT_PRECISION:
        raise TypeError(f"{what}: the Triton kernels take {', '.join(TRITON_DTYPES)} rows, not "
                        f"{str(dtype).removeprefix('torch.')} (tl.dot has no float64); use the PyTorch "
                        f"path (system.kernels=auto or torch)")


@triton.jit
def _gather_grouped_mm_kernel(src_ptr, index_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_start_ptr,
                              tile_end_ptr, D, N, stride_sr, stride_sd, stride_we, stride_wd, stride_wn,
                              stride_oq, stride_on, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    offs_m = start + tl.arange(0, BM)
    mask_m = offs_m < end
    rows = tl.load(index_ptr + offs_m, mask=mask_m, other=0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < D
        a = tl.load(src_ptr + rows[:, None] * stride_sr + offs_k[None, :] * stride_sd,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptr + expert * stride_we + offs_k[:, None] * stride_wd + offs_n[None, :] * stride_wn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(out_ptr + offs_m[:, None] * stride_oq + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _weighted_scatter_add_kernel(y_ptr, w_ptr, index_ptr, out_ptr, Q, D, stride_yq, stride_yd, stride_or,
                                 stride_od, BQ: tl.constexpr, BD: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_q = pid_q * BQ + tl.arange(0, BQ)
    mask_q = offs_q < Q
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    mask = mask_q[:, None] & mask_d[None, :]
    y = tl.load(y_ptr + offs_q[:, None] * stride_yq + offs_d[None, :] * stride_yd, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs_q, mask=mask_q, other=0.0)
    rows = tl.load(index_ptr + offs_q, mask=mask_q, other=0)
    tl.atomic_add(out_ptr + rows[:, None] * stride_or + offs_d[None, :] * stride_od,
                  y.to(tl.float32) * w.to(tl.float32)[:, None], mask=mask)


def _tiles(counts_e: torch.Tensor, block_m: int):
    """Row tiles of each expert's segment: (expert, start, end) per tile, built without loops."""
    ends = torch.cumsum(counts_e, 0)
    starts = ends - counts_e
    ntiles = (counts_e + block_m - 1) // block_m
    tile_expert = torch.repeat_interleave(torch.arange(counts_e.numel(), device=counts_e.device), ntiles)
    first = torch.cumsum(ntiles, 0) - ntiles
    local = torch.arange(tile_expert.numel(), device=counts_e.device) - first[tile_expert]
    return tile_expert, starts[tile_expert] + local * block_m, ends[tile_expert]


def gather_grouped_mm(src_RD: torch.Tensor, index_Q: torch.Tensor, counts_e: torch.Tensor,
                      w_eDN: torch.Tensor) -> torch.Tensor:
    """``out[q] = src[index[q]] @ w[e]`` for the q in expert e's segment: -> [Q, N]."""
    _check_dtype("gather_grouped_mm", src_RD.dtype)
    Q, (D, N) = index_Q.numel(), w_eDN.shape[1:]
    out = src_RD.new_empty((Q, N))
    if Q == 0:
        return out
    tile_expert, tile_start, tile_end = _tiles(counts_e.to(src_RD.device), BLOCK_M)
    grid = (tile_expert.numel(), triton.cdiv(N, BLOCK_N))
    _gather_grouped_mm_kernel[grid](src_RD, index_Q, w_eDN, out, tile_expert, tile_start, tile_end, D, N,
                                    src_RD.stride(0), src_RD.stride(1), w_eDN.stride(0), w_eDN.stride(1),
                                    w_eDN.stride(2), out.stride(0), out.stride(1),
                                    BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, PRECISION=DOT_PRECISION[src_RD.dtype])
    return out


def weighted_scatter_add(num_rows: int, index_Q: torch.Tensor, y_QD: torch.Tensor,
                         weight_Q: torch.Tensor) -> torch.Tensor:
    """``out[index[q]] += weight[q] * y[q]`` with FP32 atomics: -> [num_rows, D] (y's dtype)."""
    _check_dtype("weighted_scatter_add", y_QD.dtype)
    Q, D = y_QD.shape
    out = torch.zeros((num_rows, D), dtype=torch.float32, device=y_QD.device)
    if Q:
        grid = (triton.cdiv(Q, 32), triton.cdiv(D, 64))
        _weighted_scatter_add_kernel[grid](y_QD, weight_Q, index_Q, out, Q, D, y_QD.stride(0), y_QD.stride(1),
                                           out.stride(0), out.stride(1), BQ=32, BD=64)
    return out.to(y_QD.dtype)
