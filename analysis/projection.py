"""The cost model's projections: measured runs onto clusters that are not here.

Inputs are what a run measured and what its config says, never a guess about
routing: the bytes each rank sent to each peer in every collective (the
``bytes`` rows with ``src_rank`` / ``dst_rank``, counted from the split sizes
that went into the collective) and the expert FLOPs of the run's tokens
(tokens, K, D, F). A projection profile (``conf/profile/sim_*.yaml``, read by
:mod:`occult.ep.profiles`) gives link bandwidths and latencies and per-device matmul
throughput; :mod:`analysis.pricing` prices each collective and experts step on it.

Rows per rank for the experts = tokens per rank x K (balanced load, an assumption) plus
the padding rows a capacity-based system reported, minus dropped and merged pairs.

Projecting to another model (e.g. a CPU proxy's routing onto OLMoE's real
width): the rows stay, each hidden-state row is re-sized to the target's D
and the profile's element type, metadata rows keep their bytes, expert FLOPs
use the target's D and F, and the per-layer mean is repeated for the
target's number of MoE layers.

Every value this module returns carries ``source = "projected"``; a run is keyed by
its ``run_id`` (``run_dir`` rides along as provenance). The model's check against this
machine is the report builder :mod:`analysis.figures.costmodel_check`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from occult.config import read_conf
from occult.ep.links import ELEMENT_BYTES, Link, pipeline_seconds
from occult.ep.profiles import Profile

from .pricing import a2a_seconds_of_totals, collective_seconds, expert_seconds
from .summary import RUN_KEYS, SYSTEM_KEYS

PROJECTED = "projected"
MEASURED = "measured"


@dataclass(frozen=True)
class Target:
    """The model a projection is for (defaults: the run's own)."""

    name: str
    hidden_size: int
    expert_ffn_size: int
    moe_layers: int = 0                 # 0: the run's own MoE layers, as measured


def target_model(name: str) -> Target:
    """A model config from conf/model as a projection target."""
    m = read_conf("model", name)
    layers = int(m.num_layers) - int(m.first_k_dense)
    return Target(name, int(m.hidden_size), int(m.expert_ffn_size), max(layers, 1))


def real_model_of(run_model: str) -> str:
    """The paper model a CPU proxy stands for (``olmoe_proxy`` -> ``olmoe``)."""
    return run_model[:-len("_proxy")] if run_model.endswith("_proxy") else run_model


def _kinds(run: pd.DataFrame) -> dict:
    """{(layer, phase, pass): collective kind} from the ``<kind>_calls`` rows (runs written
    before those rows existed: every collective an all-to-all)."""
    calls = run.loc[run.metric.str.endswith("_calls") & (run.unit == "calls"), ["layer", "phase", "pass", "metric"]]
    return {key: g.metric.iloc[0][:-len("_calls")] for key, g in calls.groupby(["layer", "phase", "pass"])}


def _collectives(run: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, phase, pass): the byte matrix, rows, calls per timed iteration, the collectives its
    bytes were logged from (`<kind>_calls`, the first rank's; 0: none logged), kind."""
    b = run[run.metric == "bytes"]
    r = run[run.metric == "rows"]
    P = int(run.world_size.iloc[0])
    timed = run[(run.metric == "a2a_time") & (run["sample"] >= 0)]
    first = timed[timed["sample"] == timed["sample"].min()] if not timed.empty else timed
    calls = first[first["rank"] == first["rank"].min()].groupby(["layer", "phase", "pass"]).size() \
        if not first.empty else pd.Series(dtype=int)
    meta = run[run.metric == "meta_bytes"]
    kinds = _kinds(run)
    logged = run[run.metric.str.endswith("_calls") & (run.unit == "calls") & (run["rank"] >= 0)]
    first_rank = logged[logged["rank"] == logged["rank"].min()] if not logged.empty else logged
    collectives = first_rank.groupby(["layer", "phase", "pass"]).value.sum()
    out = []
    for (layer, phase, direction), g in b.groupby(["layer", "phase", "pass"]):
        rows = r[(r.layer == layer) & (r.phase == phase) & (r["pass"] == direction)].value.sum()
        m = meta[(meta.layer == layer) & (meta.phase == phase) & (meta["pass"] == direction)]
        out.append({"layer": layer, "phase": phase, "direction": direction, "bytes_PP": _peer_matrix(g, P),
                    "meta_PP": _peer_matrix(m, P), "rows": rows, "calls": int(calls.get((layer, phase, direction), 1)),
                    "collectives": int(collectives.get((layer, phase, direction), 0)),
                    "kind": kinds.get((layer, phase, direction), "all_to_all")})
    return pd.DataFrame(out, columns=["layer", "phase", "direction", "bytes_PP", "meta_PP", "rows", "calls",
                                      "collectives", "kind"])


# a simulated world without peer rows (task.peer_rows=false): each rank's bytes by node
TOTALS = ("intra_node_bytes", "received_intra_node_bytes", "inter_node_bytes", "received_inter_node_bytes")


def has_peer_bytes(run: pd.DataFrame) -> bool:
    """Whether the run wrote per-peer ``bytes`` rows (else it may have per-rank :data:`TOTALS`)."""
    return bool((run.metric == "bytes").any())


# ... and the messages each rank sends (peers with a non-empty block), in all and across nodes
MESSAGES = ("messages", "inter_node_messages")


def _rank_vector(g: pd.DataFrame, name: str, P: int) -> np.ndarray:
    """[P]: metric ``name``'s values of ``g`` summed per rank."""
    v = np.zeros(P)
    m = g[g.metric == name]
    np.add.at(v, m["rank"].to_numpy(int), m.value.to_numpy(float))
    return v


def _group_codes(t: pd.DataFrame) -> tuple:
    """Each row's (layer, phase, pass) group as an index into the sorted list of the groups
    (the order of ``groupby(["layer", "phase", "pass"])``): ``(codes, [(layer, phase, pass)])``."""
    phase_codes, phases = pd.factorize(t.phase.astype(str), sort=True)
    pass_codes, passes = pd.factorize(t["pass"].astype(str), sort=True)
    layer = t.layer.to_numpy(np.int64)
    combined = (layer * len(phases) + phase_codes) * len(passes) + pass_codes
    unique, first, codes = np.unique(combined, return_index=True, return_inverse=True)
    keys = [(layer[i], phases[phase_codes[i]], passes[pass_codes[i]]) for i in first]
    return codes, keys


def _collective_totals(run: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, phase, pass) of a run with per-rank :data:`TOTALS` only: the four [P]
    vectors (sent / received within the node, sent / received across nodes), the two of
    :data:`MESSAGES` (None for a run written before them), calls 1, kind. Summed in one
    ``np.add.at`` over [collective, metric, rank] (a study's report projects a thousand runs
    on each profile: a pandas selection per collective and metric was most of its time)."""
    P = int(run.world_size.iloc[0])
    kinds = _kinds(run)
    names = list(TOTALS + MESSAGES)
    t = run.loc[run.metric.isin(names) & (run["rank"] >= 0), ["layer", "phase", "pass", "metric", "rank", "value"]]
    codes, keys = _group_codes(t)
    metric = pd.Categorical(t.metric.astype(str), categories=names).codes
    sums = np.zeros((len(keys), len(names), P))
    np.add.at(sums, (codes, metric, t["rank"].to_numpy(int)), t.value.to_numpy(float))
    seen = np.zeros((len(keys), len(names)), dtype=bool)
    seen[codes, metric] = True
    n = len(TOTALS)
    out = [{"layer": layer, "phase": phase, "direction": direction, "totals": tuple(sums[k, :n]),
            "messages": tuple(sums[k, n:]) if seen[k, n:].any() else None, "calls": 1,
            "kind": kinds.get((layer, phase, direction), "all_to_all")}
           for k, (layer, phase, direction) in enumerate(keys)]
    return pd.DataFrame(out, columns=["layer", "phase", "direction", "totals", "messages", "calls", "kind"])


def _priced_totals(c, run: pd.DataFrame, link, target: Optional["Target"], profile: "Profile") -> float:
    """Seconds of one collective of :func:`_collective_totals` (all-to-all-like kinds only:
    a rooted collective's price needs its peer pairs). Per-rank totals are not re-sized: the
    run must be at the target's width and the profile's element size."""
    if c.kind in ("broadcast", "reduce"):
        raise ValueError(f"run {run.run_id.iloc[0]}: a {c.kind} ({c.phase}) is priced from its peer pairs; "
                         "simulate it with task.peer_rows=true")
    D_run, element = int(run.hidden_size.iloc[0]), _run_element_bytes(run)
    if target is not None and (target.hidden_size != D_run or element != profile.element_bytes):
        raise ValueError(f"run {run.run_id.iloc[0]}: per-rank byte totals (task.peer_rows=false) are projected "
                         f"at the run's own width (D={D_run}, {element}-byte elements), not re-sized to "
                         f"{target.name} (D={target.hidden_size}) in {profile.dtype}: simulate the target model "
                         "(task.routers=<its proxy>)")
    P = int(run.world_size.iloc[0])
    multi_node = bool(link.devices_per_node) and link.devices_per_node < P
    messages, inter_messages = c.messages if c.messages is not None else (None, None)
    return a2a_seconds_of_totals(*c.totals, link, c.calls, multi_node=multi_node, messages_P=messages,
                                 inter_messages_P=inter_messages)


def _run_element_bytes(run: pd.DataFrame) -> int:
    """Bytes of one element of the run's hidden rows: the model's dtype (its ``dtype`` column
    when the run has one; the harness's float32 otherwise)."""
    dtype = str(run.dtype.iloc[0]) if "dtype" in run else "float32"
    return ELEMENT_BYTES.get(dtype, 4)


def _peer_matrix(g: pd.DataFrame, P: int) -> np.ndarray:
    """[P, P] sum of ``value`` by (src_rank, dst_rank)."""
    mat = np.zeros((P, P))
    np.add.at(mat, (g.src_rank.to_numpy(int), g.dst_rank.to_numpy(int)), g.value.to_numpy(float))
    return mat


def wire_matrix(hidden_PP: np.ndarray, meta_PP: np.ndarray, rows: float, D_run: int, D: int,
                element_bytes: int) -> Optional[np.ndarray]:
    """One collective's [P, P] bytes re-sized to a target's hidden size ``D`` and element
    size, or None when its rows are not whole hidden-state rows (other row kinds keep
    their bytes). A row's element is its hidden bytes / ``D_run``; an element narrower
    than the target's (a compressed payload: int8, fp8, bf16 under float32) crosses as it
    did, with its scale and metadata bytes as they were; otherwise the elements and the
    metadata values take the target's element size."""
    if not rows:
        return None
    per_row = hidden_PP.sum() / rows
    run_element = per_row / D_run
    if not np.isclose(run_element, round(run_element)) or round(run_element) not in (1, 2, 4, 8):
        return None          # not rows of D elements (e.g. expert weights): bytes as they are
    run_element = round(run_element)
    if run_element < element_bytes:
        return hidden_PP / per_row * D * run_element + meta_PP
    return hidden_PP / per_row * D * element_bytes + meta_PP / run_element * element_bytes


def _resized(c, run: pd.DataFrame, profile: "Profile", target: Optional["Target"]) -> np.ndarray:
    """A collective's [P, P] bytes at the target model's width and the profile's element
    size: token rows (D elements, :func:`wire_matrix`) and weight rows (one expert's
    3 D F elements) re-sized, other rows (routing metadata) as they are. ``c``: a row of
    :func:`_collectives`."""
    if target is None or not c.rows:
        return c.bytes_PP
    D, F = int(run.hidden_size.iloc[0]), int(run.expert_ffn_size.iloc[0])
    tokens = wire_matrix(c.bytes_PP - c.meta_PP, c.meta_PP, c.rows, D, target.hidden_size, profile.element_bytes)
    if tokens is not None:
        return tokens
    element = c.bytes_PP.sum() / c.rows / (3 * D * F)
    if np.isclose(element, round(element)) and round(element) in ELEMENT_BYTES.values():
        return c.bytes_PP / (3 * D * F * round(element)) * 3 * target.hidden_size * target.expert_ffn_size \
            * profile.element_bytes
    return c.bytes_PP


def pipeline_degree(run: pd.DataFrame, layer: int) -> int:
    """The chunks a pipelined system cut each call of layer ``layer`` into: its
    ``pipeline_degree`` counter over its ``pipeline_calls`` (counters add up over a run's
    calls, e.g. decode steps; runs without ``pipeline_calls`` made one call); 1 for every
    other system."""
    at = (run.layer == layer) & (run["rank"] >= 0)
    deg = run[at & (run.metric == "pipeline_degree")].groupby("rank").value.sum()
    if deg.empty:
        return 1
    calls = run[at & (run.metric == "pipeline_calls")].groupby("rank").value.sum()
    per_call = deg / calls.reindex(deg.index).fillna(1.0).clip(lower=1.0)
    return max(int(round(float(per_call.max()))), 1)


def layer_calls(coll: pd.DataFrame, layer: int) -> int:
    """How many times a timed iteration ran layer ``layer``'s exchange (decode: once per
    step; a pipelined layer: once per chunk too): the commonest call count among its
    forward collectives' phases (the larger on a tie; a phase run once per owner, such
    as shadow's weight broadcasts, does not decide it)."""
    calls = coll[(coll.layer == layer) & (coll.direction == "forward")].calls
    if calls.empty:
        return 1
    counts = calls.value_counts()
    return int(max(n for n, k in counts.items() if k == counts.max()))


def _overlap_rows(layer: int, degree: int, calls: int, a2a: list, expert_ms: dict, chunk_expert_ms: dict) -> list:
    """For a layer whose ``calls`` exchanges are ``calls / degree`` calls of ``degree``
    chunks: per pass, the time its pipelines hide (a negative ``overlap`` component: the
    pipelined time of the chunked collectives and the experts minus their serial sum;
    see :func:`occult.ep.links.pipeline_seconds`). ``chunk_expert_ms``: one chunk's experts."""
    steps = max(calls // degree, 1)
    out = []
    for direction, experts in expert_ms.items():
        chunked = {phase: ms for phase, d, n, ms in a2a if d == direction and n == calls}
        d, c = chunked.get("dispatch", 0.0), chunked.get("combine", 0.0)
        piped = steps * pipeline_seconds(d / calls, chunk_expert_ms[direction], c / calls, degree)
        out.append({"layer": layer, "component": "overlap", "pass": direction, "ms": piped - (d + c + experts)})
    return out


def _expert_rows(run: pd.DataFrame, layer: int) -> np.ndarray:
    """(token, expert) rows each rank's experts process in one layer: tokens per rank x K
    (balanced) plus the padding rows the system reported, minus dropped pairs and pairs
    merged into another's row (lsh's centroids)."""
    P, K = int(run.world_size.iloc[0]), int(run.top_k.iloc[0])
    tok = run[(run.metric == "tokens") & (run["rank"] >= 0) & (run.layer == layer)]
    per_rank = np.zeros(P)
    if not tok.empty:
        total = tok.value.sum()
        per_rank += total / P * K
    else:
        per_rank += float(run.tokens_per_rank.iloc[0]) * K
    for name, sign in (("padding_rows", 1.0), ("dropped_pairs", -1.0), ("merged_pairs", -1.0)):
        c = run[(run.metric == name) & (run.layer == layer) & (run["rank"] >= 0)]
        for rank, v in c.groupby("rank").value.sum().items():
            per_rank[int(rank)] += sign * v
    return per_rank


def project_run(run: pd.DataFrame, profile: Profile, target: Optional[Target] = None) -> pd.DataFrame:
    """Projected per-layer times of one run's timed iteration on ``profile``.

    Rows: ``layer, component`` (``a2a:<phase>``: every collective, priced by its kind;
    ``experts``; ``overlap``: for a pipelined layer, the (negative) time its chunks hide),
    ``pass``, ``ms``; plus ``source = projected``, the profile and target names. Layer -1
    rows are totals over the target's MoE layers (``component = moe``: the sum of the others).
    """
    P = int(run.world_size.iloc[0])
    link = profile.at(P)
    D_run, F_run = int(run.hidden_size.iloc[0]), int(run.expert_ffn_size.iloc[0])
    D, F = (target.hidden_size, target.expert_ffn_size) if target else (D_run, F_run)
    peer = has_peer_bytes(run)
    coll = _collectives(run) if peer else _collective_totals(run)
    out, a2a = [], {}
    for c in coll.itertuples():
        ms = (collective_seconds(_resized(c, run, profile, target), link, c.calls, c.kind, c.collectives) if peer
              else _priced_totals(c, run, link, target, profile)) * 1e3
        a2a.setdefault(c.layer, []).append((c.phase, c.direction, c.calls, ms))
        out.append({"layer": c.layer, "component": f"a2a:{c.phase}", "pass": c.direction, "ms": ms})
    backward = bool((run["pass"] == "backward").any())
    layers = sorted(coll.layer.unique()) if not coll.empty else [0]
    for layer in layers:
        rows_P = _expert_rows(run, layer)
        e = int(run.num_experts.iloc[0]) // P
        calls = layer_calls(coll, layer)
        degree = pipeline_degree(run, layer)
        expert_ms, chunk_ms = {}, {}
        for direction in ("forward", "backward") if backward else ("forward",):
            bwd = direction == "backward"
            expert_ms[direction] = expert_seconds(rows_P, D, F, link, backward=bwd, local_experts=e,
                                                  element_bytes=profile.element_bytes, calls=calls) * 1e3
            chunk_ms[direction] = expert_seconds(rows_P / calls, D, F, link, backward=bwd, local_experts=e,
                                                 element_bytes=profile.element_bytes) * 1e3
            out.append({"layer": layer, "component": "experts", "pass": direction, "ms": expert_ms[direction]})
        if degree > 1:
            out += _overlap_rows(layer, degree, calls, a2a.get(layer, []), expert_ms, chunk_ms)
    per_layer = pd.DataFrame(out)
    n_layers = target.moe_layers if target and target.moe_layers else len(layers)
    mean_layer = per_layer.groupby("layer").ms.sum().mean() if not per_layer.empty else 0.0
    per_layer = pd.concat([per_layer, pd.DataFrame([{"layer": -1, "component": "moe", "pass": "all",
                                                     "ms": mean_layer * n_layers}])], ignore_index=True)
    per_layer["source"] = PROJECTED
    per_layer["profile"] = profile.name
    per_layer["target_model"] = target.name if target else str(run.model.iloc[0])
    per_layer["target_moe_layers"] = n_layers
    return per_layer


def project_single_device(run: pd.DataFrame, profile: Profile, target: Optional[Target] = None) -> pd.DataFrame:
    """A whole-model run without expert parallelism (every device holds all E experts and
    exchanges nothing in its MoE layers, the reference): its MoE layers' expert time on the
    profile, from the run's tokens per rank (batch x sequence, and for decode the prompt
    plus the generated tokens in 1 + N calls) x K rows. Rows as :func:`project_run`'s."""
    P, K, E = int(run.world_size.iloc[0]), int(run.top_k.iloc[0]), int(run.num_experts.iloc[0])
    link = profile.at(P)
    D, F = (target.hidden_size, target.expert_ffn_size) if target else \
        (int(run.hidden_size.iloc[0]), int(run.expert_ffn_size.iloc[0]))
    B, S, task = int(run.batch_size.iloc[0]), int(run.seq_len.iloc[0]), str(run.task.iloc[0])
    tokens, calls = B * S, 1
    if task == "decode":
        steps = run[(run.metric == "token_latency") & (run["rank"] == -1)]
        iters = max(int(((run.metric == "ttft") & (run["rank"] == -1)).sum()), 1)
        new_tokens = len(steps) // iters
        tokens, calls = B * (S + new_tokens), 1 + new_tokens
    rows_P = np.full(P, float(tokens * K))
    out = [{"layer": 0, "component": "experts", "pass": direction,
            "ms": expert_seconds(rows_P, D, F, link, backward=direction == "backward", local_experts=E,
                                 element_bytes=profile.element_bytes, calls=calls) * 1e3}
           for direction in (("forward", "backward") if task == "train" else ("forward",))]
    n_layers = target.moe_layers if target and target.moe_layers else 1
    per_layer = pd.DataFrame(out)
    per_layer = pd.concat([per_layer, pd.DataFrame([{"layer": -1, "component": "moe", "pass": "all",
                                                     "ms": per_layer.ms.sum() * n_layers}])], ignore_index=True)
    per_layer["source"] = PROJECTED
    per_layer["profile"] = profile.name
    per_layer["target_model"] = target.name if target else str(run.model.iloc[0])
    per_layer["target_moe_layers"] = n_layers
    return per_layer


def same_nodes(run: pd.DataFrame, link: Link) -> bool:
    """Whether a run may be projected onto a profile's node layout: runs that declared no
    layout (``devices_per_node`` 0) project onto any; a run whose ranks were grouped into
    nodes (a system may have staged its exchange by them) only onto the same grouping."""
    P = int(run.world_size.iloc[0])
    declared = int(run.devices_per_node.iloc[0]) if "devices_per_node" in run else 0
    one_node = lambda g: g if 0 < g < P else P
    return declared == 0 or one_node(declared) == one_node(link.devices_per_node)


def project_runs(df: pd.DataFrame, profile: Profile, target=None, single_device: bool = False) -> pd.DataFrame:
    """:func:`project_run` over every run in ``df`` whose world size (and, when the run
    declared one, node layout: :func:`same_nodes`) the profile covers.

    ``target``: None (each run's own model), a :class:`Target`, or ``"real"`` (the
    paper model each proxy stands for). ``single_device``: also project whole-model runs
    that exchange nothing (:func:`project_single_device`); otherwise they are left out.
    Adds the run's context columns (``run_id`` and, as provenance, ``run_dir``).
    """
    frames = []
    for run_id, run in df.groupby("run_id", sort=False):
        P = int(run.world_size.iloc[0])
        covered = profile.covers(P)
        exchanges = has_peer_bytes(run) or run.metric.isin(TOTALS).any()
        if not covered or not (exchanges or single_device) or not same_nodes(run, profile.at(P)):
            continue
        tgt = target_model(real_model_of(str(run.model.iloc[0]))) if target == "real" else target
        proj = project_run(run, profile, tgt) if exchanges else project_single_device(run, profile, tgt)
        for key in RUN_KEYS + SYSTEM_KEYS:
            proj[key] = run[key].iloc[0]
        proj["run_id"] = run_id
        proj["run_dir"] = run.run_dir.iloc[0] if "run_dir" in run else ""
        frames.append(proj)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def projected_totals(proj: pd.DataFrame) -> pd.DataFrame:
    """One row per projected run: all-to-all and expert ms per MoE layer (mean over layers),
    and the MoE total over the target's layers."""
    if proj.empty:
        return proj
    keys = [c for c in proj.columns if c not in ("layer", "component", "pass", "ms")]
    per_layer = proj[proj.layer >= 0]
    a2a = per_layer[per_layer.component.str.startswith("a2a:")].groupby(keys + ["layer"], dropna=False).ms.sum() \
        .groupby(keys, dropna=False).mean().rename("a2a_ms_per_layer")
    exp = per_layer[per_layer.component == "experts"].groupby(keys + ["layer"], dropna=False).ms.sum() \
        .groupby(keys, dropna=False).mean().rename("experts_ms_per_layer")
    moe = proj[proj.component == "moe"].set_index(keys).ms.rename("moe_ms")
    return pd.concat([a2a, exp, moe], axis=1).reset_index()

