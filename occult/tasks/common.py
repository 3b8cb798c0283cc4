"""Pieces every task uses: the parity gates (a layer; the whole model under the run's
schedule), recorder -> rows."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..ep import Placement, Recorder, system_config
from ..ep.accounting import TokenDevices, token_devices
from ..ep.measure import gather_objects, sum_over_ranks
from ..models.families import family_of, gate_rule
from ..parity import TOLERANCE, LayerCase, check_layer, check_model, disagreements
from ..records import row
from ..schemas import ModelConf, plain, typed


def parity_gate(ctx, cfg, system, routing: str, placement: Optional[Placement] = None) -> list:
    """Checks ``system`` (a system config or its dict) against the single-device reference
    on a small float64 problem with the run's E, K, gate rule (the model's router: its
    scores, group limit and weights, with a drawn correction bias where the router selects
    with one), P and placement (default: the system's
    placement of the model's first MoE layer), ``cfg.task.parity_tokens`` tokens per rank
    drawn from the run's seed, to the tolerance of the system's precision
    (:func:`occult.parity.disagreements`); raises if it disagrees. A lossy system is checked
    with its loss switched off (``lossless_options``; row ``loss_off_parity``); one whose
    loss cannot be switched off is not checked (``parity_checked`` 0).

    Returns result rows with the relative errors.
    """
    config, rows = _checked_config(system, ctx.rank)
    if config is None:
        return rows + [row("parity_checked", 0.0, "bool", rank=ctx.rank)]
    m = typed(ModelConf, cfg.model)
    case = LayerCase(m.num_experts, m.top_k, tuple([cfg.task.parity_tokens] * ctx.world_size),
                     routing="router" if routing == "router" else "uniform", seed=cfg.seed,
                     rule=gate_rule(m), bias=bool(m.family) and family_of(m.family).correction_bias)
    if placement is None:
        placement = config.layer_placement(m.first_k_dense, m.num_experts, ctx.world_size)
    res = check_layer(ctx, config, case, placement)
    bad = disagreements(res, config)
    if bad:
        rel_tol, abs_tol = TOLERANCE[config.precision]
        raise AssertionError(f"system={config.name} disagrees with the single-device reference "
                             f"(relative errors {bad}; tolerance for {config.precision}: relative "
                             f"{rel_tol:g}, absolute {abs_tol:g}); nothing was timed")
    return rows + [row("parity_checked", 1.0, "bool", rank=ctx.rank)] + \
        [row(f"parity_{k}", v, "ratio", rank=ctx.rank) for k, v in res["errors"].items()]


def _checked_config(system, rank: int) -> tuple:
    """The config a parity check runs for ``system``: itself when exact, else with its loss
    switched off (``lossless_options``; row ``loss_off_parity``), or None when its loss cannot
    be (a scheme that drops tokens or changes the routing is not top-k MoE by design).
    ``(config or None, rows)``."""
    config = system_config(system)
    if config.is_exact():
        return config, []
    off = config.lossless_options()
    if not off:
        return None, []
    return (system_config({"name": config.name, "_target_": config._target_, **config.options(), **off}),
            [row("loss_off_parity", 1.0, "bool", rank=rank)])


def schedule_changes(cfg) -> list:
    """What of the run makes the model compute other than layer by layer, each layer as
    alone (what the whole-model gate checks; [] for none): the task's schedule away from
    its defaults (:meth:`occult.tasks.schema.TaskConf.schedule_changes`: co-executed
    micro-batches, sequence migration, a gradient sync that starts during the backward),
    and a shortcut-connected model (each MoE block reads the one before it)."""
    m = typed(ModelConf, cfg.model)
    out = list(cfg.task.schedule_changes())
    if m.family and family_of(m.family).shortcut:
        out.insert(1 if out and out[0].startswith("task.microbatches") else 0,
                   f"model.family={m.family} (shortcut-connected)")
    return out


# the whole-model gate's tolerance (relative, on every quantity) by the system's precision:
# the layer gate's relative one (measured for Tutel, float32, on the OLMoE and ScMoE proxies'
# whole models at P = 2: at most 3.0e-7, logits and every gradient)
MODEL_TOLERANCE = {precision: rel for precision, (rel, _) in TOLERANCE.items()}


def model_parity_gate(ctx, cfg, system, placements: Optional[dict] = None, wrap: Optional[Callable] = None) -> list:
    """Where the run changes what the model computes beyond one layer
    (:func:`schedule_changes`): the whole model (the run's family, widths, layers and router;
    seeded random weights, float64, a 256-token vocabulary) under the run's schedule
    (micro-batches co-executed, its gradient sync, ``wrap``: e.g. sequence migration) and
    placements (``{layer: placement}``), forward, and for a training run backward (when
    the forward agrees on every rank), against the single-device model
    (:func:`occult.parity.check_model`), on ``max(microbatches, 2)`` sequences per rank of
    ``task.parity_tokens`` tokens in all; raises if any quantity is off by more than
    :data:`MODEL_TOLERANCE`. Returns rows (``model_parity_checked``, ``model_parity_*``);
    none when nothing of the schedule changes."""
    changes = schedule_changes(cfg)
    if not changes:
        return []
    config, rows = _checked_config(system, ctx.rank)
    if config is None:
        return rows + [row("model_parity_checked", 0.0, "bool", rank=ctx.rank)]
    t = cfg.task
    schedule = t.schedule()
    batch = max(schedule["microbatches"], 2) if "microbatches" in schedule else 2
    seq_len = max(2, t.parity_tokens // batch)
    job = {"model": {**plain(cfg.model), "dtype": "float64"}, "seed": cfg.seed, "task": schedule}
    tol = MODEL_TOLERANCE[config.precision]
    trains = t.trains()
    res = check_model(ctx, job, batch, seq_len, placements=placements, system=config, wrap=wrap,
                      forward_tolerance=tol, backward=trains)
    bad = {k: v for k, v in res["errors"].items() if not v <= tol}
    if bad or not res["forward_agrees"]:
        what = (f"relative errors {bad}" if bad else f"another rank's forward is off (this rank's relative errors "
                                                     f"{res['errors']})")
        if trains and not res["backward"]:
            what += ", the backward not run"
        raise AssertionError(f"system={config.name} under {', '.join(changes)}: the whole model disagrees with the "
                             f"single-device model ({what}; tolerance for {config.precision}: {tol:g}); "
                             "nothing was timed")
    return rows + [row("model_parity_checked", 1.0, "bool", rank=ctx.rank)] + \
        [row(f"model_parity_{k}", v, "ratio", rank=ctx.rank) for k, v in res["errors"].items()]


def bandwidth_rows(ev, world_size: int, sample: int) -> list:
    """An all-to-all's algorithm and bus bandwidth as nccl-tests defines them (GB/s, 1e9
    bytes/s): S = the bytes this rank sends, its own block included (with uneven splits S is
    this rank's own total), algbw = S / t, busbw = algbw x (n - 1) / n. None for another
    collective or one without time."""
    if ev.collective != "all_to_all" or ev.seconds <= 0:
        return []
    algbw = sum(ev.rows_P) * ev.row_bytes / ev.seconds / 1e9
    common = dict(layer=ev.layer, rank=ev.src_rank, phase=ev.phase, direction=ev.direction, sample=sample)
    return [row("algbw", algbw, "GB/s", **common),
            row("busbw", algbw * (world_size - 1) / world_size, "GB/s", **common)]


def timing_rows(rec: Recorder, sample: int) -> list:
    """Spans and collective times of one timed iteration, in ms; each all-to-all's algbw and
    busbw (:func:`bandwidth_rows`)."""
    rec.settle()            # a recorder that times by marks reads them now, after the step
    rows = [row("time", s * 1e3, "ms", layer=layer, rank=rec.rank, phase=name, direction=direction,
                sample=sample) for layer, name, direction, s in rec.spans]
    rows += [row("a2a_time", ev.seconds * 1e3, "ms", layer=ev.layer, rank=rec.rank, phase=ev.phase,
                 direction=ev.direction, sample=sample) for ev in rec.comm]
    for ev in rec.comm:
        rows += bandwidth_rows(ev, len(ev.rows_P), sample)
    if rec.sync_collectives:
        rows += [row("a2a_wait", ev.wait_seconds * 1e3, "ms", layer=ev.layer, rank=rec.rank,
                     phase=ev.phase, direction=ev.direction, sample=sample) for ev in rec.comm]
    return rows


# the unit of a dispatcher's counter, by a word in its name (default: pairs)
COUNTER_UNITS = {"rows": "rows", "experts": "experts", "degree": "chunks", "sequences": "sequences"}


def counter_unit(name: str) -> str:
    return next((unit for word, unit in COUNTER_UNITS.items() if word in name.split("_")), "pairs")


def comm_rows(rec: Recorder, per_peer: bool = True) -> list:
    """Rows and bytes this rank sent to each peer, per layer, phase and pass (unless
    ``per_peer`` is false); the number of collectives of each kind per layer, phase and pass;
    and the dispatchers' counters (dropped pairs, padding rows), summed per layer. A fixed
    buffer's collective (static dispatch) also gives, per peer, its ``valid_rows`` and
    ``valid_bytes`` (what a low-latency kernel would send) and ``padding_wire_rows`` beside the
    wire's ``rows`` and ``bytes`` (what was sent here), read from the device now
    (:meth:`occult.ep.accounting.Recorder.settle`)."""
    rec.settle()
    counters: dict = {}
    for layer, name, value in rec.counters:
        counters[(layer, name)] = counters.get((layer, name), 0.0) + value
    out = [row(name, value, counter_unit(name), layer=layer, rank=rec.rank)
           for (layer, name), value in sorted(counters.items())]
    calls: dict = {}
    for ev in rec.comm:
        for dst, n in enumerate(ev.rows_P if per_peer else ()):
            common = dict(layer=ev.layer, rank=rec.rank, phase=ev.phase, direction=ev.direction,
                          src_rank=ev.src_rank, dst_rank=dst)
            out.append(row("rows", n, "rows", **common))
            out.append(row("bytes", n * ev.row_bytes, "bytes", **common))
            if ev.meta_row_bytes:      # of those bytes, the metadata riding with the rows
                out.append(row("meta_bytes", n * ev.meta_row_bytes, "bytes", **common))
            if ev.valid_P is not None:
                valid = ev.valid_P[dst]
                out += [row("valid_rows", valid, "rows", **common),
                        row("valid_bytes", valid * ev.row_bytes, "bytes", **common),
                        row("padding_wire_rows", n - valid, "rows", **common)]
        key = (ev.layer, ev.phase, ev.direction, ev.collective)
        calls[key] = calls.get(key, 0) + 1
    # how many collectives of each kind (all_to_all_calls, broadcast_calls, ...) ran
    out += [row(f"{kind}_calls", n, "calls", layer=layer, rank=rec.rank, phase=phase, direction=direction)
            for (layer, phase, direction, kind), n in sorted(calls.items())]
    return out


def step_traffic_rows(events, steps: int, rank: int, sample: int) -> list:
    """What this rank sent other ranks per decode step, forward (``events``: the steps'
    collectives, settled): ``step_wire_bytes`` (on the wire here, padding included),
    ``step_valid_bytes`` (the valid rows: what a low-latency kernel sends; every row of a
    dynamic exchange is valid) and ``step_padding_rows``; none without steps."""
    if steps < 1:
        return []
    wire = valid = padding = 0
    for ev in events:
        if ev.direction != "forward":
            continue
        for dst, n in enumerate(ev.rows_P):
            if dst != ev.src_rank:
                v = n if ev.valid_P is None else ev.valid_P[dst]
                wire, valid, padding = wire + n * ev.row_bytes, valid + v * ev.row_bytes, padding + n - v
    where = dict(rank=rank, phase="decode", direction="forward", sample=sample)
    return [row("step_wire_bytes", wire / steps, "bytes", **where),
            row("step_valid_bytes", valid / steps, "bytes", **where),
            row("step_padding_rows", padding / steps, "rows", **where)]


def step_span_rows(spans, steps: int, rank: int, sample: int) -> list:
    """Per decode step, the time this rank spent in each named span of the steps (``spans``:
    the recorder's spans after the prompt; forward only), summed over layers: ``step_span_time``
    rows, ``phase`` the span's name (e.g. a system's own index work, ``occult_index``)."""
    if steps < 1:
        return []
    total: dict = {}
    for _, name, direction, seconds in spans:
        if direction == "forward":
            total[name] = total.get(name, 0.0) + seconds
    return [row("step_span_time", s * 1e3 / steps, "ms", rank=rank, phase=name, direction="forward", sample=sample)
            for name, s in sorted(total.items())]


def token_rows(ids_TK: torch.Tensor, placement, home_T: torch.Tensor, layer: int, rank: int) -> list:
    """C_T (all, remote), intra-collaboration ratio and the token count of the tokens
    ``ids_TK`` (their home ranks ``home_T``), as rows of ``rank`` (-1: over all ranks)."""
    return token_rows_of(token_devices(ids_TK, placement, home_T), layer, rank)


def token_rows_of(stats: TokenDevices, layer: int, rank: int) -> list:
    """:func:`token_rows` from the tokens' :class:`occult.ep.accounting.TokenDevices` (a
    simulated world computes them once for all its tokens and slices them per rank)."""
    return [row("ct_all", stats.ct_all(), "devices/token", layer=layer, rank=rank),
            row("ct_remote", stats.ct_remote(), "devices/token", layer=layer, rank=rank),
            row("intra_ratio", stats.intra_ratio(), "ratio", layer=layer, rank=rank),
            row("tokens", stats.distinct_T.numel(), "tokens", layer=layer, rank=rank)]


def sent_rows(events, layer: int) -> dict:
    """Rows a rank sent in the ``dispatch`` and ``combine`` phases of ``layer``: {(phase, pass): rows}."""
    sent: dict = {}
    for ev in events:
        if ev.layer == layer and ev.phase in ("dispatch", "combine"):
            sent[(ev.phase, ev.direction)] = sent.get((ev.phase, ev.direction), 0) + sum(ev.rows_P)
    return sent


def rows_per_token_row(rows: int, tokens: int, layer: int, phase: str, direction: str) -> list:
    """Rows sent per token in a phase and pass over all ranks (none for a world without tokens)."""
    if tokens <= 0:
        return []
    return [row("rows_per_token", rows / tokens, "rows/token", layer=layer, rank=-1, phase=phase,
                direction=direction)]


def routing_rows(ctx, rec: Recorder, placement) -> list:
    """C_T (all, remote), intra-collaboration ratio, rows per token and the experts each rank
    holds (``expert_slots``, copies included), per rank and over all ranks (``rank=-1``, from an all-gather of every rank's top-k ids), computed
    on the host after the timed work. ``placement``: one Placement, or {layer: Placement}."""
    out = []
    per_layer: dict = {}
    for layer, ids, *_ in rec.routing:          # several calls per layer (decode steps): concatenated
        per_layer.setdefault(layer, []).append(ids)
    for layer, pieces in sorted(per_layer.items()):
        ids = torch.cat(pieces).cpu()          # device-to-host: the routing, after timing
        pl = (placement.get(layer) if isinstance(placement, dict) else placement).to("cpu")
        gathered = gather_objects(ctx.ep, ids)
        home = torch.cat([torch.full((g.shape[0],), r, dtype=torch.long, device="cpu")
                          for r, g in enumerate(gathered)])
        mine = torch.full((ids.shape[0],), ctx.rank, dtype=torch.long, device="cpu")
        out += token_rows(ids, pl, mine, layer, ctx.rank)
        if ctx.rank == 0:
            out += token_rows(torch.cat(gathered), pl, home, layer, -1)
        for (phase, direction), n in sorted(sent_rows(rec.comm, layer).items()):
            total = sum_over_ranks(ctx.ep, torch.tensor([n, ids.shape[0]], dtype=torch.long, device=ctx.device))
            if ctx.rank == 0:
                out += rows_per_token_row(total[0].item(), total[1].item(), layer, phase, direction)
        out += load_rows(ctx, rec.comm, ids, layer, pl.num_experts)
        # expert memory: the experts this rank holds, copies included (x 3 D F weights each)
        out.append(row("expert_slots", pl.num_local, "experts", layer=layer, rank=ctx.rank))
    return out


def received_rows_P(events, layer: int, world_size: int, phase: str = "dispatch",
                    direction: str = "forward") -> torch.Tensor:
    """Rows this rank sent to each rank in ``phase`` / ``direction`` of ``layer``, over its
    collectives of that phase: [P] (long; summed over ranks it is what each rank received)."""
    sent_P = torch.zeros(world_size, dtype=torch.long, device="cpu")
    for ev in events:
        if ev.layer == layer and ev.phase == phase and ev.direction == direction and len(ev.rows_P) == world_size:
            sent_P += torch.tensor(ev.rows_P, dtype=torch.long, device="cpu")
    return sent_P


def load_rows(ctx, events, ids_TK: torch.Tensor, layer: int, num_experts: int) -> list:
    """The load axis of one layer: rows each rank received in the dispatch (forward), from the
    split sizes that went into the collectives (``recv_rows``, per rank; ``recv_max_over_mean``
    over ranks, the field's MaxVio + 1; none for a system without a ``dispatch`` phase) and
    every expert's load (``expert_load``: pairs routed to it over all ranks, column ``expert``).
    A collective: every rank calls it."""
    P = ctx.world_size
    sent_P = received_rows_P(events, layer, P)
    keep = ids_TK[ids_TK >= 0]
    counts = torch.cat([sent_P, torch.bincount(keep, minlength=num_experts)[:num_experts],
                        torch.tensor([int(sent_P.sum() > 0)], dtype=torch.long, device="cpu")])
    total = sum_over_ranks(ctx.ep, counts.to(ctx.device)).cpu()
    recv_P, load_E, dispatched = total[:P], total[P:P + num_experts], int(total[-1]) == P
    out = []
    if dispatched:
        out.append(row("recv_rows", recv_P[ctx.rank].item(), "rows", layer=layer, rank=ctx.rank, phase="dispatch",
                       direction="forward"))
    if ctx.rank == 0:
        if dispatched and recv_P.sum() > 0:
            out.append(row("recv_max_over_mean", (recv_P.max() / recv_P.double().mean()).item(), "ratio",
                           layer=layer, phase="dispatch", direction="forward"))
        out += [row("expert_load", n, "pairs", layer=layer, expert=i) for i, n in enumerate(load_E.tolist())]
    return out
