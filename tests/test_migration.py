"""Sequence migration (task.migration, Luffy): its assignment and its bad input. Its
exactness, accounting and counters run in tests/test_models.py's P = 2 world (which has
paid for importing the models already)."""
import pytest
import torch

from occult.errors import ConfigError
from occult.tasks.migration import balanced_assignment

def test_balanced_assignment_follows_scores_and_keeps_batches_equal():
    score_GP = torch.tensor([[0.0, 5.0], [1.0, 1.0], [3.0, 0.0], [9.0, 0.0]])     # sequences 0, 1 home 0; 2, 3 home 1
    # 3 -> 0 (9), 0 -> 1 (5), 2 -> 0 (3: rank 0 is full now), 1 -> 1
    assert balanced_assignment(score_GP, 2).tolist() == [1, 1, 0, 0]
    assert balanced_assignment(torch.zeros(4, 2), 2).tolist() == [0, 0, 1, 1]      # ties stay home
    dest = balanced_assignment(torch.tensor([[9.0, 0.0], [8.0, 0.0], [7.0, 0.0], [6.0, 0.0]]), 2).tolist()
    assert dest == [0, 0, 1, 1]                                    # rank 0 full: the rest run on rank 1


@pytest.mark.parametrize("overrides, line", [
    (["task=layer", "task.migration=true"], "task.migration: task=layer does not read it; its fields: "),
    (["task=bench", "task.migration=true"], "task.migration: task=bench does not read it; its fields: "),
    (["task=decode", "model=olmoe_proxy", "task.migration=true"],
     "task.migration=true: task=decode would move each migrated sequence's KV cache"),
    (["task=prefill", "model=olmoe_proxy", "system=reference", "task.migration=true"],
     "task.migration=true: system=reference runs no expert parallelism"),
])
def test_migration_where_it_cannot_run_is_refused_in_one_line(overrides, line):
    """A task without sequences has no such field (composition refuses it); decode and a
    system without expert parallelism are refused at validation."""
    from hydra.errors import ConfigCompositionException

    from occult.cli import describe
    from occult.validate import validate
    from test_task_options import cfg_with

    with pytest.raises((ConfigCompositionException, ConfigError)) as err:
        validate(cfg_with(*overrides))
    message = describe(err.value) if isinstance(err.value, ConfigCompositionException) else str(err.value)
    assert message.startswith(line) and "\n" not in message


def test_migration_is_accepted_on_prefill_and_train():
    from occult.validate import validate
    from test_task_options import cfg_with
    for task in ("prefill", "train"):
        validate(cfg_with(f"task={task}", "model=olmoe_proxy", "cluster=cpu2", "task.migration=true"))


def test_runs_stored_before_migration_was_a_later_key_still_resume():
    """A run stored with task.migration=false (its default) before the key was a later key
    is the same config as one without it; migration=true is not."""
    from occult.config import later_keys
    from occult.records import config_diff
    assert config_diff({"task.migration": False, "seed": 0}, {"seed": 0}, later_keys()) == []
    assert config_diff({"seed": 0}, {"task.migration": True, "seed": 0}, later_keys()) == [
        "task.migration: '<absent>' -> True"]
