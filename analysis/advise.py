"""Which strategy moves least and finishes first, at my model, my cluster and my batch?

    python -m analysis.advise model=deepseek_v3 profile=sim_h200_nodes phase=decode tokens_per_rank=128
    python -m analysis.advise model=olmoe_proxy profile=sim_cpu_loopback world_size=4 phase=prefill \\
        tokens_per_rank=512 trace=runs/strategies/<a run with task.save_routing=true>

For each candidate strategy (``systems=``, default :func:`candidates`: every registered
system the query :data:`CANDIDATE_QUERY` selects from the capability records) the advisor simulates
the model's MoE layers on ``world_size`` ranks in the profile's nodes (``task=simulate``: the
systems' own traffic plans, every rank, one process; ``occult_placed`` after ``task=place``
made its placement from a profiling set), writes those runs under ``out=`` (default
``runs/advise/<stamp>``), prices them on the profile with the cost model
(:mod:`analysis.projection`) and prints them ranked by projected MoE-layer time, with each
strategy's bytes, messages and memory per GPU beside it, and what every number rests on.

Arguments (``key=value``): ``model`` (conf/model), ``profile`` (conf/profile or a YAML path),
``phase`` (decode | prefill | train: train also plans the backward), ``tokens_per_rank``,
``world_size`` (default: the largest world size of the profile that divides the model's
experts), ``trace`` (a run folder with ``routing.parquet``: replay that routing), ``routing``
(router | uniform | zipf; default: ``router`` through the model's own routers or a trained
proxy of the same E and K (``<model>_proxy``), else ``uniform``), ``sample_layers``
(default 3), ``systems`` (comma-separated strategies; hierarchical as ``hierarchical_node`` /
``hierarchical_device``), ``devices_per_node`` (a measured profile's ranks grouped into nodes
of this size, its one loopback link serving within and across them: :func:`grouped`), ``out``.
A system with a ``profile`` option (a cost rule that decides its schedule: shadowing, the
pipeline degree) decides with the advised profile.

Memory per GPU: the MoE layers' expert weights a rank holds (E / P experts x 3 D F elements x
MoE layers) plus its largest dispatch buffer (received rows x D elements); attention, dense
layers and caches are the same for every strategy and not counted. Shapes: P ranks.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from occult.config import CONF_DIR, read_conf, select_systems
from occult.ep.links import ELEMENT_BYTES
from occult.ep.profiles import load_profile

from .figures.scale_study import point_table, strategy_of
from .load import load_runs
from .projection import project_runs, projected_totals

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
    world_size: int = 0
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
    for name in ("tokens_per_rank", "world_size", "sample_layers", "devices_per_node"):
        if name in kv:
            kv[name] = int(kv[name])
    allowed = candidates()
    if "systems" in kv:
        kv["systems"] = tuple(s for s in kv["systems"].split(",") if s)
        unknown = [s for s in kv["systems"] if s not in allowed]
        if unknown:
            raise ValueError(f"systems={','.join(kv['systems'])}: allowed values are {list(allowed)}")
    else:
        kv["systems"] = allowed
    return Request(**kv)


def world_size_of(req: Request, num_experts: int) -> int:
    """The world the advice is for: ``world_size=``, else the profile's largest world size that
    divides the experts (a one-line ``ValueError`` when none does)."""
    sizes = load_profile(req.profile).sizes()
    if req.world_size:
        if req.world_size not in sizes:
            raise ValueError(f"world_size={req.world_size}: profile={req.profile} has links for {sizes}")
        return req.world_size
    fit = [p for p in sizes if p > 0 and num_experts % p == 0]
    if not fit:
        raise ValueError(f"profile={req.profile} covers world sizes {sizes}; "
                         f"none divides model's {num_experts} experts")
    return max(fit)


def grouped(profile, P: int, per_node: int):
    """``profile`` with its world of P ranks in nodes of ``per_node`` (0: as it is): a measured
    profile's one link (loopback) serves within and across these nodes alike."""
    if not per_node:
        return profile
    if not profile.calibration:
        raise ValueError(f"devices_per_node={per_node}: profile={profile.name} states its own nodes")
    link = profile.at(P)
    same = dataclasses.replace(link, devices_per_node=per_node, inter_Bps=link.intra_Bps,
                               inter_latency_s=link.intra_latency_s, inter_message_s=link.intra_message_s)
    return dataclasses.replace(profile, calibration={**profile.calibration, P: same})


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


def run_point(overrides: list, folder: Path) -> None:
    """One ``python run.py`` point into ``folder`` (the harness's entry point, in its own
    process: the advisor reads result tables and starts no ranks itself); a failure is a
    one-line ``ValueError`` with the run's last line."""
    proc = subprocess.run([sys.executable, "run.py", *overrides, f"hydra.run.dir={folder}", "report=none"], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"python run.py {' '.join(overrides)}: {last}")


def simulate(req: Request, out: Path) -> pd.DataFrame:
    """Runs the place and simulate points (resuming any already written into ``out``) and
    returns their rows."""
    model = read_conf("model", req.model)
    P = world_size_of(req, int(model.num_experts))
    link = grouped(load_profile(req.profile), P, req.devices_per_node).at(P)
    node = link.devices_per_node if link.devices_per_node and link.devices_per_node < P else 0
    base = [f"model={req.model}", f"cluster.world_size={P}", f"cluster.devices_per_node={node}",
            f"task.sample_layers={req.sample_layers}", "experiment_name=advise", "resume=true",
            *routing_overrides(req, model)]
    if "occult_placed" in req.systems:
        run_point(["task=place", *base, f"task.total_tokens={PROFILE_TOKENS // P * P}",
                   f"task.time_limit_s={PLACE_TIME_LIMIT_S}"], out / "place")
    for s in req.systems:
        t0 = time.perf_counter()
        run_point(["task=simulate", *base, f"task.tokens_per_rank={req.tokens_per_rank}",
                   *point_overrides(s, out / "place", req.profile),
                   f"task.backward={'true' if req.phase == 'train' else 'false'}",
                   "task.peer_rows=false", f"label={req.phase}"], out / s)
        print(f"  simulated {s} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return load_runs([out / s for s in req.systems])


def memory_GB(model, P: int, element_bytes: int, received_max_rows: float) -> float:
    """Per GPU: expert weights of the MoE layers (E / P experts) plus the largest dispatch buffer."""
    layers = int(model.num_layers) - int(model.first_k_dense)
    weights = model.num_experts / P * 3 * model.hidden_size * model.expert_ffn_size * layers
    return (weights + received_max_rows * model.hidden_size) * element_bytes / 1e9


def ranked(df: pd.DataFrame, req: Request) -> pd.DataFrame:
    """The ranked table: projected ms per MoE layer (collectives + experts), its ratio to the
    best, bytes and messages per rank per layer, memory per GPU."""
    model = read_conf("model", req.model)
    sim = df[df.task == "simulate"]
    profile = grouped(load_profile(req.profile), int(sim.world_size.iloc[0]), req.devices_per_node)
    points = point_table(sim).set_index("run_id")
    tot = projected_totals(project_runs(sim, profile)).set_index("run_id")
    element = profile.element_bytes
    rows = []
    for run_id, run in sim.groupby("run_id"):
        got = run[(run.metric == "received_rows") & run.phase.str.startswith("dispatch")
                  & ~run.phase.str.endswith(("_meta", "_index")) & (run["rank"] >= 0) & (run["pass"] == "forward")]
        peak = got.groupby(["layer", "rank"]).value.sum().max() if not got.empty else 0.0
        p = points.loc[run_id]
        a2a, experts = float(tot.loc[run_id].a2a_ms_per_layer), float(tot.loc[run_id].experts_ms_per_layer)
        rows.append({"strategy": strategy_of(run.system.iloc[0], run.dedup.iloc[0]),
                     "moe_layer_ms": a2a + experts, "a2a_ms": a2a, "experts_ms": experts,
                     "intra_MB_per_rank": p.intra_MB_per_rank, "inter_MB_per_rank": p.inter_MB_per_rank,
                     "messages_per_rank": p.messages_per_rank, "ct_all": p.ct_all,
                     "memory_GB_per_GPU": memory_GB(model, int(p.world_size), element, peak)})
    table = pd.DataFrame(rows).sort_values("moe_layer_ms").reset_index(drop=True)
    table.insert(0, "rank", np.arange(1, len(table) + 1))
    table["vs_best"] = table.moe_layer_ms / table.moe_layer_ms.min()
    if profile.memory_GB:
        table["fits"] = np.where(table.memory_GB_per_GPU <= profile.memory_GB, "yes", "no")
    return table


def rests_on(req: Request, df: pd.DataFrame) -> list:
    """What the numbers rest on: where bytes, links and compute come from."""
    profile = load_profile(req.profile)
    first = df[df.task == "simulate"].iloc[0]
    flags = df[df.metric == "resampled_tokens"].value
    resampled = bool(flags.max()) if not flags.empty else False
    src = {"router": "the routers of the model (or its trained proxy) on held-out text",
           "trace": f"the routing trace {req.trace}", "uniform": "synthetic uniform routing",
           "zipf": "synthetic Zipf routing"}.get(str(first.routing), str(first.routing))
    layers = sorted(int(x) for x in df[df.metric == "ct_all"].layer.unique())
    return [f"bytes, rows, messages, C_T: simulated (task=simulate, the systems' traffic plans, clock=simulated) "
            f"for {int(first.world_size)} ranks x {int(first.tokens_per_rank)} tokens on {src}"
            f"{' (resampled with replacement)' if resampled else ''}, MoE layers {layers}",
            f"times: projected by the cost model on profile {profile.name} ({profile.source})"
            + ("; its links are measured (a calibration)" if profile.calibration else ""),
            "experts: the busiest rank's rows at balanced load (tokens per rank x K); memory: expert weights of "
            "every MoE layer plus the largest dispatch buffer, per GPU"]


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
    print("\nRests on:")
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
