"""The combination matrix (:mod:`occult.matrix`): generated from the capability records,
its cases cover every accepted pair of axis values, validation accepts its cases and
refuses, in one line, every pair the records refuse."""
import itertools

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError

from occult.cli import describe
from occult.config import CONF_DIR, register
from occult.errors import ConfigError
from occult.matrix import axes, cases, first_case, label, matrix, overrides, pair_case, pairs_of, refusal
from occult.validate import validate

from matrix_helpers import case_cfg


def test_the_cases_cover_every_accepted_pair_and_only_accepted_combinations():
    m, out = matrix(), cases()
    covered = set().union(*(pairs_of(c) for c in out))
    assert covered == m.accepted_pairs, f"uncovered: {sorted(m.accepted_pairs - covered, key=repr)[:5]}"
    assert not any(refusal(c) for c in out)
    # the count: every pair of two axes' values is accepted or refused, none both
    every = sum(len(axes()[a]) * len(axes()[b]) for a, b in itertools.combinations(axes(), 2))
    assert len(m.accepted_pairs) + len(m.refused_pairs) == every
    assert not m.accepted_pairs & m.refused_pairs
    assert 60 <= len(out) <= 180 and len({label(c) for c in out}) == len(out)
    assert [c["system"] for c in out[:len(axes()["system"])]] == list(axes()["system"])   # one per system first
    assert cases() == out, "seeded: the same list every time"


def _refused_in_one_line(case: dict) -> str:
    """The one-line error validation (or, for a field the task has not, composition)
    gives ``case``."""
    try:
        cfg = case_cfg(case)
    except ConfigAttributeError:          # a field the task's schema lacks: refused when composed
        register()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            with pytest.raises(ConfigCompositionException) as err:
                compose("config", overrides=overrides(case))
        return describe(err.value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    return str(err.value)


def test_every_pair_the_records_refuse_is_refused_at_validation_in_one_line():
    refused = sorted(matrix().refused_pairs, key=repr)
    assert refused
    for pair in refused:
        (a, v), (b, w) = pair
        line = _refused_in_one_line(pair_case(pair))
        assert line and "\n" not in line, (pair, line)
        # the line names the system or the field it refuses
        named = {"system": "system", "dispatch_mode": "dispatch_mode", "replica_rule": "replica_policy",
                 "payload": "payload", "placement": "placement", "migration": "migration",
                 "microbatches": "microbatches", "grad_sync": "grad_sync"}
        assert any(named.get(axis, axis) in line for axis in (a, b)), (pair, line)


@pytest.mark.slow     # 7 s; the default run's cases are among them
def test_every_case_of_the_matrix_validates():
    for case in cases():
        validate(case_cfg(case))


def _run(cases_: list) -> list:
    """Runs ``cases_`` in their worlds (P = 2, one node; P = 4, two nodes of two): the failures."""
    from occult.dist import launch
    from occult.matrix import world_of

    from matrix_helpers import failures, matrix_world
    out = []
    for world in sorted({world_of(c) for c in cases_}):
        mine = [c for c in cases_ if world_of(c) == world]
        P, G = world
        results = launch(matrix_world, P, (mine,), devices_per_node=G, timeout_s=1500, collective_timeout_s=120)
        for i, case in enumerate(mine):
            out += failures(case, [results[r][i] for r in range(P)])
    return out


@pytest.mark.timeout(600)
def test_one_case_per_system_runs_the_whole_model_as_the_single_device_model_does():
    """Each system's default-run case (training, micro-batches where its record allows them):
    forward and backward against the single-device model, valid <= wire rows, a non-yielding
    collective's exposed time its whole time, the plan's traffic the logged one."""
    bad = _run([first_case(s) for s in axes()["system"]])
    assert not bad, "\n".join(bad[:30])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_case_of_the_matrix_runs_the_whole_model_as_the_single_device_model_does():
    bad = _run(cases())
    assert not bad, "\n".join(bad[:40])
