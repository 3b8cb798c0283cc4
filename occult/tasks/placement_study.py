"""task=placement_study: Occult's expert placement rescheduling judged on held-out text.

On the trained proxy and P = ``cluster.world_size`` ranks, the expert-parallel model
(``system=occult``, contiguous placement) runs over

* a profiling set: ``task.tokens_per_rank`` tokens per rank of seeded random windows of
  ``task.corpus`` / ``task.split`` (shakespeare train), and
* held-out tokens: the validation split of ``task.corpus``, split evenly over ranks (at
  most ``task.held_out_tokens`` per rank, whole windows; null: the whole split),

and the recorder keeps every token's top-k ids per MoE layer (and its home rank). Every
optimiser of ``task.optimisers`` then runs at every load cap of ``task.load_caps``
(swap_search for at most ``task.swap_time_limit_s`` per job) on every layer's profiling ids (the jobs are
shared out over the ranks); each placement is judged on the held-out ids. The run's rows
hold the study's table (``phase`` = ``<optimiser>@<cap>``, per layer: held-out ``ct_all,
ct_remote, intra_ratio, load_max_over_mean, busiest_rows_vs_contiguous`` (the busiest
device's (token, expert) rows over the same figure under the contiguous placement),
``busiest_sfd_rows_vs_contiguous`` (the busiest device's received Occult rows),
``solve_s`` and the profiling ``ct_all_profiling, load_max_over_mean_profiling``);
rank 0 writes into the run folder one placement artifact per cap,
``placements_cap-<cap>.json``: for each cap the best placement per layer (lowest
profiling C_T among the optimisers that meet the cap on the profiling set), for
``system=occult_placed system.placement_file=...``. The report builder
:mod:`analysis.figures.placement_study` draws the table and the C_T-vs-load front.

Shapes: T tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Optional

import torch
import torch.distributed as dist

from ..columns import later
from ..ep.measure import clock
from ..errors import ConfigError
from ..placement.study import cap_label, judge, placement_frame, save_artifacts, study_jobs, study_rows
from ..spec import RunSpec
from .schema import Corpus, Gated, HeldOut, at_least


@dataclass
class Config(Gated, HeldOut, Corpus):
    """task=placement_study: placement optimisers judged on held-out routing
    (:mod:`occult.tasks.placement_study`). ``tokens_per_rank``: profiling tokens per rank,
    in windows of ``seq_len`` tokens of ``corpus`` / ``split``; ``held_out_tokens``: held-out
    tokens per rank of the corpus's validation split (null: the whole split)."""

    tokens_per_rank: int = 1024
    held_out_tokens: Optional[int] = later(None)
    # the optimisers (occult.placement) run at every load cap (null: none; max / mean device
    # load on the profiling set), and swap_search's time limit per (layer, cap)
    optimisers: List[str] = later(["contiguous", "random", "greedy", "swap_search"])
    load_caps: List[Optional[float]] = later([None, 1.25, 1.15, 1.1])
    swap_time_limit_s: float = later(10.0)

    entry: ClassVar[str] = "occult.tasks.placement_study.run"
    prepare: ClassVar[str] = "occult.tasks.model.prepare"
    whole_model: ClassVar[bool] = True
    expert_parallel_only: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        at_least("tokens_per_rank", self.tokens_per_rank, 1)
        if self.held_out_tokens is not None:
            at_least("held_out_tokens", self.held_out_tokens, 1)
        from ..placement import OPTIMISERS

        unknown = [o for o in self.optimisers if o not in OPTIMISERS]
        if not self.optimisers or unknown:
            raise ConfigError(f"task.optimisers={list(self.optimisers)}: allowed values are {sorted(OPTIMISERS)} "
                              "(at least one)")
        if not self.load_caps or any(c is not None and c < 1.0 for c in self.load_caps):
            raise ConfigError(f"task.load_caps={list(self.load_caps)}: allowed values are null (no cap) or "
                              "numbers >= 1.0 (max / mean device load), at least one")
        if self.swap_time_limit_s <= 0:
            raise ConfigError(f"task.swap_time_limit_s={self.swap_time_limit_s}: must be > 0 seconds")


TRACE_WINDOWS_PER_BATCH = 8


def _windows_forward(ctx, model, windows: list) -> dict:
    """Runs the rank model over ``windows`` (list of (x_BS, y_BS)); returns {layer: ids [T, K]}."""
    from ..ep import Recorder
    from ..ep.accounting import recording

    rec = Recorder(rank=ctx.rank)
    with torch.no_grad(), recording(rec):
        for x_BS, _ in windows:
            model(input_ids=x_BS.to(ctx.device))
    per_layer: dict = {}
    for layer, ids_TK, *_ in rec.routing:
        per_layer.setdefault(layer, []).append(ids_TK)
    # device-to-host: the placement study optimises on the host
    return {layer: torch.cat(parts).cpu() for layer, parts in per_layer.items()}


def _gather_ids(ctx, local: dict) -> tuple[dict, torch.Tensor]:
    """Every rank's {layer: ids [T_r, K]} concatenated in rank order, and each token's home
    rank [T] (the same on every rank)."""
    gathered = [local]
    if ctx.world_size > 1:
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, local, group=ctx.ep.group)
    layers = sorted(gathered[0])
    ids = {layer: torch.cat([g[layer] for g in gathered]) for layer in layers}
    home = torch.cat([torch.full((g[layers[0]].shape[0],), r, dtype=torch.long, device="cpu")
                      for r, g in enumerate(gathered)])
    return ids, home


def collect_traces(ctx, cfg) -> tuple[dict, dict, torch.Tensor]:
    """Profiling and held-out routing of the rank model: ``(profile_ids, held_ids,
    held_home)``, {layer: [T, K]} over all ranks, and the held-out tokens' home ranks."""
    from ..data.batches import batch_iterator, eval_batches, token_ids
    from .training import rank_eval_ids
    from .model import setup

    t = cfg.task
    model, tok, _ = setup(ctx, cfg, TRACE_WINDOWS_PER_BATCH * t.seq_len)      # the most a traced batch holds
    train_ids = token_ids(t.corpus, t.split, tok)
    windows = max(1, t.tokens_per_rank // t.seq_len)
    per_batch = min(TRACE_WINDOWS_PER_BATCH, windows)
    prof = list(batch_iterator(train_ids, per_batch, t.seq_len, seed=cfg.seed * 1000 + ctx.rank + 1,
                               num_batches=-(-windows // per_batch)))
    held_bound = 0 if t.held_out_tokens is None else t.held_out_tokens       # rank_eval_ids' 0: the whole split
    held_N = rank_eval_ids(ctx, token_ids(t.corpus, "validation", tok), t.seq_len, held_bound)
    held = list(eval_batches(held_N, TRACE_WINDOWS_PER_BATCH, t.seq_len))
    if ctx.rank == 0:
        print(f"placement study: tracing {windows * t.seq_len} profiling and {held_N.numel() - 1} held-out "
              f"tokens per rank", flush=True)
    profile_ids, _ = _gather_ids(ctx, _windows_forward(ctx, model, prof))
    held_ids, held_home = _gather_ids(ctx, _windows_forward(ctx, model, held))
    return profile_ids, held_ids, held_home


def run_jobs(ctx, jobs: list, profile_ids: dict, held_ids: dict, held_home: torch.Tensor, num_experts: int,
             seed: int, time_limit_s: float) -> list:
    """This rank's share of the jobs (job i on rank i % P); returns result dicts."""
    from ..placement import optimise

    out = []
    mine = [job for i, job in enumerate(jobs) if i % ctx.world_size == ctx.rank]
    for j, (name, cap, layer) in enumerate(mine):
        t0 = clock()
        pl = optimise(name, profile_ids[layer], num_experts, ctx.world_size, load_cap=cap, seed=seed,
                      time_limit_s=time_limit_s)
        solve_s = clock() - t0
        res = {"optimiser": name, "load_cap": cap_label(cap), "layer": layer, "solve_s": solve_s,
               "groups": pl.groups(), **judge(pl, profile_ids[layer], held_ids[layer], held_home)}
        out.append(res)
        if ctx.rank == 0:
            print(f"  [{j + 1}/{len(mine)} on rank 0] {name} cap={cap_label(cap)} layer {layer}: "
                  f"held-out C_T {res['ct_all']:.3f}, load {res['load_max_over_mean']:.3f}, "
                  f"{solve_s:.1f} s", flush=True)
    return out


def run(ctx, spec: RunSpec) -> list:
    """task=placement_study on one rank (see the module docstring); rank 0 writes the outputs."""
    E = spec.model.num_experts
    t0 = clock()
    profile_ids, held_ids, held_home = collect_traces(ctx, spec)
    optimisers, caps = list(spec.task.optimisers), list(spec.task.load_caps)
    jobs = study_jobs(sorted(profile_ids), optimisers, caps)
    if ctx.rank == 0:
        print(f"placement study: {len(jobs)} jobs ({len(optimisers)} optimisers x {len(caps)} caps x "
              f"{len(profile_ids)} layers) on {ctx.world_size} rank(s)", flush=True)
    mine = run_jobs(ctx, jobs, profile_ids, held_ids, held_home, E, spec.seed, spec.task.swap_time_limit_s)
    gathered = [mine]
    if ctx.world_size > 1:
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.ep.group)
    if ctx.rank != 0:
        return []
    results = [r for part in gathered for r in part]
    out_dir = Path(spec.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    df = placement_frame(results, optimisers, caps)
    meta = {"model": spec.model.name, "checkpoint": spec.checkpoint, "num_experts": E,
            "world_size": ctx.world_size, "top_k": spec.model.top_k, "profiling": f"{spec.task.corpus}/{spec.task.split}",
            "profiling_tokens": int(next(iter(profile_ids.values())).shape[0]),
            "heldout_tokens": int(held_home.numel()), "seed": spec.seed}
    paths = save_artifacts(results, out_dir, meta, caps)
    print(f"placement study: artifacts {[str(p) for p in paths]} ({clock() - t0:.0f} s)", flush=True)
    return study_rows(df)


