"""The run context (:mod:`occult.ep.context`): the five switches that change what a
collective does live in one module, are entered for a block and restored after it, and each
is seen where its collectives run (per context, per thread, per process)."""
import threading

import torch

from occult.ep import context
from occult.ep.accounting import Recorder, active_recorder, recording
from occult.ep.comm import collective_guard
from occult.ep.static import dynamic_calls
from occult.ep.strands import co_execute, current_strand


def test_each_switch_is_entered_for_a_block_and_restored_after_it():
    rec, guard = Recorder(rank=0), object()
    before = context.current()
    assert (before.recorder, before.dynamic, before.strand, before.guard) == (None, False, None, None)
    with context.entered(recorder=rec, dynamic=True, guard=guard, strand="s") as state:
        assert (state.recorder, state.dynamic, state.guard, state.strand) == (rec, True, guard, "s")
        with context.entered(recorder=None):                  # nested: only what it names changes
            assert context.current().recorder is None and context.current().guard is guard
        assert context.current().recorder is rec
    assert context.current() == before
    # the named entries are the same switches
    with recording(rec), dynamic_calls(), collective_guard(guard):
        state = context.current()
        assert active_recorder() is rec and state.dynamic and state.guard is guard


def test_a_guard_is_seen_by_every_thread_a_recorder_by_the_strands_a_strand_by_its_own_thread():
    rec, guard, seen = Recorder(rank=0), object(), {}
    with recording(rec), collective_guard(guard):
        other = threading.Thread(target=lambda: seen.update(plain=context.current()))
        other.start()
        other.join()
        strands = co_execute([lambda: context.current(), lambda: context.current()], "cpu")
    assert seen["plain"].guard is guard and seen["plain"].recorder is None   # a thread without the context
    assert [s.recorder for s in strands] == [rec, rec] and all(s.guard is guard for s in strands)
    assert [s.strand.index for s in strands] == [0, 1] and current_strand() is None
    context.use_device(torch.device("cpu"))
    assert context.current().sync_device is None                            # a CPU rank synchronises nothing
