"""Every experiment of ``conf/experiment/`` runs end to end through ``run.py`` (the smoke run of
:mod:`tests.smoke_helpers`: Hydra's composition, validation, the runner and its ranks, on
models shrunk by one shared list, random-init where a trained proxy would be pre-trained).

The default run launches the first point of every experiment (its cost, measured with its
commit, is in docs/install.md: most of it the launching process's Hydra compositions, two per
experiment here and four in ``run.py``); ``slow`` launches the first point of every grid of
every experiment and writes each experiment's report. An experiment added to the folder runs here without being named; it
must also be named in :data:`EXPERIMENTS` (the first test fails until it is), so that the
list below says which experiments this file checks.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from smoke_helpers import experiments, schema_fields

ROOT = Path(__file__).resolve().parent.parent

# every experiment in conf/experiment/, by name
EXPERIMENTS = (
    "bench", "bench_decode", "bench_plans", "calibrate", "default_study", "exflow_affinity", "fig12_scaling",
    "fig1_batch", "fig1_latency", "fig3_lcc", "fig7_pruning", "fig8_pattern", "group_limit", "lossy_front",
    "modern_models", "placement_load", "placement_study", "proxies", "proxies_scmoe", "pruning_no_finetune",
    "published_check", "scale_study", "strategies", "strategies_full", "table1_ct_runtime", "tutel_overlap",
)


def smoke(out: Path, *flags: str, timeout: float) -> dict:
    """The smoke run of every experiment in the folder (tests/smoke_helpers.py) in one process."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "smoke_helpers.py"), str(out), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and (out / "smoke.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "smoke.json").read_text())


def assert_all_ran(done: dict, reports: bool = False) -> None:
    """Each experiment's every point exited 0 and wrote results; no point left an error; no
    metric is named as a schema field."""
    assert sorted(done["experiments"]) == experiments()
    failed = {}
    for name, ran in done["experiments"].items():
        bad = [p["point"] for p in ran["points"] if p["status"] != 0]
        if bad or ran["errors"] or len(ran["results"]) < len(ran["points"]) or (reports and not ran["reports"]):
            failed[name] = {"points": bad, "errors": [_last_error(e) for e in ran["errors"].values()],
                            "results": len(ran["results"]), "reports": ran["reports"]}
    assert not failed, json.dumps(failed, indent=1)
    fields = schema_fields()
    settings = {name: sorted(fields.intersection(ran["metrics"])) for name, ran in done["experiments"].items()}
    assert not any(settings.values()), ("metrics named as schema fields (a setting is a column, occult/columns.py): "
                                        + json.dumps({k: v for k, v in settings.items() if v}))


def _last_error(traceback: str) -> str:
    """A traceback's last ``...Error: ...`` line (the error itself, not OmegaConf's trailer)."""
    lines = [ln.strip() for ln in traceback.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if "Error" in ln.split(":", 1)[0]), lines[-1] if lines else "")


def test_every_experiment_is_named_here():
    """The folder and :data:`EXPERIMENTS` agree: a new experiment is named here (and runs below)."""
    assert experiments() == sorted(EXPERIMENTS)


@pytest.mark.timeout(900)
def test_first_point_of_every_experiment_runs(tmp_path):
    done = smoke(tmp_path, timeout=880)
    assert_all_ran(done)
    print(f"smoke run: {len(done['experiments'])} experiments in {done['wall_s']:.0f} s "
          f"({done['cpu_s']:.0f} CPU s)")


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_first_point_of_every_grid_and_each_report(tmp_path):
    done = smoke(tmp_path, "--every-grid", "--report", timeout=7100)
    assert_all_ran(done, reports=True)
