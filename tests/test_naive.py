"""Naive EP's rows, bytes and C_T against hand computation, and that parity can fail."""
import pytest

from occult.dist import launch
from occult.parity import LayerCase, run_grid
from systems import system

NAIVE = "baselines.naive.NaiveDispatcher"
# E=4 on P=2: experts 0,1 on rank 0 and 2,3 on rank 1. Rank 0 has tokens
# [0,1] and [0,2]; rank 1 has [3,2] and [1,3]. D=16 float64 -> 128 bytes a row.
HAND = LayerCase(4, 2, (2, 2), routing="explicit", explicit_ids=(0, 1, 0, 2, 3, 2, 1, 3), hidden=16)


@pytest.mark.timeout(120)
def test_rows_bytes_and_ct_by_hand():
    jobs = [(system(NAIVE), HAND, None), (system("helpers.WeightlessDispatcher"), HAND, None)]
    r0, r1 = launch(run_grid, 2, (jobs,), timeout_s=60)
    rows = {rank: {(ev.phase, ev.direction): ev.rows_P for ev in res[0]["comm"]}
            for rank, res in ((0, r0), (1, r1))}
    # one row per (token, expert): rank 0 sends 3 rows to itself and 1 to rank 1
    assert rows[0][("dispatch", "forward")] == (3, 1)
    assert rows[1][("dispatch", "forward")] == (1, 3)
    assert rows[0][("combine", "forward")] == (3, 1)       # what rank 0 received, sent back
    assert rows[1][("combine", "forward")] == (1, 3)
    assert rows[0][("dispatch", "backward")] == (3, 1)     # transposed in backward: rank 0 returns the
    assert rows[0][("combine", "backward")] == (3, 1)      # gradients of the rows it received
    assert rows[0][("counts", "forward")] == (1, 1)        # one [e] count row to each peer
    ev = next(e for e in r0[0]["comm"] if e.phase == "dispatch")
    assert ev.row_bytes == 16 * 8
    # distinct devices: rank 0 tokens use {0}, {0,1}; rank 1 tokens {1}, {0,1}
    assert r0[0]["distinct_devices"] == 3 and r1[0]["distinct_devices"] == 3
    assert all(v <= 1e-12 for v in r0[0]["errors"].values())
    # the weightless system is caught
    assert r0[1]["errors"]["out"] > 1e-3
