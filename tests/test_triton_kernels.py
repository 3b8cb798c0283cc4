"""The Triton kernels' logic on tiny shapes, under the Triton interpreter on the CPU.

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
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=580)
    assert "TRITON-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
