"""The recipes pre-training and fine-tuning share (occult/tasks/training.py): the
schedules are the ones each task ran before they moved there (the cached proxies and the
fine-tuning results rest on them), and the global gradient clip counts replicated
weights once."""
import math

import pytest

from occult.tasks.training import Schedule, finetuning_schedule, pretraining_schedule


@pytest.mark.parametrize("steps", [1, 3, 20, 100, 400])
def test_the_schedules_are_the_tasks_own(steps):
    warm = max(1, steps // 20)
    pretraining = [min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
                   for s in range(steps + 1)]
    assert [pretraining_schedule(steps).factor(s) for s in range(steps + 1)] == pretraining
    warm = max(1, steps // 10)
    finetuning = [(s + 1) / warm if s < warm else
                  0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ((s - warm) / max(1, steps - warm))))
                  for s in range(steps + 1)]
    assert [finetuning_schedule(steps).factor(s) for s in range(steps + 1)] == finetuning


def test_a_schedule_warms_up_then_decays_to_its_floor():
    s = Schedule(steps=100, warmup=10, overlap=False)
    assert s.factor(0) == pytest.approx(0.1) and s.factor(9) == pytest.approx(1.0)
    assert s.factor(100) == pytest.approx(0.1)
    assert max(s.factor(i) for i in range(101)) == pytest.approx(1.0)
