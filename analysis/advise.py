"""Which strategy moves least and finishes first, and on how many GPUs, at my model, my cluster and my batch?

    python -m analysis.advise model=deepseek_v3 profile=sim_h200_nodes phase=decode tokens_per_rank=128
    python -m analysis.advise model=deepseek_v3 profile=sim_h200_nodes phase=decode tokens_per_rank=128 \\
        world_sizes=32,64,128,256 latency_ms=50
    python -m analysis.advise model=olmoe_proxy profile=sim_cpu_loopback world_size=4 phase=prefill \\
        tokens_per_rank=512 trace=runs/strategies/<a run with task.save_routing=true>

For each candidate strategy (``systems=``, default :func:`candidates`: every registered
system the query :data:`CANDIDATE_QUERY` selects from the capability records) and each world
size P the advisor simulates the model's MoE layers on P ranks in the profile's nodes
(``task=simulate``: the systems' own traffic plans, every rank, one process; ``occult_placed``
after ``task=place`` made its placement from a profiling set), all points in one ``python
run.py`` multirun (a generated experiment in ``out=``, default ``runs/advise/<stamp>``; a
progress line per point on stderr; rerunning into the same ``out`` resumes), prices them on the
profile with the cost model (:mod:`analysis.projection`) and prints one row per (strategy, P)
ranked by projected MoE-layer time, with the MoE layers' time per step, their tokens per second
per GPU, whether the step is within the bound, each point's bytes, messages and memory per GPU
beside it, then the best (strategy, P) per GPU, the best strategy at each P, and what every
number rests on.

Arguments (``key=value``): ``model`` (conf/model), ``profile`` (conf/profile or a YAML path),
``phase`` (decode | prefill | train: train also plans the backward), ``tokens_per_rank``,
``world_sizes`` (comma-separated P, each one the profile covers and that divides the model's
experts) or ``world_size`` (one P; not both; default: the largest world size of the profile
that divides the experts), ``latency_ms`` (a bound on the MoE layers' projected time per step;
default none), ``trace`` (a run folder with ``routing.parquet``: replay that routing),
``routing`` (router | uniform | zipf; default: ``router`` through the model's own routers or a
trained proxy of the same E and K (``<model>_proxy``), else ``uniform``), ``sample_layers``
(default 3), ``systems`` (comma-separated strategies; hierarchical as ``hierarchical_node`` /
``hierarchical_device``), ``devices_per_node`` (a measured profile's ranks grouped into nodes
of this size, its one loopback link serving within and across them: :func:`grouped`), ``out``.
A system with a ``profile`` option (a cost rule that decides its schedule: shadowing, the
pipeline degree) decides with the advised profile.

Per step: the MoE layers' time, projected MoE-layer ms x the model's MoE layers; attention and
dense layers are not modelled. Tokens per second per GPU: tokens per rank / that time (with
tokens per rank fixed it orders the rows as the time does; the bound and the memory fit decide
which qualify). The best per GPU: the most tokens per second per GPU among the rows within the
bound that fit (or why none qualifies). Memory per GPU
(:func:`analysis.figures.scale_study.memory_GB`, the scale study's): the MoE layers' routed
expert weights a rank holds (E / P experts x 3 D F elements x MoE layers) plus its largest
dispatch buffer (received rows x D elements); attention, shared experts, dense layers,
embeddings and caches are on every GPU too and not counted, so its fit is necessary, not
sufficient. Shapes: P ranks.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from occult.config import CONF_DIR, read_conf, select_systems
from occult.ep.profiles import load_profile

from .figures.scale_study import moe_layers, per_gpu, point_table, projected, strategy_of, why_none
from .load import load_runs

# occult_placed's placement: task=place on this many profiling tokens, swap_search capped per layer
PROFILE_TOKENS, PLACE_TIME_LIMIT_S = 16384, 5.0
# the systems whose traffic the advisor can simulate and rank: an exact expert-parallel scheme
# with a traffic plan, on any model (ScMoE's overlap needs its own shortcut-connected family)
CANDIDATE_QUERY = ("expert_parallel", "exact_forward", "traffic_plan", "not shortcut_overlap")
# a system advised once per value of an option (the scale study's strategies, scale_study.strategy_of)
VARIANTS = {"hierarchical": ("dedup", ("node", "device"))}
PHASES = ("decode", "prefill", "train")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Request:
    """What the user asked (see the module docstring)."""

    model: str
    profile: str
    phase: str = "decode"
    tokens_per_rank: int = 128
    world_size: int = 0             # one P (0: world_sizes, else the largest that divides the experts)
    world_sizes: tuple = ()         # several P: the advice is a (strategy, P) pair
    latency_ms: float = 0.0         # bound on the MoE layers' projected time per step (0: none)
    trace: Optional[str] = None
    routing: Optional[str] = None
    sample_layers: int = 3
    systems: tuple = ()             # () : every candidate (:func:`candidates`)
    devices_per_node: int = 0       # 0: the profile's nodes (:func:`grouped`)
    out: Optional[str] = None


def candidates() -> tuple:
    """The strategies the advisor may rank: every registered system that
    :data:`CANDIDATE_QUERY` selects (:func:`occult.config.select_systems`), a system of
    :data:`VARIANTS` once per value (``hierarchical_node``, ...)."""
    out = []
    for name in select_systems(CANDIDATE_QUERY):
        values = VARIANTS.get(name, (None, ()))[1]
        out += [f"{name}_{v}" for v in values] or [name]
    return tuple(out)


def parse(argv) -> Request:
    """``key=value`` arguments -> :class:`Request`; a bad one is a one-line ``ValueError``."""
    fields = {f for f in Request.__dataclass_fields__}
    kv = {}
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"{a!r}: arguments are key=value with key one of {sorted(fields)}")
        kv[key] = value
    for name in ("model", "profile"):
        if name not in kv:
            raise ValueError(f"{name}= is required (e.g. model=deepseek_v3 profile=sim_h200_nodes)")
    if kv.get("phase", "decode") not in PHASES:
        raise ValueError(f"phase={kv['phase']}: allowed values are {list(PHASES)}")
    if "world_size" in kv and "world_sizes" in kv:
        raise ValueError("world_size= and world_sizes= together: give one (world_sizes=32,64,... for several P)")
    for name in ("tokens_per_rank", "world_size", "sample_layers", "world_sizes", "latency_ms", "devices_per_node"):
        if name in kv:
            try:
                kv[name] = tuple(int(p) for p in kv[name].split(",") if p) if name == "world_sizes" else \
                    (float if name == "latency_ms" else int)(kv[name])
            except ValueError:
                raise ValueError(f"{name}={kv[name]}: allowed values are "
                                 + ("comma-separated integers" if name == "world_sizes" else
                                    "a number of ms" if name == "latency_ms" else "an integer")) from None
    if "latency_ms" in kv and not (math.isfinite(kv["latency_ms"]) and kv["latency_ms"] > 0):
        raise ValueError(f"latency_ms={kv['latency_ms']:g}: allowed values are a number of ms > 0")
    if kv.get("devices_per_node", 0) < 0:
        raise ValueError(f"devices_per_node={kv['devices_per_node']}: allowed values are 0 (the profile's nodes) "
                         "or a node size > 0")
    allowed = candidates()
    if "systems" in kv:
        kv["systems"] = tuple(s for s in kv["systems"].split(",") if s)
        unknown = [s for s in kv["systems"] if s not in allowed]
        if unknown:
            raise ValueError(f"systems={','.join(kv['systems'])}: allowed values are {list(allowed)}")
    else:
        kv["systems"] = allowed
    return Request(**kv)


def world_sizes_of(req: Request, num_experts: int) -> list:
    """The worlds the advice is for: ``world_sizes=`` or ``world_size=`` (each one the profile
    covers and that divides the experts, else a one-line ``ValueError`` naming the field and the
    allowed values), else the profile's largest world size that divides the experts."""
    sizes = load_profile(req.profile).sizes()
    fit = [p for p in sizes if p > 0 and num_experts % p == 0]
    asked = req.world_sizes or ((req.world_size,) if req.world_size else ())
    field = "world_sizes" if req.world_sizes else "world_size"
    for P in asked:
        if P not in sizes:
            raise ValueError(f"{field}={','.join(map(str, asked))}: profile={req.profile} covers world sizes {sizes}"
                             f" (not {P}); allowed values for this model: {fit}")
        if num_experts % P:
            raise ValueError(f"{field}={','.join(map(str, asked))}: {P} does not divide the model's {num_experts} "
                             f"experts; allowed values on profile={req.profile}: {fit}")
    if asked:
        return sorted(set(asked))
    if not fit:
        raise ValueError(f"profile={req.profile} covers world sizes {sizes}; "
                         f"none divides model's {num_experts} experts")
    return [max(fit)]


def world_size_of(req: Request, num_experts: int) -> int:
    """The largest world of :func:`world_sizes_of` (the one world when a single P is asked)."""
    return max(world_sizes_of(req, num_experts))


def routing_overrides(req: Request, model) -> list:
    """The routing source's overrides: the trace, the model's own routers, a proxy's, or synthetic."""
    if req.trace:
        return ["task.routing=trace", f"task.trace={req.trace}"]
    proxy = f"{model.name}_proxy"
    routing = req.routing
    if routing is None:
        has_own = bool(model.family) and bool(getattr(model, "proxy", False))
        has_proxy = (CONF_DIR / "model" / f"{proxy}.yaml").is_file() and \
            (read_conf("model", proxy).num_experts, read_conf("model", proxy).top_k) == (model.num_experts, model.top_k)
        routing = "router" if has_own or has_proxy else "uniform"
        if routing == "router" and not has_own:
            return ["task.routing=router", f"task.routers={proxy}"]
    return [f"task.routing={routing}"]


def point_overrides(strategy: str, place_dir: Path, profile: str) -> list:
    """A strategy's system overrides (a system with a ``profile`` option decides with ``profile``)."""
    system, option = strategy, []
    for name, (key, values) in VARIANTS.items():
        if strategy in (f"{name}_{v}" for v in values):
            system, option = name, [f"system.{key}={strategy[len(name) + 1:]}"]
    if system == "occult_placed":
        option = [f"system.placement_file={place_dir / 'placements.json'}"]
    if "profile" in {f.name for f in dataclasses.fields(read_conf("system", system))}:
        where = Path(profile)
        option.append(f"system.profile={where.resolve() if where.suffix else profile}")
    return [f"system={system}", *option]


SWEEP_NAME = "advise_points"     # the generated experiment of the advisor's points (in <out>/conf)


def grouped(profile, per_node: int):
    """``profile`` with its worlds' ranks in nodes of ``per_node`` (0: as it is): a measured
    profile's one link (loopback) serves within and across these nodes alike."""
    if not per_node:
        return profile
    if not profile.calibration:
        raise ValueError(f"devices_per_node={per_node}: profile={profile.name} states its own nodes")
    # one link (loopback) carries both: priced in series (overlap off), not as two links at once
    nodes = {P: dataclasses.replace(link, devices_per_node=per_node, inter_Bps=link.intra_Bps,
                                    inter_latency_s=link.intra_latency_s, inter_message_s=link.intra_message_s,
                                    overlap=False)
             for P, link in profile.calibration.items()}
    return dataclasses.replace(profile, calibration=nodes)


def profile_of(req: Request):
    """The advised profile, its ranks grouped as ``devices_per_node`` asks (:func:`grouped`)."""
    return grouped(load_profile(req.profile), req.devices_per_node)


def node_of(req: Request, P: int) -> int:
    """``cluster.devices_per_node`` of a world of P ranks on the advised profile: its node size
    when the world spans several nodes, else 0 (one node)."""
    link = profile_of(req).at(P)
    return link.devices_per_node if link.devices_per_node and link.devices_per_node < P else 0


def point_dir(out: Path, P: int, strategy: str, peer_rows: bool = False) -> Path:
    """Where a point of the advisor's sweep lands (``+peer_rows``: its rerun with peer pairs)."""
    return out / f"p{P}" / (f"{strategy}+peer_rows" if peer_rows else strategy)


def sweep_params(req: Request, points: list, out: Path, peer_rows: bool = False) -> dict:
    """The grids of one multirun of the advisor (:mod:`hydra_plugins.occult_sweepers.grids_sweeper`):
    per P a ``task=place`` grid when ``occult_placed`` is among its points, and one simulate grid
    per (P, strategy) of ``points``, into :func:`point_dir` (resumed when already there).
    ``peer_rows``: the points write a row per peer pair (else per-rank totals only)."""
    model = read_conf("model", req.model)
    params = {"model": req.model, "task.sample_layers": str(req.sample_layers), "experiment_name": "advise",
              "resume": "true"}
    for o in routing_overrides(req, model):
        key, _, value = o.partition("=")
        params[key] = value
    for P in sorted({P for P, _ in points}):
        world = {"cluster.world_size": str(P), "cluster.devices_per_node": str(node_of(req, P))}
        if (P, "occult_placed") in points:
            grid = {"task": "place", **world, "task.total_tokens": str(PROFILE_TOKENS // P * P),
                    "task.time_limit_s": str(PLACE_TIME_LIMIT_S), "hydra.sweep.subdir": f"p{P}/place"}
            params.update({f"p{P}_place/{k}": v for k, v in grid.items()})
        for i, s in enumerate(s for q, s in points if q == P):
            grid = {"task": "simulate", **world, "task.tokens_per_rank": str(req.tokens_per_rank),
                    "task.backward": "true" if req.phase == "train" else "false",
                    "task.peer_rows": "true" if peer_rows else "false", "label": req.phase,
                    "hydra.sweep.subdir": str(point_dir(out, P, s, peer_rows).relative_to(out))}
            for o in point_overrides(s, out / f"p{P}" / "place", req.profile):
                key, _, value = o.partition("=")
                grid[key] = value
            params.update({f"p{P}_s{i}/{k}": v for k, v in grid.items()})
    return params


def write_sweep(req: Request, points: list, out: Path, peer_rows: bool = False) -> Path:
    """``<out>/conf/experiment/advise_points.yaml``: the points of :func:`sweep_params` as an
    experiment (a multirun in ``out``, no report); returns its config folder."""
    conf = out / "conf"
    (conf / "experiment").mkdir(parents=True, exist_ok=True)
    sweep = {"mode": "MULTIRUN", "sweep": {"dir": str(out)}, "launcher": {"n_jobs": min(2, os.cpu_count() or 1)},
             "sweeper": {"params": sweep_params(req, points, out, peer_rows)}}
    # one-process points (simulate, place): two at a time (hydra_plugins/occult_sweepers/parallel_launcher.py)
    exp = {"defaults": [{"override /hydra/launcher": "occult_parallel"}], "experiment_name": "advise", "report": "",
           "hydra": sweep}
    (conf / "experiment" / f"{SWEEP_NAME}.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(exp))
    return conf


def progress_line(line: str) -> Optional[str]:
    """The runner's ``[point i/N] <overrides> (...)`` log line as ``[point i/N] P=.. strategy (...)``;
    the runner's own ``before the sweep: ...`` log lines (the proxies its points load: all
    cached, or pre-trained first, with their expected and measured times) without the log
    prefix; None for any other line."""
    # the message right after the log line's [..] fields (the sweeper logs as [time][HYDRA])
    before = re.match(r"(?:\[[^\]]*\])+ (?:- )?(before the sweep: .*)", line)
    if before:
        return f"  {before.group(1).rstrip()}"
    m = re.search(r"\[point (\d+/\d+)\] (\S+) (\(.*\))", line)
    if not m:
        return None
    kv = dict(o.partition("=")[::2] for o in m.group(2).split(","))
    what = "place" if kv.get("task") == "place" else strategy_of(kv.get("system", "?"), kv.get("system.dedup", ""))
    return f"  [point {m.group(1)}] P={kv.get('cluster.world_size', '?')} {what} {m.group(3)}"


def run_points(req: Request, points: list, out: Path, peer_rows: bool = False) -> None:
    """The place and simulate points in one ``python run.py`` multirun (the harness's entry
    point, in its own process: the advisor reads result tables and starts no ranks itself),
    a progress line per point on stderr (and the runner's announcement of proxies pre-trained
    first); a failure is a one-line ``ValueError`` with its cause."""
    conf = write_sweep(req, points, out, peer_rows)
    cmd = [sys.executable, "run.py", f"hydra.searchpath=[file://{conf}]", f"experiment={SWEEP_NAME}",
           "~hydra.callbacks.sweep_report"]     # the advisor prints its own table
    t0 = time.perf_counter()
    failed, last = [], "(no output)"
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            shown = progress_line(line)
            if shown:
                print(shown, file=sys.stderr, flush=True)
            if "point failed (" in line:
                failed.append(line.split("point failed (", 1)[1].rsplit(");", 1)[0])
            if line.strip():
                last = line.strip()
    if proc.returncode or failed:
        raise ValueError(f"python run.py experiment={SWEEP_NAME} ({conf}): "
                         + (f"{len(failed)} point(s) failed, the first: {failed[0]}" if failed else last))
    print(f"  {len(points)} (P, strategy) point(s){' with peer pairs' if peer_rows else ''} simulated in "
          f"{time.perf_counter() - t0:.0f} s (one process; points already in {out} resumed)", file=sys.stderr)


# collectives the cost model prices from their peer pairs only (analysis.projection: a rooted
# collective, e.g. shadow's weight broadcasts): a point with one is simulated again with peer pairs
ROOTED_CALLS = ("broadcast_calls", "reduce_calls")


def simulate(req: Request, out: Path) -> pd.DataFrame:
    """Runs the place and simulate points (resuming any already written into ``out``), the
    points with a rooted collective again with peer pairs, and returns their rows."""
    model = read_conf("model", req.model)
    points = [(P, s) for P in world_sizes_of(req, int(model.num_experts)) for s in req.systems]
    run_points(req, points, out)
    df = load_runs([point_dir(out, P, s) for P, s in points])
    rooted = df[df.metric.isin(ROOTED_CALLS) & (df.task == "simulate")][["world_size", "system", "dedup"]]
    again = sorted({(int(P), strategy_of(system, dedup)) for P, system, dedup in rooted.itertuples(index=False)})
    if not again:
        return df
    run_points(req, again, out, peer_rows=True)
    return load_runs([point_dir(out, P, s, (P, s) in again) for P, s in points])


def ranked(df: pd.DataFrame, req: Request) -> pd.DataFrame:
    """The ranked table, a row per (strategy, P): ``rank`` by projected ms per MoE layer
    (collectives + experts), its ratio to the best; the MoE layers' time per step and their
    tokens per second per GPU (``per_GPU_rank``; :func:`analysis.figures.scale_study.per_gpu`),
    ``within_bound`` (``latency_ms``), memory per GPU and ``fits``, bytes and messages per rank
    per layer."""
    profile = profile_of(req)
    sim = df[(df.task == "simulate") & (df.clock == "simulated")]
    gpu = per_gpu(point_table(sim), projected(sim, [profile]), req.latency_ms, {profile.name: profile})
    table = gpu.sort_values(["moe_layer_ms", "world_size"]).reset_index(drop=True)
    table.insert(0, "rank", np.arange(1, len(table) + 1))
    table["per_GPU_rank"] = table.tokens_per_s_per_GPU.rank(ascending=False, method="min").astype(int)
    table["vs_best"] = table.moe_layer_ms / table.moe_layer_ms.min()
    table["within_bound"] = np.where(table.within_bound, "yes", "no")
    table["fits"] = np.where(table.fits, "yes", "no") if profile.memory_GB else "not stated"
    return table[["rank", "strategy", "world_size", "moe_layer_ms", "a2a_ms", "experts_ms", "vs_best", "step_ms",
                  "tokens_per_s_per_GPU", "per_GPU_rank", "within_bound", "memory_GB_per_GPU", "fits",
                  "intra_MB_per_rank", "inter_MB_per_rank", "messages_per_rank", "ct_all"]]


def best_text(table: pd.DataFrame, req: Request) -> list:
    """The answer: the best (strategy, P) per GPU among the rows within the bound that fit (the
    most MoE tokens per second per GPU), or why none qualifies; and the best strategy at each P."""
    bound = f"{req.latency_ms:g} ms" if req.latency_ms else "none given"
    ok = table[(table.within_bound == "yes") & (table.fits != "no")]
    head = f"Best per GPU (latency bound on the MoE layers per step: {bound}; memory per GPU <= the profile's): "
    if ok.empty:
        g = table.assign(within_bound=table.within_bound == "yes", fits=table.fits != "no",
                         bound_ms=req.latency_ms or np.nan)
        out = [head + "none qualifies: " + why_none(g) + "."]
    else:
        b = ok.sort_values("tokens_per_s_per_GPU", ascending=False).iloc[0]
        out = [head + f"**{b.strategy} at P = {int(b.world_size)}**: {b.tokens_per_s_per_GPU:,.0f} MoE tokens/s per "
               f"GPU, {b.step_ms:.3g} ms of MoE layers per step ({b.moe_layer_ms:.3g} ms x {req_layers(req)} MoE "
               f"layers), {b.memory_GB_per_GPU:.3g} GB per GPU."]
    per_p = table.sort_values("moe_layer_ms").groupby("world_size", sort=True).first()
    if len(per_p) > 1:
        out.append("Best at each P: " + "; ".join(
            f"P = {int(P)}: {r.strategy} ({r.step_ms:.3g} ms per step, {r.tokens_per_s_per_GPU:,.0f} tokens/s per "
            f"GPU, {r.memory_GB_per_GPU:.3g} GB{'' if r.fits != 'no' else ', does not fit'}"
            f"{'' if r.within_bound == 'yes' else ', over the bound'})" for P, r in per_p.iterrows()) + ".")
    return out


def req_layers(req: Request) -> int:
    """The advised model's MoE layers."""
    return moe_layers(read_conf("model", req.model))


def rests_on(req: Request, df: pd.DataFrame) -> list:
    """What the numbers rest on: where bytes, links and compute come from."""
    profile = load_profile(req.profile)
    sim = df[df.task == "simulate"]
    first = sim.iloc[0]
    flags = df[df.metric == "resampled_tokens"].value
    resampled = bool(flags.max()) if not flags.empty else False
    src = {"router": "the routers of the model (or its trained proxy) on held-out text",
           "trace": f"the routing trace {req.trace}", "uniform": "synthetic uniform routing",
           "zipf": "synthetic Zipf routing"}.get(str(first.routing), str(first.routing))
    layers = sorted(int(x) for x in df[df.metric == "ct_all"].layer.unique())
    worlds = " and ".join(map(str, sorted(int(p) for p in sim.world_size.unique())))
    return [f"bytes, rows, messages, C_T: simulated (task=simulate, the systems' traffic plans, clock=simulated) "
            f"for {worlds} ranks x {int(first.tokens_per_rank)} tokens on {src}"
            f"{' (resampled with replacement)' if resampled else ''}, MoE layers {layers}",
            f"times: projected by the cost model on profile {profile.name} ({profile.source})"
            + ("; its links are measured (a calibration)" if profile.calibration else ""),
            "experts: the busiest rank's rows at balanced load (tokens per rank x K); memory: routed experts' "
            "weights of every MoE layer plus the largest dispatch buffer, per GPU, and its fit a necessary condition, not a sufficient one: attention, shared experts, dense layers, embeddings and caches sit on every GPU too and are not counted",
            f"per step: MoE-layer ms x the model's {req_layers(req)} MoE layers; attention and dense layers are not "
            "modelled (the per-step bound and the tokens/s per GPU are the MoE layers' alone); with tokens per rank "
            "fixed, tokens/s per GPU orders the rows as the MoE-layer time does: the bound and the memory fit decide "
            "which qualify"]


def advise(req: Request) -> tuple[pd.DataFrame, list]:
    """Simulates, projects and ranks: (table, what it rests on)."""
    if not req.systems:
        req = dataclasses.replace(req, systems=candidates())
    out = Path(req.out) if req.out else ROOT / "runs" / "advise" / time.strftime("%Y-%m-%d_%H-%M-%S")
    df = simulate(req, out)
    return ranked(df, req), rests_on(req, df)


def main(argv=None) -> None:
    try:
        req = parse(sys.argv[1:] if argv is None else argv)
        table, notes = advise(req)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    print(f"## {req.model} on {req.profile}, phase={req.phase}, {req.tokens_per_rank} tokens per rank\n")
    print(table.to_markdown(index=False, floatfmt=".4g"))
    print()
    for line in best_text(table, req):
        print(line)
    print("\nRests on:")
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
