"""The launcher: results in rank order, per-rank seeds, and no hang when a rank fails."""
import time

import pytest

from occult.dist import RankFailed, launch, rank_seed

import helpers


@pytest.mark.timeout(60)
def test_results_in_rank_order_with_seeds():
    out = launch(helpers.rank_info, 3, seed=7, timeout_s=40)
    assert [o[0] for o in out] == [0, 1, 2]
    assert all(o[1] == 3 for o in out)
    assert [o[2] for o in out] == [rank_seed(7, r) for r in range(3)]


@pytest.mark.timeout(60)
def test_raising_rank_fails_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        launch(helpers.raise_on_rank, 3, (1,), timeout_s=40, collective_timeout_s=30)
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert "rank 1 of 3 failed" in msg
    assert "deliberate failure on rank 1" in msg and "Traceback" in msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peers_wait_in_collective", [False, True])
def test_dead_rank_fails_the_run(peers_wait_in_collective):
    """The rank that died is named, not the peer whose connection it reset (which may
    report its error before the death is seen)."""
    with pytest.raises(RankFailed, match="rank 0 of 2 died with exit code 3 and no Python traceback; the other"):
        launch(helpers.exit_on_rank, 2, (0, peers_wait_in_collective), timeout_s=40, collective_timeout_s=20)



@pytest.mark.timeout(60)
def test_ranks_end_when_their_launcher_is_gone():
    """A launcher killed by a signal it cannot catch leaves no rank computing on: every
    rank watches its launcher (a thread), and a rank whose watched process is gone exits."""
    import subprocess
    assert launch(helpers.watching_threads, 2, timeout_s=40) == [["launcher-watch"]] * 2
    gone = subprocess.Popen(["sleep", "0.3"])
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 of 1 died with exit code 1"):
        launch(helpers.watch_then_sleep, 1, (gone.pid,), timeout_s=40)
    assert time.monotonic() - t0 < 20
    gone.wait()
