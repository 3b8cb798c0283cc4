"""The Triton kernels' logic on tiny shapes, under the Triton interpreter on the CPU, and
their float32 dot products compiled for a Hopper GPU (no GPU needed to compile).

Skipped when triton is not installed (it is an optional extra: pip install -e '.[gpu]',
or `make test-triton`). The interpreter must be switched on before triton is
imported, so the checks run in a subprocess.
"""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (optional extra 'gpu'; `make test-triton`)")

SCRIPT = textwrap.dedent("""
    import torch
    from occult.kernels.triton_moe import gather_grouped_mm, weighted_scatter_add
    from occult.dist import launch
    from occult.parity import LayerCase, run_grid

    g = torch.Generator().manual_seed(0)
    src = torch.randn(11, 40, generator=g)
    counts = torch.tensor([5, 0, 37, 3])            # an empty expert, and a segment over one tile
    index = torch.randint(0, 11, (45,), generator=g)
    w = torch.randn(4, 40, 70, generator=g)
    out = gather_grouped_mm(src, index, counts, w)
    x = src[index]
    ref = torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0, 5, 5, 42], [5, 5, 42, 45]))])
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()

    y = torch.randn(45, 70, generator=g)
    wq = torch.rand(45, generator=g)
    merged = weighted_scatter_add(11, index, y, wq)
    ref = torch.zeros(11, 70).index_add_(0, index, y * wq[:, None])
    assert torch.allclose(merged, ref, atol=1e-5), (merged - ref).abs().max()

    # the whole Occult layer on the Triton path equals the reference, forward and backward
    OCC = "occult.collab.dispatcher.OccultDispatcher"
    cases = [LayerCase(8, 2, (6, 5), dtype="float32", hidden=32, ffn=16),
             LayerCase(8, 4, (0, 9), dtype="float32", hidden=32, ffn=16)]
    jobs = [({"name": "occult", "_target_": OCC, "kernels": "triton"}, c, None) for c in cases]
    for rank_out in launch(run_grid, 2, (jobs,), timeout_s=240):
        for res in rank_out:
            assert all(v < 1e-4 for v in res["errors"].values()), res["errors"]
    print("TRITON-OK")
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_under_the_interpreter():
    _run_until_ok(SCRIPT, "TRITON-OK", timeout=580, TRITON_INTERPRET="1")


def _run_until_ok(script: str, ok: str, timeout: int, **env) -> None:
    """Runs ``script`` in a fresh interpreter (Triton's state stays there) and asserts it
    printed ``ok``, showing its output's tails when it did not."""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=timeout)
    assert ok in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


DTYPES = textwrap.dedent("""
    import pytest, torch
    from triton.runtime import interpreter
    from occult.ep import EPGroup, system_config
    from occult.kernels.triton_moe import gather_grouped_mm, weighted_scatter_add

    # the precision every tl.dot of a float32 launch asks for, as the interpreter is handed it
    seen = []
    real = interpreter.InterpreterBuilder.create_dot
    def spy(self, a, b, d, input_precision, max_num_imprecise_acc):
        seen.append(str(input_precision))
        return real(self, a, b, d, input_precision, max_num_imprecise_acc)
    interpreter.InterpreterBuilder.create_dot = spy

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 6])
    index = torch.randint(0, 5, (9,), generator=g)
    src, w = torch.randn(5, 16, generator=g), torch.randn(2, 16, 8, generator=g)
    gather_grouped_mm(src, index, counts, w)
    assert seen and all(s.endswith("IEEE") for s in seen), seen

    # float64 is refused by both kernels, with the path that takes it
    for call in (lambda: gather_grouped_mm(src.double(), index, counts, w.double()),
                 lambda: weighted_scatter_add(5, index, torch.randn(9, 8, dtype=torch.float64), torch.rand(9))):
        with pytest.raises(TypeError, match=r"take float16, bfloat16, float32 rows, not float64 .*kernels=auto"):
            call()

    # Occult's kernels=auto takes the Triton path for float32 rows, never for float64 ones;
    # kernels=triton refuses float64 rows naming the option
    OCC = "occult.collab.dispatcher.OccultDispatcher"
    def path(kernels, dtype):
        d = system_config({"name": "occult", "_target_": OCC, "kernels": kernels}).build(EPGroup(0, 1, None, "cpu"), 0, 8)
        return d._kernels(torch.zeros(4, 16, dtype=dtype), 8)
    assert path("auto", torch.float32) == "triton"
    assert path("auto", torch.float64) in ("torch", "epd")
    with pytest.raises(ValueError, match=r"system.kernels=triton: the Triton kernels take .* not float64"):
        path("triton", torch.float64)
    print("DTYPES-OK")
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_float64_is_refused_and_float32_asks_for_ieee_dots():
    _run_until_ok(DTYPES, "DTYPES-OK", timeout=280, TRITON_INTERPRET="1")


COMPILED = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from occult.kernels.triton_moe import BLOCK_K, BLOCK_M, BLOCK_N, DOT_PRECISION, _gather_grouped_mm_kernel as k

    INDEX = ("index_ptr", "tile_expert_ptr", "tile_start_ptr", "tile_end_ptr")
    def ptx(dtype):
        # the gather-fused matmul as gather_grouped_mm launches it for rows of dtype, built for sm_90
        rows = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        const = {"BM": BLOCK_M, "BN": BLOCK_N, "BK": BLOCK_K, "PRECISION": DOT_PRECISION[dtype]}
        sig = {n: "constexpr" if n in const else ("*i64" if n in INDEX else f"*{rows}") if n.endswith("_ptr")
               else "i32" for n in k.arg_names}
        src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    fp32, bf16 = ptx(torch.float32), ptx(torch.bfloat16)
    assert "tf32" not in fp32 and "fma.rn.f32" in fp32, "float32 dots must not run on TF32 tensor cores"
    assert "mma" in bf16, "bf16 dots run on the tensor cores"
    print("COMPILED-OK")
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_float32_dots_compile_to_ieee_fmas_for_hopper():
    """No GPU needed: triton compiles for a target it is told (sm_90) down to PTX; the
    float32 kernel's dot products are FMAs, no TF32 instruction; bf16's are tensor-core MMAs."""
    _run_until_ok(COMPILED, "COMPILED-OK", timeout=280)
