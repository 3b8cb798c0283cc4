"""Occult's BRIM maps by hand, and its rows: one per (token, destination device)."""
import pytest
import torch

from occult.collab.brim import build_brim0, build_brim1, local_expert_weights, uses_of
from occult.dist import launch
from occult.ep import Placement
from occult.parity import LayerCase, run_grid
from systems import system

OCCULT = "occult.collab.dispatcher.OccultDispatcher"
NAIVE = "baselines.naive.NaiveDispatcher"


def test_brim0_by_hand():
    pl = Placement.contiguous(4, 2)                   # experts 0,1 on device 0; 2,3 on device 1
    ids = torch.tensor([[0, 1], [0, 2], [3, 2]])
    b0 = build_brim0(ids, pl)
    assert b0.index_PT.tolist() == [[0, 1, -1], [-1, 2, 3]]
    assert b0.token_R.tolist() == [0, 1, 1, 2] and b0.device_R.tolist() == [0, 0, 1, 1]
    assert b0.send_P.tolist() == [2, 2]
    w = torch.tensor([[0.5, 0.25], [0.6, 0.3], [0.7, 0.2]])
    w_Re = local_expert_weights(ids, w, pl, b0)            # -1: the row does not use that expert
    assert torch.allclose(w_Re, torch.tensor([[0.5, 0.25], [0.6, -1.0], [0.3, -1.0], [0.2, 0.7]]))
    assert uses_of(w_Re).tolist() == [[True, True], [True, False], [True, False], [True, True]]
    w0 = torch.tensor([[0.0, 0.25], [0.6, 0.3], [0.7, 0.2]])   # a gate weight of exactly 0 is still used
    assert uses_of(local_expert_weights(ids, w0, pl, b0))[0].tolist() == [True, True]


def test_brim1_by_hand():
    uses = torch.tensor([[True, True], [True, False], [False, True]])   # 3 received rows, 2 local experts
    b1 = build_brim1(uses)
    assert b1.index_eR.tolist() == [[0, 1, -1], [2, -1, 3]]
    assert b1.row_Q.tolist() == [0, 1, 0, 2] and b1.slot_Q.tolist() == [0, 0, 1, 1]
    assert b1.counts_e.tolist() == [2, 2]


def test_brim_is_built_without_python_loops_at_scale():
    pl = Placement.contiguous(64, 4)
    ids = torch.topk(torch.rand(4096, 64, generator=torch.Generator().manual_seed(0)), 8).indices
    b0 = build_brim0(ids, pl)
    valid = b0.index_PT >= 0
    assert int(valid.sum()) == b0.token_R.numel()
    # the inverse map agrees with BRIM_0 everywhere
    dev, tok = torch.nonzero(valid, as_tuple=True)
    assert torch.equal(b0.token_R[b0.index_PT[dev, tok]], tok)


CASES = [LayerCase(64, 8, (40, 24, 0, 31)), LayerCase(8, 2, (9, 9, 9, 9), routing="one_device"),
         LayerCase(60, 6, (20, 20, 20, 20), routing="router"), LayerCase(64, 1, (33, 17, 25, 8)),
         LayerCase(8, 2, (7, 3, 5, 6))]


@pytest.mark.timeout(180)
def test_rows_per_token_equal_ct_all_in_every_phase_and_pass():
    jobs = [(system(cls), case, None) for case in CASES for cls in (OCCULT, NAIVE)]
    per_rank = launch(run_grid, 4, (jobs,), timeout_s=120)
    for i, case in enumerate(CASES):
        occ = [r[2 * i] for r in per_rank]
        nai = [r[2 * i + 1] for r in per_rank]
        distinct = sum(r["distinct_devices"] for r in occ)
        tokens = sum(case.tokens)
        for key in [("dispatch", "forward"), ("combine", "forward"), ("dispatch", "backward"),
                    ("combine", "backward")]:
            assert sum(r["sent_rows"][key] for r in occ) == distinct, (case, key)
            assert sum(r["sent_rows"][key] for r in nai) == tokens * case.top_k, (case, key)
        # each rank sends one row per (own token, device) in dispatch
        for r in occ:
            assert r["sent_rows"][("dispatch", "forward")] == r["distinct_devices"]
        if case.top_k == 1:
            for o, n in zip(occ, nai):
                for key in n["sent_rows"]:
                    assert o["sent_rows"][key] == n["sent_rows"][key], (case, key)
        for r in occ + nai:
            assert all(v <= 1e-9 for v in r["errors"].values()), (case, r["errors"])
        # no more collectives per layer than naive EP, in each pass (from the recorded phases)
        for o, n in zip(occ, nai):
            for direction in ("forward", "backward"):
                count = lambda res: sum(ev.direction == direction for ev in res["comm"])
                assert count(o) <= count(n), (case, direction, [ev.phase for ev in o["comm"]])
            # the gate weights ride with the dispatched rows and are counted as metadata
            ev = next(ev for ev in o["comm"] if ev.phase == "dispatch" and ev.direction == "forward")
            e = case.num_experts // 4
            assert ev.row_bytes == (case.hidden + e) * 8 and ev.meta_row_bytes == e * 8


@pytest.mark.parametrize("tile_rows", [0, 2])
@pytest.mark.parametrize("needs", ["all", "rows_only", "experts_only"])
def test_merged_experts_step_equals_epd_then_merge(needs, tile_rows, monkeypatch):
    """The torch path's fused step (one expert at a time, straight into the merged rows)
    against EPD materialised, the grouped experts and the scatter-add, forward and backward,
    with an empty expert and with only some inputs needing gradients; each expert's rows in
    one tile (the default size) or in tiles of 2-3 rows."""
    from occult.ep import merged
    from occult.ep.merged import GatheredRows, merged_swiglu
    if tile_rows:
        monkeypatch.setattr(merged, "TILE_BYTES", tile_rows * 6 * 8)
    from occult.ep import GroupedExperts
    from occult.ep.permute import gather_rows, scatter_add_rows
    g = torch.Generator().manual_seed(3)
    R, D, F, e = 13, 6, 5, 4
    uses = torch.rand(R, e, generator=g) < 0.5
    uses[:, 2] = False                                             # expert 2 gets no rows
    b1 = build_brim1(uses)
    assert b1.counts_e.max() > 4 and (b1.counts_e % 2).any()       # several tiles, uneven ones
    src = torch.randn(R, D, generator=g, dtype=torch.float64).requires_grad_(needs != "experts_only")
    w_Q = torch.rand(b1.row_Q.numel(), generator=g, dtype=torch.float64).requires_grad_(needs != "experts_only")
    experts = GroupedExperts(*(torch.randn(e, *s, generator=g, dtype=torch.float64) for s in ((D, F), (D, F), (F, D))))
    experts.requires_grad_(needs != "rows_only")
    inputs = [t for t in (src, w_Q, *experts.parameters()) if t.requires_grad]
    grad_RD = torch.randn(R, D, generator=g, dtype=torch.float64)
    ref = scatter_add_rows(R, b1.row_Q, experts(gather_rows(src, b1.row_Q), b1.counts_e, w_Q))
    got = merged_swiglu(experts, GatheredRows(src, b1.row_Q), b1.counts_e, w_Q)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, inputs, grad_RD), torch.autograd.grad(ref, inputs, grad_RD)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (a - b).abs().max()


def test_auto_fuses_the_experts_step_only_for_a_large_epd():
    """kernels=auto on a CPU: EPD materialised while [Q, D] is at most FUSE_FROM_BYTES,
    the fused loop above; torch and epd are taken whatever the size."""
    from occult.collab.dispatcher import OccultDispatcher
    from occult.ep.merged import FUSE_FROM_BYTES
    from occult.ep import system_config
    from occult.ep.comm import EPGroup
    x_TD = torch.zeros(4, 128)
    rows_at_bound = FUSE_FROM_BYTES // (128 * 4)
    for kernels, small, large in (("auto", "epd", "torch"), ("torch", "torch", "torch"), ("epd", "epd", "epd")):
        config = system_config({"name": "occult", "_target_": OCCULT, "kernels": kernels})
        d = OccultDispatcher(EPGroup(), Placement.contiguous(8, 1), config)
        assert (d._kernels(x_TD, rows_at_bound), d._kernels(x_TD, rows_at_bound + 1)) == (small, large), kernels
