"""A cost model that projects measured runs onto clusters that are not here.

Inputs are what a run measured and what its config says, never a guess about
routing: the bytes each rank sent to each peer in every collective (the
``bytes`` rows with ``src_rank`` / ``dst_rank``, counted from the split sizes
that went into the collective) and the expert FLOPs of the run's tokens
(tokens, K, D, F). A projection profile (``conf/profile/sim_*.yaml``) gives link
bandwidths and latencies and per-device matmul throughput.

Model (one collective, P ranks):

    time = latency + max over ranks r of max(t_intra(r), t_inter(r))
    t_intra(r) = max(sent_intra(r), received_intra(r)) / (intra bandwidth x efficiency)
    t_inter(r) = max(sent_inter(r), received_inter(r)) / (per-device NIC share x efficiency)

where bytes a rank keeps for itself are free, ``latency`` is the inter-node
latency when any byte crosses nodes (else the intra-node one), and a device's
NIC share is ``inter_node_GBps * nics_per_node / devices_per_node``. When a
run made several calls of one collective per timed iteration (decode steps),
the latency is paid per call and the bytes of all calls are summed (the max
over ranks of a sum: a lower bound on the sum of the per-call maxima).

Experts (SwiGLU, three D x F matmuls): ``6 D F`` FLOPs per (token, expert)
row forward, twice that backward; rows per rank = tokens per rank x K
(balanced load, an assumption) plus the padding rows a capacity-based system
reported. Time = max over ranks of FLOPs / (device peak x efficiency).

Projecting to another model (e.g. a CPU proxy's routing onto OLMoE's real
width): the rows stay, each hidden-state row is re-sized to the target's D
and the profile's element type, metadata rows keep their bytes, expert FLOPs
use the target's D and F, and the per-layer mean is repeated for the
target's number of MoE layers.

Every value this module returns carries ``source = "projected"``.

A profile for this machine (``sim_cpu_loopback``) is measured by
``experiment=calibrate`` (:mod:`analysis.calibrate`): there the P ranks share the host's cores, so its
latency, bandwidth and throughput are per world size. :func:`check_against_measured`
compares its projections with the all-to-all and expert times that
``task=layer`` runs measured, preferably with the calibration a run made of its
own world just before timing (``task.calibrate=true``): the machine's load
drifts over a sweep, and a profile fitted minutes earlier then misses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import yaml

from occult.ep.links import Link, calibration_links, link_from_fields

from .summary import slowest_rank_ms

CONF = Path(__file__).resolve().parent.parent / "conf"
ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
PROJECTED = "projected"
MEASURED = "measured"


@dataclass(frozen=True)
class Profile:
    """A projection profile (a ``conf/profile`` YAML, schema :class:`occult.config.ProfileConf`)."""

    name: str
    world_size: int                     # 0: any world size in ``calibration``
    dtype: str
    link: Optional[Link] = None         # fixed links (GPU profiles)
    calibration: dict = field(default_factory=dict)   # {P: Link} (this machine)
    source: str = ""

    def at(self, world_size: int) -> Link:
        """The links and compute for a run of ``world_size`` ranks (raises if the profile has none)."""
        if self.calibration:
            if world_size not in self.calibration:
                raise ValueError(f"profile={self.name}: calibrated for world sizes {sorted(self.calibration)}, "
                                 f"not {world_size} (rerun python run.py experiment=calibrate "
                                 f"hydra.sweeper.params.cluster=cpu{world_size},...)")
            return self.calibration[world_size]
        if world_size != self.world_size:
            raise ValueError(f"profile={self.name} has world_size={self.world_size}; a run measured at "
                             f"world_size={world_size} has another per-peer byte pattern. Project runs "
                             f"measured with cluster.world_size={self.world_size}")
        return self.link

    @property
    def element_bytes(self) -> int:
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"profile={self.name}: dtype={self.dtype!r}; allowed values {sorted(ELEMENT_BYTES)}")
        return ELEMENT_BYTES[self.dtype]


def profile_from_dict(c: dict) -> Profile:
    """A :class:`Profile` from a profile config's fields, checked against
    :class:`occult.config.ProfileConf` (errors name the field)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from occult.config import ProfileConf

    name = c.get("name", "?")
    try:
        c = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ProfileConf), c))
    except OmegaConfBaseException as exc:
        raise ValueError(f"profile={name}: {str(exc).splitlines()[0]} (fields: see occult.config.ProfileConf)") from exc
    calibration = calibration_links(c.get("calibration"))
    if not calibration and not c.get("intra_node_GBps"):
        raise ValueError(f"profile={name}: needs intra_node_GBps (GB/s) or a calibration list")
    return Profile(name=name, world_size=int(c.get("world_size", 0) or 0), dtype=c.get("dtype") or "float32",
                   link=None if calibration else link_from_fields(c), calibration=calibration,
                   source=c.get("source", ""))


def load_profile(name_or_path) -> Profile:
    """``sim_a6000x4`` (from conf/profile) or a path to a profile YAML."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONF / "profile" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"profile={name_or_path}: no profile {path}; profiles: {available_profiles()}")
    return profile_from_dict(yaml.safe_load(path.read_text()))


def available_profiles() -> list[str]:
    return sorted(p.stem for p in (CONF / "profile").glob("*.yaml"))


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------


def node_of(world_size: int, devices_per_node: int) -> np.ndarray:
    """Node index of each rank: [P]."""
    per = devices_per_node or world_size
    return np.arange(world_size) // per


def a2a_seconds(bytes_PP: np.ndarray, link: Link, calls: int = 1) -> float:
    """Projected time of ``calls`` all-to-alls whose summed bytes are ``bytes_PP[src, dst]``."""
    bytes_PP = np.asarray(bytes_PP, dtype=float)
    P = bytes_PP.shape[0]
    if P <= 1:
        return 0.0
    node = node_of(P, link.devices_per_node)
    remote = ~np.eye(P, dtype=bool)
    same = (node[:, None] == node[None, :]) & remote
    cross = node[:, None] != node[None, :]
    intra = np.maximum((bytes_PP * same).sum(1), (bytes_PP * same).sum(0))
    inter = np.maximum((bytes_PP * cross).sum(1), (bytes_PP * cross).sum(0))
    t_rank = np.maximum(intra / link.intra_Bps, inter / link.inter_Bps if inter.any() else 0.0)
    latency = link.inter_latency_s if cross.any() and link.inter_latency_s else link.intra_latency_s
    return calls * latency + float(t_rank.max())


def rooted_seconds(bytes_PP: np.ndarray, link: Link, calls: int = 1, kind: str = "broadcast") -> float:
    """Projected time of ``calls`` broadcasts (or reduces, ``kind="reduce"``) whose summed
    logical bytes are ``bytes_PP[src, dst]``: each root's payload crosses the slowest link
    it needs once (a pipelined tree or ring moves a broadcast's bytes once per link, not
    once per peer), one root after another, plus the latency of every call."""
    bytes_PP = np.asarray(bytes_PP, dtype=float)
    P = bytes_PP.shape[0]
    if P <= 1:
        return 0.0
    remote = bytes_PP * ~np.eye(P, dtype=bool)
    payload = remote.max(1) if kind == "broadcast" else remote.max(0)     # per root
    multi_node = link.devices_per_node and link.devices_per_node < P
    bandwidth = link.slowest_Bps if multi_node else link.intra_Bps
    latency = link.inter_latency_s if multi_node and link.inter_latency_s else link.intra_latency_s
    return calls * latency + float(payload.sum()) / bandwidth


ROOTED = ("broadcast", "reduce")


def collective_seconds(bytes_PP: np.ndarray, link: Link, calls: int, kind: str) -> float:
    """A collective of any kind: rooted ones (broadcast, reduce) by :func:`rooted_seconds`,
    the others (all-to-all, all-gather, reduce-scatter: every rank sends its blocks to its
    peers) by :func:`a2a_seconds` on their per-peer bytes."""
    if kind in ROOTED:
        return rooted_seconds(bytes_PP, link, calls, kind)
    return a2a_seconds(bytes_PP, link, calls)


def swiglu_flops(rows: float, hidden: int, ffn: int, backward: bool = False) -> float:
    """FLOPs of SwiGLU experts on ``rows`` (token, expert) rows: 6 D F each forward, x2 backward."""
    return (12.0 if backward else 6.0) * rows * hidden * ffn


def expert_seconds(rows_P, hidden: int, ffn: int, link: Link, backward: bool = False,
                   local_experts: int = 0, element_bytes: int = 2, calls: int = 1) -> float:
    """Projected expert time: the busiest rank's FLOPs over the device's achieved throughput
    or, when the profile gives a memory bandwidth, the bytes its experts read and write
    over it if that takes longer (a roofline: few rows per expert are memory-bound); plus
    the profile's per-expert overhead for each of the ``local_experts`` (x2 backward).
    ``calls``: layer calls the rows came in (decode steps); each call reads the weights of
    at most min(local experts, rows per call) experts (an upper bound: every expert that
    could have been hit is read)."""
    rows_P = np.asarray(rows_P, dtype=float)
    rows = float(rows_P.max()) if rows_P.size else 0.0
    passes = 2 if backward else 1
    compute_s = swiglu_flops(rows, hidden, ffn, backward) / link.flops
    active = min(float(local_experts), rows / max(calls, 1))
    moved = passes * (calls * active * 3 * hidden * ffn + rows * (2 * hidden + 3 * ffn)) * element_bytes
    return max(compute_s, moved / link.memory_Bps) + passes * local_experts * link.expert_call_s


# ---------------------------------------------------------------------------
# projecting runs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The model a projection is for (defaults: the run's own)."""

    name: str
    hidden_size: int
    expert_ffn_size: int
    moe_layers: int = 0                 # 0: the run's own MoE layers, as measured


def target_model(name: str) -> Target:
    """A model config from conf/model as a projection target."""
    path = CONF / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
        raise FileNotFoundError(f"model={name}: no config {path}; models: {names}")
    m = yaml.safe_load(path.read_text())
    layers = int(m.get("num_layers", 1)) - int(m.get("first_k_dense", 0))
    return Target(name, int(m["hidden_size"]), int(m["expert_ffn_size"]), max(layers, 1))


def real_model_of(run_model: str) -> str:
    """The paper model a CPU proxy stands for (``olmoe_proxy`` -> ``olmoe``)."""
    return run_model[:-len("_proxy")] if run_model.endswith("_proxy") else run_model


def _kinds(run: pd.DataFrame) -> dict:
    """{(layer, phase, pass): collective kind} from the ``<kind>_calls`` rows (runs written
    before those rows existed: every collective an all-to-all)."""
    calls = run[run.metric.str.endswith("_calls") & (run.unit == "calls")]
    return {key: g.metric.iloc[0][:-len("_calls")] for key, g in calls.groupby(["layer", "phase", "pass"])}


def _collectives(run: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, phase, pass): the byte matrix, rows, calls per timed iteration, kind."""
    b = run[run.metric == "bytes"]
    r = run[run.metric == "rows"]
    P = int(run.world_size.iloc[0])
    timed = run[(run.metric == "a2a_time") & (run["sample"] >= 0)]
    first = timed[timed["sample"] == timed["sample"].min()] if not timed.empty else timed
    calls = first[first["rank"] == first["rank"].min()].groupby(["layer", "phase", "pass"]).size() \
        if not first.empty else pd.Series(dtype=int)
    meta = run[run.metric == "meta_bytes"]
    kinds = _kinds(run)
    out = []
    for (layer, phase, direction), g in b.groupby(["layer", "phase", "pass"]):
        rows = r[(r.layer == layer) & (r.phase == phase) & (r["pass"] == direction)].value.sum()
        m = meta[(meta.layer == layer) & (meta.phase == phase) & (meta["pass"] == direction)]
        out.append({"layer": layer, "phase": phase, "direction": direction, "bytes_PP": _peer_matrix(g, P),
                    "meta_PP": _peer_matrix(m, P), "rows": rows, "calls": int(calls.get((layer, phase, direction), 1)),
                    "kind": kinds.get((layer, phase, direction), "all_to_all")})
    return pd.DataFrame(out, columns=["layer", "phase", "direction", "bytes_PP", "meta_PP", "rows", "calls", "kind"])


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
    from occult.ep.links import pipeline_seconds

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
    coll = _collectives(run)
    out, a2a = [], {}
    for c in coll.itertuples():
        ms = collective_seconds(_resized(c, run, profile, target), link, c.calls, c.kind) * 1e3
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
    Adds the run's context columns.
    """
    from .summary import RUN_KEYS, SYSTEM_KEYS
    frames = []
    for run_dir, run in df.groupby("run_dir"):
        P = int(run.world_size.iloc[0])
        covered = P in profile.calibration if profile.calibration else P == profile.world_size
        exchanges = (run.metric == "bytes").any()
        if not covered or not (exchanges or single_device) or not same_nodes(run, profile.at(P)):
            continue
        tgt = target_model(real_model_of(str(run.model.iloc[0]))) if target == "real" else target
        proj = project_run(run, profile, tgt) if exchanges else project_single_device(run, profile, tgt)
        for key in RUN_KEYS + SYSTEM_KEYS:
            proj[key] = run[key].iloc[0]
        proj["run_dir"] = run_dir
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


# ---------------------------------------------------------------------------
# checking the model against this machine
# ---------------------------------------------------------------------------


def own_profile(run: pd.DataFrame) -> Optional[Profile]:
    """The loopback profile fitted to the calibration a run made of its own world right
    before its timed iterations (``task.calibrate=true``), or None."""
    if not run.metric.str.startswith("calib_").any():
        return None
    from .calibrate import fit_points, profile_dict
    points = fit_points(run)
    return profile_from_dict(profile_dict(points, "this run's own calibration")) if points else None


def check_against_measured(df: pd.DataFrame, profile: Optional[Profile]) -> pd.DataFrame:
    """Projected vs measured all-to-all (per phase and pass) and expert times of the
    ``task=layer`` runs that timed collectives apart (``task.sync_collectives=true``:
    they have ``a2a_wait`` rows, so ``a2a_time`` is the transfer, not the wait).

    A run that calibrated its own world first (``task.calibrate=true``) is projected
    with that calibration (same load as its measurements; column ``calibration`` =
    ``own run``), any other with ``profile`` (``sweep``; runs are skipped when it is None).
    One row per (run, quantity): ``measured_ms`` (slowest rank, median over samples),
    ``projected_ms``, ``error`` = projected / measured - 1. Quantity ``a2a_total`` is the
    sum over the iteration's collectives.
    """
    rows = []
    for run_dir, run in df[df.task == "layer"].groupby("run_dir"):
        P = int(run.world_size.iloc[0])
        if P < 2 or not (run.metric == "a2a_wait").any():
            continue
        run_profile, calibration = own_profile(run), "own run"
        if run_profile is None:
            run_profile, calibration = profile, "sweep"
        if run_profile is None or (run_profile.calibration and P not in run_profile.calibration):
            continue
        proj = project_run(run, run_profile)
        ctx = {"run_dir": run_dir, "system": run.system.iloc[0], "world_size": P,
               "top_k": int(run.top_k.iloc[0]), "routing": run.routing.iloc[0], "calibration": calibration}
        meas_total, proj_total = 0.0, 0.0
        for _, p in proj[proj.component.str.startswith("a2a:")].iterrows():
            phase = p.component.split(":", 1)[1]
            m = slowest_rank_ms(run, "a2a_time", phase, p["pass"]).get(run_dir, np.nan)
            meas_total += m
            proj_total += p.ms
            rows.append({**ctx, "quantity": f"a2a {phase} {p['pass']}", "measured_ms": m, "projected_ms": p.ms})
        rows.append({**ctx, "quantity": "a2a_total", "measured_ms": meas_total, "projected_ms": proj_total})
        exp = proj[(proj.component == "experts") & (proj["pass"] == "forward")].ms.sum()
        m = slowest_rank_ms(run, "time", "experts", "forward").get(run_dir, np.nan)
        rows.append({**ctx, "quantity": "experts forward", "measured_ms": m, "projected_ms": exp})
    out = pd.DataFrame(rows)
    if not out.empty:
        out["error"] = out.projected_ms / out.measured_ms - 1.0
    return out
