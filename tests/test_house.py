"""The house: a new system is one class and one YAML file; rows name their run; resume
never reuses another config's results; bad input is one line; sweeps show progress; a
killed rank is named; a stale lock ends quickly."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from occult.config import CONF_DIR, register
from occult.dist import RankFailed, launch
from occult.ep import system_config
from occult.parity import run_grid
from occult.records import config_diff, config_hash, hashed_config

import helpers
from test_parity import cases_for, failures_of, parity_jobs

ROOT = Path(__file__).resolve().parent.parent
# the sweep's report (tested where it is read) left out of sweeps that do not read it: 3 s each
NO_REPORT = "~hydra.callbacks.sweep_report"
TINY = ["model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2",
        "task.batch_size=2", "task.seq_len=16", "task.warmup=0", "task.iters=1"]
SMALL = ["model.hidden_size=32", "model.expert_ffn_size=16", "task.tokens_per_rank=32", "task.warmup=0",
         "task.iters=1"]

TOY_CLASS = '''
"""A toy split system from outside the repository: naive EP written with the core's helpers."""
from dataclasses import dataclass

from occult.ep import Exchange, SplitDispatcher, SystemConfig, all_to_all_rows, exchange_counts
from occult.ep.capabilities import Capabilities
from occult.ep.permute import expert_major_order, gather_rows, inverse_permutation, sort_pairs_by_destination
from occult.ep.permute import weighted_scatter_add


@dataclass(frozen=True)
class ToyHandle:
    token_R: object
    weight_R: object
    inv_perm_R: object
    send_P: list
    recv_P: list
    num_tokens: int
    layer: int
    recorder: object


class ToySplit(SplitDispatcher):
    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch", co_execution=True, yields=True,
        traffic_plan="it does not implement Dispatcher.plan", migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False, shortcut_overlap=False)

    @dataclass
    class Config(SystemConfig):
        spare: int = 0          # an option of its own (typed)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        order_R, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement)
        recv_Pe = exchange_counts(send_Pe, self.ep, Exchange(layer, "counts", recorder))
        send_P, recv_P = send_Pe.sum(1).tolist(), recv_Pe.sum(1).tolist()
        token_R = order_R // topk_ids_TK.shape[1]
        got_RD = all_to_all_rows(gather_rows(x_TD, token_R), send_P, recv_P, self.ep,
                                 Exchange(layer, "dispatch", recorder))
        perm_R = expert_major_order(recv_Pe)
        handle = ToyHandle(token_R, topk_weights_TK.flatten()[order_R], inverse_permutation(perm_R), send_P,
                           recv_P, x_TD.shape[0], layer, recorder)
        return gather_rows(got_RD, perm_R), recv_Pe.sum(0), handle

    def combine(self, y_RD, h):
        back_RD = all_to_all_rows(gather_rows(y_RD, h.inv_perm_R), h.recv_P, h.send_P, self.ep,
                                  Exchange(h.layer, "combine", h.recorder))
        return weighted_scatter_add(h.num_tokens, h.token_R, back_RD, h.weight_R)
'''
TOY_YAML = "# A toy system (tests/test_house.py).\nname: toy\n_target_: toy_split.ToySplit\n"


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A folder with the toy class and its conf/system YAML, nothing else."""
    (tmp_path / "toy_split.py").write_text(textwrap.dedent(TOY_CLASS))
    (tmp_path / "conf" / "system").mkdir(parents=True)
    (tmp_path / "conf" / "system" / "toy.yaml").write_text(TOY_YAML)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("toy_split", "toy_sub"):           # each test imports its own toy
        monkeypatch.delitem(sys.modules, module, raising=False)
    yield tmp_path
    for module in ("toy_split", "toy_sub"):
        sys.modules.pop(module, None)
    register()          # the registered systems: conf/'s again


CAPABILITIES = TOY_CLASS[TOY_CLASS.index("    capabilities = "):TOY_CLASS.index("    @dataclass")]


def test_a_toy_system_without_its_own_capability_record_fails_at_registration(toy):
    from occult.ep.capabilities import NoCapabilities
    (toy / "toy_split.py").write_text(textwrap.dedent(TOY_CLASS.replace(CAPABILITIES, "")))
    with pytest.raises(NoCapabilities) as err:
        register([toy / "conf"])
    assert str(err.value).startswith("system class toy_split.ToySplit declares no capabilities")
    assert "\n" not in str(err.value)
    # a subclass does not inherit its parent's record: it declares its own or fails
    (toy / "toy_sub.py").write_text("from toy_split import ToySplit\n\n\nclass Sub(ToySplit):\n    pass\n")
    (toy / "toy_split.py").write_text(textwrap.dedent(TOY_CLASS))
    sys.modules.pop("toy_split")
    (toy / "conf" / "system" / "sub.yaml").write_text("name: sub\n_target_: toy_sub.Sub\n")
    with pytest.raises(NoCapabilities, match="system class toy_sub.Sub declares no capabilities"):
        register([toy / "conf"])


def test_adding_the_toy_system_adds_its_row_to_the_capability_table_and_nothing_else(toy):
    from occult.capability_table import DOC, table, with_table
    committed = DOC.read_text()
    assert with_table(committed, table()) == committed, "docs/systems.md's table is not the records': make docs-systems"
    before, after = table().splitlines(), table([toy / "conf"]).splitlines()
    assert [line for line in after if "`toy`" not in line] == before
    assert [line for line in after if "`toy`" in line][0].startswith("| `toy` | harness | float64 | yes | yes | yes |")
    assert "- `toy`, traffic plan: it does not implement Dispatcher.plan." in after


def test_the_toy_system_joins_the_palette_the_systems_table_and_the_capability_selected_experiments(toy):
    """Registered from its folder alone, the toy has a colour and marker of its own (the paper's
    systems keep theirs), a row in the systems tables (README, docs), a place in the experiments that
    select every exact system by capability (resolved when composed, kept in the config); a
    query it fails leaves it out (the advisor's, which needs a traffic plan, too)."""
    from omegaconf import OmegaConf

    from analysis.advise import candidates
    from analysis.plots import SYSTEM_COLORS, system_styles
    from occult.capability_table import (DOC, DOCS_BEGIN, DOCS_END, README, README_BEGIN, README_END, docs_table,
                                         readme_table, with_table)

    for path, block, begin, end in ((README, readme_table, README_BEGIN, README_END),
                                    (DOC, docs_table, DOCS_BEGIN, DOCS_END)):
        committed = path.read_text()
        assert with_table(committed, block(), begin, end) == committed, f"{path.name}'s systems table is not " \
            "conf/system's: make docs-systems"
    before = system_styles()
    register([toy / "conf"])
    styles = system_styles()
    assert "toy" not in before and {s: styles[s] for s in before} == before
    assert styles["toy"][0] not in {c for s, (c, _) in styles.items() if s != "toy"}
    assert all(styles[s][0] == c for s, c in SYSTEM_COLORS.items())
    rows = readme_table([toy / "conf"]).splitlines()
    assert [r for r in rows if "`toy`" not in r] == readme_table().splitlines()
    assert "| `toy` | harness | yes | A toy system (tests/test_house.py). |" in rows
    rows = docs_table([toy / "conf"]).splitlines()
    assert [r for r in rows if "`toy`" not in r] == docs_table().splitlines()
    assert "| `toy` | harness | A toy system (tests/test_house.py). |" in rows
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=strategies"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    for grid, selected in (("m", "exact"), ("b8", "bytes")):
        assert "toy" in params[f"{grid}/system"].split(",") and params[f"{grid}/system"] == cfg.selected_systems[selected]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):      # a point of grid m
        point = compose("config", overrides=[f"hydra.searchpath=[file://{toy / 'conf'}]", "experiment=strategies",
                                             "system=toy", "+selected_systems.static="
                                             "${systems_with:static_dispatch}"])
    recorded = hashed_config(OmegaConf.to_container(point, resolve=True))         # run_config.json's
    assert "toy" in recorded["selected_systems.exact"].split(",") and recorded["system.name"] == "toy"
    static = recorded["selected_systems.static"].split(",")
    assert "toy" not in static and {"naive", "occult"} <= set(static)        # the toy has no static dispatch
    # recorded, not hashed: a system added later leaves every finished point's digest (and resume) as it was
    unselected = {k: v for k, v in recorded.items() if not k.startswith("selected_systems.")}
    assert config_hash(recorded) == config_hash(unselected) and not config_diff(recorded, unselected, {})
    assert "toy" not in candidates() and "naive" in candidates()     # the advisor simulates plans: the toy has none


def run_py(*args, env=None, check=True, timeout=400):
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode:
        raise AssertionError(f"run.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def plain_env(**extra) -> dict:
    """The environment without HYDRA_FULL_ERROR (the tests' conftest sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return {**env, **extra}


@pytest.mark.timeout(300)
def test_a_toy_system_from_a_folder_passes_parity(toy):
    jobs, labels = parity_jobs(2, {"toy": {"name": "toy", "_target_": "toy_split.ToySplit", "spare": 3}})
    results = launch(run_grid, 2, (jobs,), timeout_s=240, collective_timeout_s=60)
    assert not failures_of(labels, results, 2)
    assert len(labels) == len(cases_for(2)) > 10


@pytest.mark.slow    # 19 s; the toy system's parity test stays in the default run
@pytest.mark.timeout(600)
def test_a_toy_system_from_a_folder_joins_a_fig1_sweep(toy):
    sweep = toy / "sweep"
    env = plain_env(PYTHONPATH=str(toy))
    run_py("experiment=fig1_latency", f"hydra.searchpath=[file://{toy / 'conf'}]", f"hydra.sweep.dir={sweep}",
           "system=naive,toy", "model=olmoe_proxy", "task=prefill", "cluster=cpu2", *TINY, env=env)
    frames = [pd.read_parquet(p) for p in sweep.rglob("results.parquet")]
    assert sorted(df.system.iloc[0] for df in frames) == ["naive", "toy"]
    toy_rows = next(df for df in frames if df.system.iloc[0] == "toy")
    assert toy_rows.system_options.iloc[0] == '{"spare": 0}' and set(toy_rows.impl) == {"harness"}
    assert (toy_rows[toy_rows.metric == "parity_checked"].value == 1).all()
    report = (sweep / "report.md").read_text()
    assert "toy" in report.split("Fig. 1")[1]
    # a misspelt option of the toy fails when the config is composed, naming the allowed ones
    bad = run_py(f"hydra.searchpath=[file://{toy / 'conf'}]", "system=toy", "system.sprae=1", env=env, check=False)
    assert bad.returncode == 2
    assert "error: system.sprae: unknown key; allowed: name, _target_, spare" in bad.stderr


def _cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_misspelt_or_mistyped_system_options_fail_at_compose_time():
    from hydra.errors import ConfigCompositionException

    from occult.cli import describe
    with pytest.raises(ConfigCompositionException) as err:
        _cfg("system=occult_prune_sim", "system.budgett=2")
    assert describe(err.value).startswith("system.budgett: unknown key; allowed: name, _target_, payload, "
                                          "combine_payload, dispatch_mode, max_tokens_per_rank, kernels, "
                                          "placement_file, budget, weight_rule")
    with pytest.raises(ConfigCompositionException) as err:
        _cfg("system=tutel", "system.capacity_factor=lots")
    assert describe(err.value).startswith("system.capacity_factor='lots'")
    assert system_config(_cfg("system=tutel", "system.capacity_factor=1.5").system).capacity_factor == 1.5


def test_run_ids_are_unique_per_config_and_name_the_options():
    """The pruning budgets 1, 2, 4 have distinct run_ids (they shared one before); the rows
    carry the system's options, so analysis needs no .hydra file."""
    from occult.runner import build_spec, run_context
    from omegaconf import OmegaConf
    ids = set()
    for budget in (1, 2, 4):
        cfg = _cfg("experiment=fig7_pruning", "system=occult_prune_score", f"system.budget={budget}")
        digest = config_hash(hashed_config(OmegaConf.to_container(cfg, resolve=True)))
        ctx = run_context(build_spec(cfg, ".", digest))
        assert f'"budget": {budget}' in ctx["system_options"] and ctx["init"] == "random"
        ids.add(ctx["run_id"])
    assert len(ids) == 3


def test_figure_builders_read_no_hydra_files():
    for path in (ROOT / "analysis").glob("*.py"):
        text = path.read_text()
        for name in ('".hydra"', "'.hydra'", "multirun.yaml", "overrides.yaml"):
            assert name not in text, (path, name)


@pytest.mark.timeout(300)
def test_resume_skips_the_same_config_and_refuses_another(tmp_path):
    out = tmp_path / "run"
    run_py("system=naive", "cluster=cpu1", *SMALL, f"out_dir={out}")
    again = run_py("system=naive", "cluster=cpu1", *SMALL, f"out_dir={out}")
    assert "results of this config exist" in again.stdout + again.stderr
    other = run_py("system=naive", "cluster=cpu1", *SMALL, "task.routing=zipf", f"out_dir={out}",
                   env=plain_env(), check=False)
    assert other.returncode != 0
    assert "holds results of a different config (task.routing: 'uniform' -> 'zipf')" in other.stderr
    assert "resume=false" in other.stderr and "Traceback" not in other.stderr
    replaced = run_py("system=naive", "cluster=cpu1", *SMALL, "task.routing=zipf", "resume=false", f"out_dir={out}")
    assert replaced.returncode == 0
    assert set(pd.read_parquet(out / "results.parquet").routing) == {"zipf"}


BAD_INPUT = [
    (["model.topk=2"], "error: model.topk: unknown key; allowed: name, num_experts, top_k"),
    (["model.top_k=two"], "error: model.top_k='two': Value 'two' of type 'str' could not be converted to Integer"),
    (["system=nonesuch"], "error: system=nonesuch: no such option; available: adaptive_topk, allgather, deepspeed, exflow"),
    (["model.hidden_size=0"], "error: model.hidden_size=0: must be at least 1"),
    (["task.zipf_s=-0.5"], "error: task.zipf_s=-0.5: must be >= 0"),
    (["system=occult_prune_score", "system.budget=8"],
     "error: system.budget=8 is above cluster.world_size=4: a token can use at most 4 devices, so this budget "
     "would not prune anything"),
    (["task=bench", "task.backward=false"], "error: task.backward: task=bench does not read it; its fields: "),
    (["task=bench", "system=occult"], "error: system=occult: task=bench does not run the top-level system"),
    # a sweep whose prefill point cannot take decode's option: refused before any point runs
    (["-m", "task=decode,prefill", "model=olmoe_proxy", "task.new_tokens=4"],
     "error: task.new_tokens: task=prefill does not read it; its fields: "),
    # a capability query with a term that is no capability: refused where the sweep is composed
    (["-m", "experiment=modern_models", "selected_systems.exact=${systems_with:exact_forward, fast}"],
     "error: systems_with: 'fast': a term is <capability>, not <capability> or except <system>; capabilities: "),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every bad input's run.py at once (each is a process start, 3 s of CPU; the cases do
    not share anything), and the first one once more through the ``occult-bench`` command
    from another folder: {index: CompletedProcess-like (returncode, stdout, stderr)}."""
    folder = tmp_path_factory.mktemp("bad")
    procs = {}
    for i, (overrides, _) in enumerate(BAD_INPUT):
        where = ["hydra.sweep.dir=" if "-m" in overrides else "hydra.run.dir=", str(folder / str(i))]
        procs[i] = subprocess.Popen([sys.executable, "run.py", *overrides, "".join(where)], cwd=ROOT,
                                    env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    console = Path(sys.executable).parent / "occult-bench"
    procs["console"] = subprocess.Popen([str(console), *BAD_INPUT[0][0]], cwd=folder, env=plain_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return {key: (p.wait(timeout=200), *p.communicate()) for key, p in procs.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", range(len(BAD_INPUT)))
def test_bad_input_is_one_line_without_a_traceback(case, bad_input_runs):
    """One line naming the field (and the allowed values), no traceback. A sweep's points
    are each composed strictly before any runs (the first, sweep-wide composition skips a
    swept group's options, which are the points' own)."""
    overrides, line = BAD_INPUT[case]
    code, out, err = bad_input_runs[case]
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), err
    assert "Traceback" not in out + err and "running system" not in out + err


def test_the_occult_bench_command_is_run_py(bad_input_runs):
    code, out, err = bad_input_runs["console"]
    assert code == 2 and err.strip().startswith(BAD_INPUT[0][1]), err


@pytest.mark.slow    # 8 s; the sweep's progress line
@pytest.mark.timeout(300)
def test_a_sweep_shows_points_done_and_time_left(tmp_path):
    proc = run_py("-m", "system=naive", "cluster=cpu1", "model.top_k=1,2", *SMALL,
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", NO_REPORT)
    log = proc.stdout + proc.stderr
    assert "[point 1/2]" in log and "[point 2/2]" in log and "(1 done, about" in log and "left)" in log


@pytest.mark.timeout(60)
def test_a_killed_rank_is_named_with_its_signal():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 was killed by SIGKILL \(exit code -9\); the other ranks'"):
        launch(helpers.kill_rank, 2, (1,), timeout_s=40, collective_timeout_s=30)
    assert time.monotonic() - t0 < 30


def test_a_stale_lock_ends_quickly_and_names_the_file(tmp_path):
    from baselines.deepspeed import wait_for_op_lock
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{lock} has been held for over 0 s: .*\(rm {lock}\)"):
        wait_for_op_lock(lock, timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    threading.Timer(0.2, lock.unlink).start()       # a lock released by its holder: the wait ends
    wait_for_op_lock(lock, timeout_s=5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("proxy,arch", [("olmoe_proxy", {}), pytest.param("deepseek_v3_proxy", {"n_group": 2, "topk_group": 1},
                                                                        marks=pytest.mark.slow)])   # 11 s
def test_pretraining_is_bit_reproducible_whatever_the_callers_threads(tmp_path, proxy, arch):
    """The same config and seed give the same checkpoint, even when the calling process
    runs at another thread count (pretrain.threads is what the training uses); DeepSeek-V3's
    proxy trains with its own balancing (the sequence-wise loss, the correction bias)."""
    import hashlib

    import torch
    from omegaconf import OmegaConf

    from occult.tasks.pretrain import pretrain
    model = OmegaConf.load(CONF_DIR / "model" / f"{proxy}.yaml")
    model.update(hidden_size=32, expert_ffn_size=16, num_layers=2, num_experts=8, top_k=2, **arch)
    cfg = OmegaConf.create({"model": model, "seed": 3, "pretrain": {
        "steps": 3, "lr": 3e-3, "batch_size": 2, "seq_len": 16, "balance_coef": 0.1, "tokenizer_vocab": 4096,
        "corpus": "shakespeare", "eval_every": 0, "eval_batches": 1, "threads": 2}})
    digests = []
    before = torch.get_num_threads()
    try:
        for i, threads in enumerate((1, 2)):
            torch.set_num_threads(threads)
            pretrain(cfg, tmp_path / f"ckpt{i}", progress=False)
            digests.append(hashlib.sha256((tmp_path / f"ckpt{i}" / "model.safetensors").read_bytes()).hexdigest())
            assert torch.get_num_threads() == threads          # restored after training
    finally:
        torch.set_num_threads(before)
    assert digests[0] == digests[1]


@pytest.mark.timeout(120)
def test_a_run_time_failure_ends_in_one_line_with_its_cause(tmp_path):
    """A run that fails in its ranks (here a system that forgets its gate weights, stopped by
    the parity gate) ends with one line, the cause, last on the screen; no Hydra report,
    no traceback there; the traceback is in the run's log and error.txt."""
    (tmp_path / "conf" / "system").mkdir(parents=True)
    (tmp_path / "conf" / "system" / "weightless.yaml").write_text(
        "name: weightless\n_target_: helpers.WeightlessDispatcher\n")
    run_dir = tmp_path / "run"
    proc = run_py(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "system=weightless", "cluster=cpu1", *SMALL,
                  f"hydra.run.dir={run_dir}", env=plain_env(PYTHONPATH=str(ROOT / "tests")), check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 0 of 1 failed: AssertionError: system=weightless disagrees with the "
                           "single-device reference"), proc.stderr
    assert f"(traceback: {run_dir / 'run.log'}" in last
    assert "Traceback" not in proc.stdout + proc.stderr and "Error executing job" not in proc.stdout + proc.stderr
    assert "Traceback" in (run_dir / "run.log").read_text() and "Traceback" in (run_dir / "error.txt").read_text()


def test_a_missing_proxy_is_announced_before_it_is_pre_trained(tmp_path, monkeypatch, caplog):
    """One line before pre-training starts: which checkpoint is missing, its cache key, the
    expected time (from the cached proxies of that model), how to keep a trained router."""
    import json
    import logging

    from occult.runner import build_spec
    from occult.tasks import model as model_task
    from occult.tasks import pretrain

    cache = tmp_path / "proxies"
    monkeypatch.setattr(pretrain, "proxy_dir", lambda cfg: cache / f"{cfg.model.name}-0123456789")
    (cache / "olmoe_proxy-aaaaaaaaaa").mkdir(parents=True)       # a proxy of another top-k, trained here
    (cache / "olmoe_proxy-aaaaaaaaaa" / "occult.json").write_text(json.dumps({"wall_s": 300.0, "steps": 400}))
    said = []

    def fake_pretrain(cfg, out, progress=True):
        said.append([r.getMessage() for r in caplog.records])      # what was said before training began
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(pretrain, "pretrain", fake_pretrain)
    cfg = _cfg("task=prefill", "model=olmoe_proxy", "model.top_k=2")
    with caplog.at_level(logging.INFO, logger="occult"):
        spec = model_task.prepare(build_spec(cfg, ".", "d"))
    (line,) = [m for m in said[0] if m.startswith("pre-training")]
    assert "model=olmoe_proxy (top_k=2, E=64)" in line and "cache key olmoe_proxy-0123456789" in line
    assert "expected about 5 min here" in line and "experiment=fig3_lcc" in line
    assert spec.setup_done == ("pre-trained olmoe_proxy",)
    again = model_task.prepare(build_spec(cfg, ".", "d"))      # cached now: no set-up
    assert again.setup_done == () and len(said) == 1


def test_a_proxy_pre_trained_by_another_process_is_waited_for_not_trained_twice(tmp_path, monkeypatch):
    """Two runs that need the same missing proxy at once (two sweeps, the smoke run's two
    workers): the second waits on the first's lock file and reads its checkpoint; without
    the lock both would write the same ``.partial`` folder and the second rename fail."""
    from occult.tasks import pretrain

    cache = tmp_path / "proxies"
    monkeypatch.setattr(pretrain, "proxy_dir", lambda cfg: cache / f"{cfg.model.name}-0123456789")
    started, release, trained = threading.Event(), threading.Event(), []

    def slow_pretrain(cfg, out, progress=True):
        trained.append(out)
        started.set()
        assert release.wait(30)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(pretrain, "pretrain", slow_pretrain)
    cfg = _cfg("task=prefill", "model=olmoe_proxy")
    got = []
    first = threading.Thread(target=lambda: got.append(pretrain.ensure_trained(cfg, progress=False)))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: got.append(pretrain.ensure_trained(cfg, progress=False)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and len(got) == 0            # waiting on the lock, not training
    release.set()
    first.join(30)
    second.join(30)
    assert got == [cache / "olmoe_proxy-0123456789"] * 2 and len(trained) == 1


def test_the_time_left_leaves_out_points_that_ran_one_off_set_up(monkeypatch, caplog):
    """The first point of `make run` pre-trains a proxy (minutes, once); the estimate
    after it must not count that as every point's cost."""
    import logging

    from occult.runner import SWEEP_POINTS_ENV, Progress

    monkeypatch.setenv(SWEEP_POINTS_ENV, "10")
    progress = Progress()
    with caplog.at_level(logging.INFO, logger="occult"):
        progress.begin("a")
        progress.end(600.0, skipped=False, set_up=True)        # pre-training and the point
        progress.begin("b")
        progress.end(30.0, skipped=False)
        progress.begin("c")
    lines = [r.getMessage() for r in caplog.records]
    assert "estimated after a point without one-off set-up" in lines[1]
    assert lines[2].endswith("(2 done, about 4.0 min left)")               # 8 points x 30 s
