"""run.py end to end, in subprocesses: single runs, a multirun that load_runs reads,
a failing sweep point that leaves the others intact and resumes, atomic writes."""
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.load import load_runs
from occult.records import CONTEXT_COLUMNS, make_frame, row, write_results

ROOT = Path(__file__).resolve().parent.parent
# the sweep's report (tested where it is read) left out of sweeps that do not read it: 3 s each
NO_REPORT = "~hydra.callbacks.sweep_report"
SMALL = ["model.hidden_size=32", "model.expert_ffn_size=16", "task.tokens_per_rank=32", "task.warmup=0",
         "task.iters=2"]


def run_py(*args, check=True):
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    if check and proc.returncode:
        raise AssertionError(f"run.py {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.timeout(300)
def test_multirun_two_points_and_load_runs(tmp_path):
    sweep = tmp_path / "sweep"
    run_py("-m", "system=naive", "task=layer", "cluster=cpu1,cpu2", *SMALL, f"hydra.sweep.dir={sweep}")
    df = load_runs([sweep])
    assert df.run_dir.nunique() == 2
    assert sorted(df.world_size.unique()) == [1, 2]
    assert {"ct_all", "rows", "bytes", "time", "a2a_time"} <= set(df.metric)
    assert (sweep / "report.md").is_file() and (sweep / "summary.csv").is_file()
    wall = df[df.metric == "run_wall_time"].groupby("run_dir").value
    assert (wall.size() == 1).all() and (wall.sum() > 0).all()   # one per point, in seconds
    assert "point(s) with a recorded wall time ran for" in (sweep / "report.md").read_text()
    # a single run folder and a sweep folder mix
    single = tmp_path / "single"
    run_py("system=naive", "cluster=cpu1", *SMALL, f"out_dir={single}")
    assert load_runs([sweep, single]).run_dir.nunique() == 3


@pytest.mark.timeout(300)
def test_failed_point_keeps_others_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "cluster=cpu1", "model.top_k=2,100", *SMALL, f"hydra.sweep.dir={sweep}", NO_REPORT]
    first = run_py(*args, check=False)
    assert first.returncode != 0
    assert "1 sweep point(s) failed" in first.stderr + first.stdout
    err = next(sweep.rglob("error.txt")).read_text()
    assert "model.top_k=100: allowed values are 1..model.num_experts=64" in err
    good = [p for p in sweep.rglob("results.parquet")]
    assert len(good) == 1
    stamp = good[0].stat().st_mtime_ns
    second = run_py(*args, check=False)
    assert "skipped (resume=true)" in second.stdout + second.stderr
    assert good[0].stat().st_mtime_ns == stamp


@pytest.mark.timeout(300)
def test_uniform_ct_and_naive_rows_per_token():
    """Done-when figure: E=64, K=8, P=4, uniform routing -> C_T within 2 % of 3.659, 8 rows/token."""
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        run_py("system=naive", "cluster=cpu4", "model.num_experts=64", "model.top_k=8",
               "model.hidden_size=32", "model.expert_ffn_size=16", "task.tokens_per_rank=512",
               "task.warmup=0", "task.iters=1", f"out_dir={out}")
        df = load_runs(out)
    glob = df[df["rank"] == -1]
    ct = glob[glob.metric == "ct_all"].value.item()
    assert abs(ct - 3.659) / 3.659 < 0.02
    rpt = glob[(glob.metric == "rows_per_token") & (glob.phase == "dispatch") & (glob["pass"] == "forward")]
    assert rpt.value.item() == 8.0
    assert (df[df.metric == "parity_checked"].value == 1).sum() == 4
    parity = df[df.metric.str.startswith("parity_") & (df.metric != "parity_checked")]
    assert len(parity) == 4 * 6 and (parity.value <= 1e-9).all()


def test_results_written_atomically(tmp_path, monkeypatch):
    df = make_frame([row("x", 1.0, "ms")], {c: 0 for c in CONTEXT_COLUMNS})

    good = tmp_path / "good"
    write_results(df, good)                     # the CSV holds what the parquet file holds
    import io
    pd.testing.assert_frame_equal(pd.read_csv(good / "results.csv"), pd.read_csv(io.StringIO(df.to_csv(index=False))),
                                  check_dtype=False)        # 1.0 is written "1"

    def boom(table, path, **kw):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    import pyarrow.parquet
    monkeypatch.setattr(pyarrow.parquet, "write_table", boom)
    with pytest.raises(OSError):
        write_results(df, tmp_path)
    assert not (tmp_path / "results.parquet").exists()
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.timeout(300)
def test_layer_run_calibrates_its_own_world_for_the_cost_model_check(tmp_path):
    """task.calibrate=true: the run's rows carry a loopback calibration of its own world
    (latency >= 0, finite bandwidth and matmul rate), and the cost-model check projects the
    run with it, for every collective the run logged."""
    from analysis.calibration import fit_points
    from analysis.figures import costmodel_check as check
    out = tmp_path / "run"
    run_py("system=occult", "cluster=cpu2", "task.sync_collectives=true", "task.calibrate=true", *SMALL,
           f"out_dir={out}")
    df = load_runs([out])
    (point,) = fit_points(df)
    assert point["world_size"] == 2 and point["latency_us"] >= 0 and 0 < point["GBps"] < float("inf")
    assert point["TFLOPs"] > 0
    chk = check.check_against_measured(df, None)
    assert set(chk.calibration) == {"own run"}
    logged = {f"a2a {p} {d}" for p, d in df[df.metric == "a2a_time"][["phase", "pass"]].drop_duplicates().values}
    assert logged and logged <= set(chk.quantity) and (chk.projected_ms > 0).all()


SIM = ["task=simulate", "model=olmoe", "cluster=cpu8", "cluster.world_size=8", "task.routing=uniform",
       "task.synthetic_tokens=256", "task.sample_layers=1", "task.tokens_per_rank=16", "task.backward=false"]


@pytest.mark.timeout(300)
def test_the_parallel_launcher_runs_one_process_points_side_by_side_as_the_basic_launcher_does(tmp_path):
    """hydra/launcher=occult_parallel: the same rows as the basic launcher, a failing point
    reported (run.py exits non-zero, the others written), a timed task refused in one line."""
    grid = ["-m", *SIM, "system=naive,occult", "model.top_k=8,100", NO_REPORT]
    par = run_py(*grid, f"hydra.sweep.dir={tmp_path / 'par'}", "hydra/launcher=occult_parallel",
                 "hydra.launcher.n_jobs=2", check=False)
    assert par.returncode != 0 and "2 sweep point(s) failed" in par.stdout + par.stderr
    assert "[point 4/4]" in par.stdout + par.stderr                # progress counted over both workers
    seq = run_py("-m", *SIM, "system=naive,occult", NO_REPORT, f"hydra.sweep.dir={tmp_path / 'seq'}")
    assert seq.returncode == 0
    keys = ["system", "layer", "rank", "phase", "pass", "metric"]
    traffic = lambda df: df[df.unit.isin(["bytes", "rows", "messages"]) & ~df.metric.str.startswith("planning_")] \
        .groupby(keys, observed=True).value.sum()         # (planning memory is measured, not planned)
    a, b = traffic(load_runs([tmp_path / "par"])), traffic(load_runs([tmp_path / "seq"]))
    assert len(a) == len(b) > 0 and (a == b).all()
    timed = run_py("-m", "task=layer", "cluster=cpu2", "system=naive,occult", *SMALL, NO_REPORT,
                   f"hydra.sweep.dir={tmp_path / 'timed'}", "hydra/launcher=occult_parallel", check=False)
    assert timed.returncode != 0
    assert "hydra.launcher.n_jobs=2: task=layer starts ranks and times them" in timed.stderr
    assert not list((tmp_path / "timed").rglob("results.parquet"))


def test_the_parallel_launcher_refuses_no_jobs_and_runs_at_most_a_job_a_core():
    from hydra_plugins.occult_sweepers.parallel_launcher import ParallelLauncher, usable_cores
    from occult.errors import ConfigError
    for n in (0, -1):
        with pytest.raises(ConfigError, match=rf"hydra.launcher.n_jobs={n}: allowed values are 1 or more"):
            ParallelLauncher(n_jobs=n).check([])
    assert ParallelLauncher(n_jobs=usable_cores() + 3).jobs() == usable_cores()
    assert ParallelLauncher(n_jobs=1).jobs() == 1


def test_the_parallel_launcher_starts_nothing_while_a_point_that_writes_a_file_runs():
    """A place point (its placements read by later points) ends before any later point starts;
    the points before it may still run beside it."""
    from hydra_plugins.occult_sweepers.parallel_launcher import Handout
    order = Handout([(i, []) for i in range(5)], workers=2, barriers={2})
    assert [j for j, _ in order.next_jobs()] == [0, 1]
    order.ended(0)
    assert [j for j, _ in order.next_jobs()] == [2]          # the place point, beside point 1
    order.ended(1)
    assert order.next_jobs() == []                            # point 3 waits for it
    order.ended(2)
    assert [j for j, _ in order.next_jobs()] == [3, 4]
    writers = Handout([(i, []) for i in range(4)], workers=2, barriers={0, 1})
    assert [j for j, _ in writers.next_jobs()] == [0, 1]      # a writer starts beside another
    writers.ended(0)
    assert writers.next_jobs() == []                          # a reader waits for every writer running
