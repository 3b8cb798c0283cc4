"""Settings as columns (:mod:`occult.columns`): the schema fields declared as columns are columns
of every row, the later keys resume hashes from are the fields' own declarations, and a table
written at 57d74c1 (settings as metric rows) loads as today's and gives the same strategies
tables (fixture: tests/fixtures/old_57d74c1, written by make_old_57d74c1.py)."""
import dataclasses
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from occult.columns import column, columns_of, later, later_keys_of
from occult.config import CONF_DIR, later_keys, register, setting_columns
from occult.records import COLUMNS, CONTEXT_COLUMNS, hashed_config, make_frame, row, without_later

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "old_57d74c1"

# the keys added after results were first written, with the values their configs held, as
# occult/records.py listed them at 57d74c1: a run hashed then keeps its hash (and resumes) only
# while the fields declare exactly these
LATER_AT_57D74C1 = {
    "cluster.devices_per_node": 0, "cluster.single_rank_collectives": False,
    "task.optimisers": ["contiguous", "random", "greedy", "swap_search"],
    "task.load_caps": [None, 1.25, 1.15, 1.1], "task.swap_time_limit_s": 10.0,
    "task.total_tokens": 0, "task.routers": None, "task.sample_layers": 0, "task.synthetic_tokens": 0,
    "task.max_over_mean": 2.0, "task.incast_device": 0, "task.incast_share": 0.5,
    "task.placement": "contiguous", "task.num_redundant": 0,
    "task.microbatches": 1, "task.grad_sync": "end", "task.migration": False}
# and those added since, each at the value that reproduces the runs written before it
# (system.kernels: hierarchical's; a later key is one per group and field, so Occult's
# kernels=auto configs hash without it too: their config hash changed once, and their stored
# runs resume, tested below)
LATER_SINCE = {"task.held_out_tokens": None, "pretrain.eval_batches": None, "system.kernels": "auto"}


def test_the_later_keys_are_the_fields_declarations_and_those_of_57d74c1():
    assert later_keys() == {**LATER_AT_57D74C1, **LATER_SINCE}
    # a config at a later key's value hashes as one without the key; another value is hashed
    hashed = lambda task: without_later(hashed_config({"task": task}), later_keys())
    assert hashed({"microbatches": 1, "iters": 3}) == {"task.iters": 3}
    assert hashed({"microbatches": 2}) == {"task.microbatches": 2}


def test_a_run_stored_before_a_later_system_option_resumes_and_one_at_another_value_is_refused(tmp_path):
    """hierarchical's system.kernels came later: its runs stored without the key, and Occult's
    stored with kernels=auto (the key is one per group and field), resume; a stored
    kernels=torch is another config. The option is left out of system_options at auto."""
    from occult.ep import system_config
    from occult.errors import ConfigError
    from occult.records import RESULTS_FILE, write_run_config
    from occult.runner import already_done
    current = without_later({"system.name": "occult", "system.kernels": "auto", "task.iters": 3}, later_keys())
    assert current == {"system.name": "occult", "task.iters": 3}
    for stored, resumes in (({"system.name": "occult", "system.kernels": "auto", "task.iters": 3}, True),
                            ({"system.name": "occult", "task.iters": 3}, True),
                            ({"system.name": "occult", "system.kernels": "torch", "task.iters": 3}, False)):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        write_run_config(out, stored)
        (out / RESULTS_FILE).write_bytes(b"")
        if resumes:
            assert already_done(out, current), stored
        else:
            with pytest.raises(ConfigError, match="system.kernels: 'torch' -> '<absent>'"):
                already_done(out, current)
    hier = "baselines.hierarchical.HierarchicalDispatcher"
    assert "kernels" not in system_config({"name": "hierarchical", "_target_": hier}).options()
    assert system_config({"name": "hierarchical", "_target_": hier, "kernels": "torch"}).options()["kernels"] == "torch"


def test_a_run_folder_written_at_57d74c1_resumes(tmp_path):
    """A 57d74c1 run folder (the fixture's table and the config its mb2_overlap run stored)
    holds the results of today's same command: the run is skipped, not refused."""
    import shutil
    from occult.runner import already_done, run_hashed_config
    _old_table(tmp_path)
    shutil.copy(FIXTURE / "run_config.json", tmp_path / "run_config.json")
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            "model=olmoe_proxy", "model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16",
            "model.num_layers=2", "cluster=cpu4", "task=train", "system=naive", "task.warmup=0", "task.iters=2",
            "task.batch_size=2", "task.seq_len=16", "task.parity_tokens=8", "experiment_name=fixture_57d74c1",
            "task.microbatches=2", "task.grad_sync=overlap", "label=mb2_overlap"])
    assert already_done(tmp_path, run_hashed_config(cfg))


def test_a_setting_is_declared_once():
    @dataclasses.dataclass
    class A:
        mode: str = column("fast", absent="", later="fast")
        size: list = later([1, 2])

    @dataclasses.dataclass
    class B:
        mode: str = column("slow", absent="none")

    assert A().size == [1, 2] and A().size is not A().size
    assert later_keys_of({"task": [A]}) == {"task.mode": "fast", "task.size": [1, 2]}
    assert columns_of({"task": [A]}) == {"mode": ("task", "")}
    with pytest.raises(ValueError, match="mode: declared with two group and absent values"):
        columns_of({"task": [A, B]})


def _context(*overrides):
    from occult.runner import build_spec, run_context
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run_context(build_spec(compose("config", overrides=list(overrides)), ".", "d"))


# the settings of systems the figures read (fig7_pruning, tutel_overlap, scale_study / advise)
SYSTEM_SETTINGS = ("budget", "topk_group", "a2a_ffn_overlap_degree", "dedup")


def test_every_setting_is_a_column_of_every_row():
    assert set(setting_columns()) >= {"microbatches", "grad_sync", "dispatch_mode", "migration", *SYSTEM_SETTINGS}
    train = _context("task=train", "model=olmoe_proxy", "system=occult", "task.microbatches=2",
                     "task.grad_sync=overlap", "system.dispatch_mode=static")
    layer = _context("task=layer", "system=megablocks")         # no micro-batches, no gradient sync, no static mode
    bench = _context("task=bench")                               # no top-level system
    pick = lambda ctx: {k: ctx[k] for k in ("microbatches", "grad_sync", "dispatch_mode", "migration", "placement")}
    assert pick(train) == {"microbatches": 2, "grad_sync": "overlap", "dispatch_mode": "static", "migration": False,
                           "placement": "contiguous"}
    assert pick(layer) == {"microbatches": 1, "grad_sync": "", "dispatch_mode": "dynamic", "migration": False,
                           "placement": "contiguous"}
    assert (bench["dispatch_mode"], bench["placement"]) == ("dynamic", "")
    df = make_frame([row("x", 1.0, "ms"), {**row("y", 2.0, "ms"), "dispatch_mode": "static"}], bench)
    order = CONTEXT_COLUMNS + list(setting_columns()) + COLUMNS[len(CONTEXT_COLUMNS):]
    assert list(df.columns) == order and list(df.dispatch_mode) == ["dynamic", "static"]
    assert (df.microbatches == 1).all() and (df.grad_sync == "").all()
    # each system writes its own field, every other system the field's absent value
    systems = {"occult_prune_score": ("system.budget=1", {"budget": 1}),
               "group_limit": ("system.topk_group=null", {"topk_group": None}),
               "tutel": ("system.a2a_ffn_overlap_degree=2", {"a2a_ffn_overlap_degree": 2}),
               "hierarchical": ("system.dedup=node", {"dedup": "node"})}
    absent = {name: setting_columns()[name][1] for name in SYSTEM_SETTINGS}
    assert absent == {"budget": -1, "topk_group": -1, "a2a_ffn_overlap_degree": -1, "dedup": ""}
    for system, (override, own) in systems.items():
        ctx = _context("task=layer", "cluster=cpu4", f"system={system}", override)
        assert {k: ctx[k] for k in SYSTEM_SETTINGS} == {**absent, **own}, system
    assert {k: layer[k] for k in SYSTEM_SETTINGS} == {k: bench[k] for k in SYSTEM_SETTINGS} == absent


def test_a_table_written_before_a_system_setting_was_a_column_reads_it_from_system_options(tmp_path):
    from analysis.load import load_runs
    from occult.records import write_results
    for system, override in (("hierarchical", "system.dedup=node"), ("group_limit", "system.topk_group=null"),
                             ("tutel", "system.a2a_ffn_overlap_degree=2")):
        new = make_frame([row("x", 1.0, "ms")], _context("task=layer", "cluster=cpu4", f"system={system}", override))
        write_results(new.drop(columns=list(SYSTEM_SETTINGS)), tmp_path / "old" / system)
        write_results(new, tmp_path / "new" / system)
    old, new = (load_runs(tmp_path / d).drop(columns="run_dir") for d in ("old", "new"))
    pd.testing.assert_frame_equal(old[list(new.columns)], new)
    assert new.set_index("system").loc[["hierarchical", "group_limit", "tutel"], list(SYSTEM_SETTINGS)].values.tolist() \
        == [[-1, -1, -1, "node"], [-1, None, -1, ""], [-1, -1, 2, ""]]


def _old_table(tmp_path: Path) -> pd.DataFrame:
    """The fixture's rows (written at 57d74c1) as the results table of a run folder."""
    from analysis.load import load_runs
    old = pd.read_csv(FIXTURE / "results.csv.gz", keep_default_na=False)
    assert {"microbatches", "grad_sync", "dispatch_mode"}.isdisjoint(old.columns)
    old.to_parquet(tmp_path / "results.parquet", index=False)
    return load_runs(tmp_path)


def test_a_table_written_at_57d74c1_reads_its_settings_as_columns(tmp_path):
    df = _old_table(tmp_path)
    assert not df.metric.isin(["microbatches", "grad_sync_mode"]).any()
    runs = df.groupby("label")[["microbatches", "grad_sync", "dispatch_mode", "migration", "placement"]].first()
    assert runs.loc[""].tolist() == [1, "end", "dynamic", False, "contiguous"]
    assert runs.loc["mb2_overlap"].tolist() == [2, "overlap", "dynamic", False, "contiguous"]


def test_a_table_written_at_57d74c1_gives_the_same_strategies_tables(tmp_path):
    from analysis.figures.strategies import schedules, strategies_table
    df = _old_table(tmp_path)
    expected = pd.read_csv(FIXTURE / "strategies.csv").fillna({"label": ""})       # its other blanks: NaN
    got = strategies_table(df).reset_index(drop=True)
    pd.testing.assert_frame_equal(got[expected.columns], expected, check_dtype=False, rtol=1e-9)
    [section] = schedules(df)
    expected = pd.read_csv(FIXTURE / "schedules.csv", keep_default_na=False)
    got = section.tables[0][1].reset_index(drop=True)
    pd.testing.assert_frame_equal(got, expected, check_dtype=False, rtol=1e-9)
