"""task=bench_model: systems side by side on a whole model in one world.

    python run.py task=bench_model model=olmoe_proxy task.workload=train 'task.compare=[naive,occult]'

A whole model (a trained proxy) on ``task.workload`` (prefill, decode or train: that task's
own iterations, :mod:`occult.tasks.model`, run with that task's config built from this one's
fields, :func:`occult.tasks.schema.workload_task`), one rank model per system of
``task.compare`` from the same weights (:mod:`occult.tasks.compare`). Every system is first
checked against the single-device reference; then the systems' iterations alternate.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Dict

from ..ep import Recorder
from ..ep.measure import barrier, iterations
from ..ep.static import times_by_marks
from ..errors import ConfigError
from ..spec import RunSpec
from .common import model_parity_gate, parity_gate
from .compare import model_replay_rows, tagged, turns
from .schema import (WORKLOAD_NAMES, Compared, Exchanges, Gated, Generates, HeldOut, Text, Timed, Trained,
                     workload_task)


@dataclass
class Config(Timed, Gated, Exchanges, Text, HeldOut, Compared, Generates, Trained):
    """task=bench_model: systems side by side on a whole model's ``workload`` (the
    prefill, decode or train task's own iterations)."""

    workload: str = "prefill"           # prefill | decode | train

    entry: ClassVar[str] = "occult.tasks.bench_model.run"
    prepare: ClassVar[str] = "occult.tasks.compare.prepare"
    whole_model: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        if self.workload not in WORKLOAD_NAMES:
            raise ConfigError(f"task.workload={self.workload!r}: allowed values are {list(WORKLOAD_NAMES)}")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.workload != "decode":
            out["new_tokens"] = "read only with task.workload=decode"
        if self.workload != "train":
            out["lr"] = "read only with task.workload=train"
        else:
            out["split"] = "not read with task.workload=train (training batches come from the train split)"
        return out


def run(ctx, spec: RunSpec) -> list:
    """task=bench_model on every rank: parity per system, one rank model per system from
    the same weights, then the systems' ``task.workload`` iterations alternating."""
    from ..data.tokenizer import get_tokenizer
    from ..models.runtime import base_model, make_rank_model
    from .model import WORKLOADS, _finish

    t, m = spec.task, spec.model
    work_spec = spec.replace(task=workload_task(t, t.workload))        # what each system's workload runs
    tok = get_tokenizer(spec.pretrain.tokenizer_vocab, corpus=spec.pretrain.corpus)
    base = base_model(spec, m.vocab_size or tok.vocab_size, spec.checkpoint, device=ctx.device)
    works, recs, rows = [], [], []
    for config in spec.compared:
        rows.append(parity_gate(ctx, spec, config, "router") + model_parity_gate(ctx, work_spec, config)
                    if t.check_parity and config.expert_parallel else [])
        model = make_rank_model(ctx, copy.deepcopy(base), spec, system=config,
                                tokens_per_rank=work_spec.task.call_tokens())
        works.append(WORKLOADS[t.workload](ctx, work_spec, tok, model))
        recs.append(Recorder(rank=ctx.rank, sync_collectives=t.sync_collectives, marks=times_by_marks(config)))
    for sample in iterations(ctx.ep, t.warmup, t.iters):
        for i in turns(len(works), sample):
            recs[i].clear()
            barrier(ctx.ep)
            rows[i] += works[i].step(recs[i], sample)
    replayed = model_replay_rows(ctx, works, t.iters) if ctx.world_size > 1 else [[] for _ in works]
    base_id = f"{spec.experiment_name}/bench_model/{m.name}/{t.workload}/{spec.cluster.name}/{spec.run_digest}"
    out = []
    for i, config in enumerate(spec.compared):
        rows_i = _finish(ctx, work_spec, recs[i], rows[i], works[i].model) + replayed[i]
        out += tagged(rows_i, config, base_id, ctx.world_size)
    return out
