"""The price of an exchange against published GPU measurements: each published point
(:mod:`analysis.published`) priced on its profile from the simulated world of its shapes,
and the price's free parameters fitted leaving one source out at a time.

A point's exchange: the forward phases of its kernel in the simulated run (``dispatch`` or
``combine`` and a staged system's ``<phase>_<stage>``; not metadata, and the ``counts``
phases only where the kernel has a counts exchange), each rank's rows sent and received
within its node and across nodes (bytes / ``row_bytes``; a one-sided kernel on a static
system: its ``valid_*`` rows, a two-sided one the padded buffer's) and its messages, summed
over the phases; the rows take the published row bytes (its dtypes). Priced by
:func:`analysis.pricing.a2a_seconds_of_totals` on the point's profile with the transports'
parameters in place of the profile's assumed ones (NVLink's and the NIC's own latency,
efficiency and per-message cost) and the kernel's ``overlap``.

Free parameters, per transport (a profile's ``intra_node_transport`` / ``inter_node_transport``):
the latency of a call (us; the inter-node transport's when the world spans nodes), the
efficiency (achieved / the profile's datasheet bandwidth, at most 1) and the cost of a
message (us per peer a rank sends a non-empty block to). Everything else is the
datasheet's (the profile) or the simulation's.

Error of a point: ``|ln(projected / published)|`` on its time, on its bandwidth (its
source's byte rule over the projected time) where it publishes no time. A fit minimises
the sum of the errors (least absolute log error) over its points by Nelder-Mead on
unbounded coordinates (latency and message cost: exp, efficiency: a logistic), from the
profiles' assumed values, restarted until it stops improving.

Shapes: P ranks, N points.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd

from occult.ep.links import link_from_fields

from occult.ep.profiles import profile_fields

from .pricing import a2a_seconds_of_totals

PARAMS = ("latency_us", "efficiency", "message_us")
START = {"latency_us": 10.0, "efficiency": 0.8, "message_us": 0.1}
ROW_SUFFIXES = ("_meta", "_index")


# ---------------------------------------------------------------------------
# the simulated world of a point
# ---------------------------------------------------------------------------


def run_key(system: str, options: dict, world_size: int, devices_per_node: int, tokens_per_rank: int,
            num_experts: int, top_k: int, hidden: int) -> tuple:
    """What identifies the simulated world a published point needs."""
    declared = {k: options[k] for k in sorted(options) if k in ("dedup", "dispatch_mode")}
    if declared.get("dispatch_mode") == "dynamic":
        del declared["dispatch_mode"]                     # every system's default
    if system == "hierarchical":
        declared.setdefault("dedup", "device")
    per_node = int(devices_per_node) if 0 < int(devices_per_node) < int(world_size) else int(world_size)
    return (system, json.dumps(declared), int(world_size), per_node,
            int(tokens_per_rank), int(num_experts), int(top_k), int(hidden))


def simulated_runs(df: pd.DataFrame) -> dict:
    """{:func:`run_key`: the run's rows} of every task=simulate run in ``df``."""
    sim = df[(df.task == "simulate") & (df.clock == "simulated")]
    out = {}
    for _, run in sim.groupby("run_id", sort=False):
        f = run.iloc[0]
        options = {"dispatch_mode": f.dispatch_mode, **({"dedup": f.dedup} if f.dedup else {})}     # the columns
        out[run_key(f.system, options, f.world_size, f.devices_per_node, f.tokens_per_rank, f.num_experts,
                    f.top_k, f.hidden_size)] = run
    return out


def point_key(p) -> tuple:
    """The :func:`run_key` of a published point (a row of :func:`analysis.published.load_points`)."""
    return run_key(p.system, p.system_options, p.ep, p.devices_per_node, p.tokens_per_rank, p.num_experts, p.top_k, p.hidden)


def kernel_phases(phases, phase: str, counts: bool) -> list:
    """The phases of a run that a kernel's ``phase`` (dispatch | combine) moves rows in:
    ``phase`` and its stages ``phase_*``, not their metadata; with ``counts``, the counts
    phases of a dispatch too."""
    out = [p for p in phases if (p == phase or p.startswith(phase + "_")) and not p.endswith(ROW_SUFFIXES)]
    if counts and phase == "dispatch":
        out += [p for p in phases if p == "counts" or p.startswith("counts_")]
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One point's exchange per rank ([P] each): rows sent and received within the node and
    across nodes, messages in all and across nodes."""

    sent_intra_P: np.ndarray
    received_intra_P: np.ndarray
    sent_inter_P: np.ndarray
    received_inter_P: np.ndarray
    messages_P: np.ndarray
    inter_messages_P: np.ndarray


def exchange_of(run: pd.DataFrame, phase: str, valid: bool, counts: bool) -> Exchange:
    """A point's :class:`Exchange` from its simulated run (forward pass, mean over the
    sampled layers). ``valid``: the static buffer's valid rows (``valid_*``)."""
    prefix = "valid_" if valid else ""
    fwd = run[(run["pass"] == "forward")]
    if valid and not (fwd.metric == "valid_row_bytes").any():
        raise ValueError(f"run {run.run_id.iloc[0]}: a one-sided kernel is priced on a static system's valid rows; "
                         f"system {run.system.iloc[0]} wrote none (simulate it with system.dispatch_mode=static)")
    P = int(run.world_size.iloc[0])
    names = ("intra_node_bytes", "received_intra_node_bytes", "inter_node_bytes", "received_inter_node_bytes",
             "messages", "inter_node_messages")
    layers = sorted(fwd[fwd.metric == prefix + "row_bytes"].layer.unique())
    total = {n: np.zeros(P) for n in names}
    for layer in layers:
        at = fwd[fwd.layer == layer]
        sizes = at[at.metric == prefix + "row_bytes"].set_index("phase").value
        for ph in kernel_phases(sizes.index, phase, counts):
            g = at[(at.phase == ph) & (at["rank"] >= 0)]
            for n in names:
                m = g[g.metric == prefix + n]
                v = np.zeros(P)
                np.add.at(v, m["rank"].to_numpy(int), m.value.to_numpy(float))
                total[n] += v / (sizes[ph] if n.endswith("bytes") else 1.0)
    k = max(len(layers), 1)
    return Exchange(*(total[n] / k for n in names))


def counted_messages(x: Exchange, unit: str) -> Exchange:
    """``x`` with its NIC messages counted per ``unit`` (:data:`analysis.published.MESSAGE_UNITS`):
    ``peer`` as simulated (a message per remote peer with a non-empty block); ``pair`` a message
    per row sent across nodes (a static system's valid rows: one per (token, expert) pair).
    Messages within the node (NVLink stores) are left as simulated."""
    if unit == "peer":
        return x
    if unit != "pair":
        raise ValueError(f"messages.unit={unit!r}: allowed values ['peer', 'pair']")
    intra_P = x.messages_P - x.inter_messages_P
    return dataclasses.replace(x, messages_P=intra_P + x.sent_inter_P, inter_messages_P=x.sent_inter_P.copy())


def rule_rows(run: pd.DataFrame, rule: str) -> float:
    """Rows per rank a source's byte rule counts (:data:`analysis.published.BYTE_RULES`),
    mean over ranks: ``pairs`` tokens x K; ``rank_dedup_received`` the dispatch rows a rank
    receives (its own included); ``node_dedup_sent`` tokens x their distinct nodes."""
    first = run.iloc[0]
    tokens = float(first.tokens_per_rank)
    if rule == "pairs":
        return tokens * int(first.top_k)
    if rule == "rank_dedup_received":
        got = run[(run.metric == "received_rows") & (run.phase == "dispatch") & (run["pass"] == "forward")
                  & (run["rank"] >= 0)]
        return float(got.groupby("layer").value.mean().mean())
    if rule == "node_dedup_sent":
        ct = run[(run.metric == "ct_nodes") & (run["rank"] >= 0)]
        return tokens * float(ct.groupby("layer").value.mean().mean())
    raise ValueError(f"byte rule {rule!r}: allowed values ['pairs', 'rank_dedup_received', 'node_dedup_sent']")


# ---------------------------------------------------------------------------
# pricing a point
# ---------------------------------------------------------------------------


def transports_of(profile: str) -> tuple:
    """(NVLink transport, NIC transport) of a profile: its declared names, else the profile's name."""
    f = profile_fields(profile)
    return f["intra_node_transport"] or f"{profile}:intra", f["inter_node_transport"] or f"{profile}:inter"


def fitted_fields(profile: str, params: dict) -> dict:
    """A profile's fields with its transports' parameters (``params[transport][name]``) in
    place of its assumed latency, efficiency and per-message cost."""
    f = profile_fields(profile)
    intra, inter = transports_of(profile)
    for side, t in (("intra", intra), ("inter", inter)):
        if t in params:
            f[f"{side}_node_latency_us"] = params[t]["latency_us"]
            f[f"{side}_node_efficiency"] = params[t]["efficiency"]
            f[f"{side}_node_message_us"] = params[t]["message_us"]
    return f


def priced_seconds(x: Exchange, row_bytes: int, profile: str, params: dict, overlap: bool, multi_node: bool) -> float:
    """One point's projected time: :func:`analysis.pricing.a2a_seconds_of_totals` on the
    profile with ``params`` and the kernel's ``overlap``."""
    link = dataclasses.replace(link_from_fields(fitted_fields(profile, params)), overlap=overlap)
    b = float(row_bytes)
    return a2a_seconds_of_totals(x.sent_intra_P * b, x.received_intra_P * b, x.sent_inter_P * b, x.received_inter_P * b, link,
                                 1, multi_node=multi_node, messages_P=x.messages_P, inter_messages_P=x.inter_messages_P)


@dataclasses.dataclass
class Stack:
    """Every point's exchange as [N, P] arrays (padded with zeros to the largest P) and its
    fixed numbers, for pricing all points at once under trial parameters (the same
    arithmetic as :func:`priced_seconds`; ``tests/test_published.py`` holds them equal)."""

    intra_bytes_NP: np.ndarray     # [N, P] max(sent, received) within the node
    inter_bytes_NP: np.ndarray
    intra_messages_NP: np.ndarray
    inter_messages_NP: np.ndarray
    intra_Bps_N: np.ndarray       # [N] datasheet bandwidths (efficiency 1)
    inter_Bps_N: np.ndarray
    intra_t_N: list               # [N] transport names
    inter_t_N: list
    multi_node_N: np.ndarray      # [N] bool
    overlap_N: np.ndarray         # [N] bool


def stack(points: pd.DataFrame, exchanges: list) -> Stack:
    """A :class:`Stack` of ``points`` (rows of the published table with ``profile``,
    ``row_bytes``, ``overlap``, ``nodes``) and their :class:`Exchange`."""
    P = max(len(x.messages_P) for x in exchanges)
    pad = lambda v: np.pad(np.asarray(v, float), (0, P - len(v)))
    rows = list(points.itertuples())
    nominal = [link_from_fields({**profile_fields(p.profile), "link_efficiency": 1.0, "intra_node_efficiency": 0.0,
                                 "inter_node_efficiency": 0.0}) for p in rows]
    return Stack(
        intra_bytes_NP=np.stack([pad(np.maximum(x.sent_intra_P, x.received_intra_P) * p.row_bytes)
                              for x, p in zip(exchanges, rows)]),
        inter_bytes_NP=np.stack([pad(np.maximum(x.sent_inter_P, x.received_inter_P) * p.row_bytes)
                              for x, p in zip(exchanges, rows)]),
        intra_messages_NP=np.stack([pad(x.messages_P - x.inter_messages_P) for x in exchanges]),
        inter_messages_NP=np.stack([pad(x.inter_messages_P) for x in exchanges]),
        intra_Bps_N=np.array([n.intra_Bps for n in nominal]), inter_Bps_N=np.array([n.inter_Bps for n in nominal]),
        intra_t_N=[transports_of(p.profile)[0] for p in rows], inter_t_N=[transports_of(p.profile)[1] for p in rows],
        multi_node_N=np.array([p.nodes > 1 for p in rows]), overlap_N=np.array([bool(p.overlap) for p in rows]))


def stack_seconds(s: Stack, params: dict) -> np.ndarray:
    """[N] projected seconds of every stacked point under ``params``."""
    get = lambda names, key: np.array([params[t][key] for t in names])
    t_intra = s.intra_bytes_NP / (s.intra_Bps_N * get(s.intra_t_N, "efficiency"))[:, None] \
        + s.intra_messages_NP * get(s.intra_t_N, "message_us")[:, None] * 1e-6
    inter_known = [t if t in params else s.intra_t_N[0] for t in s.inter_t_N]      # unused where single-node
    t_inter = np.where(s.multi_node_N[:, None],
                       s.inter_bytes_NP / (s.inter_Bps_N * get(inter_known, "efficiency"))[:, None]
                       + s.inter_messages_NP * get(inter_known, "message_us")[:, None] * 1e-6, 0.0)
    t_rank = np.where(s.overlap_N[:, None], np.maximum(t_intra, t_inter), t_intra + t_inter)
    latency = np.where(s.multi_node_N, get(inter_known, "latency_us"), get(s.intra_t_N, "latency_us")) * 1e-6
    return latency + t_rank.max(1)


# ---------------------------------------------------------------------------
# errors and fits
# ---------------------------------------------------------------------------


def errors(projected_s: np.ndarray, points: pd.DataFrame) -> np.ndarray:
    """[N] |ln(projected / published)| on time; on bandwidth (``rule_bytes`` over the
    projected time) where a point publishes no time."""
    pub_s = points.latency_us.to_numpy(float) * 1e-6
    bw = points.rule_bytes.to_numpy(float) / projected_s / 1e9
    by_time = np.abs(np.log(projected_s / pub_s))
    by_bw = np.abs(np.log(bw / points.GBps.to_numpy(float)))
    return np.where(np.isfinite(pub_s), by_time, by_bw)


def _unpack(z: np.ndarray, names: list) -> dict:
    """Unbounded coordinates -> {transport: {latency_us, efficiency, message_us}}."""
    out = {}
    for i, t in enumerate(names):
        a, b, m = z[3 * i:3 * i + 3]
        out[t] = {"latency_us": float(np.exp(a)), "efficiency": float(1.0 / (1.0 + np.exp(-b))),
                  "message_us": float(np.exp(m))}
    return out


def _pack(params: dict, names: list) -> np.ndarray:
    z = []
    for t in names:
        p = params[t]
        e = min(max(p["efficiency"], 1e-6), 1 - 1e-6)
        z += [np.log(p["latency_us"]), np.log(e / (1 - e)), np.log(max(p["message_us"], 1e-9))]
    return np.array(z)


def nelder_mead(f, z0: np.ndarray, step: float = 0.5, iters: int = 4000, tol: float = 1e-9) -> np.ndarray:
    """The minimiser of ``f`` from ``z0`` (a plain Nelder-Mead simplex: reflection 1,
    expansion 2, contraction and shrink 1/2)."""
    n = len(z0)
    simplex = np.vstack([z0] + [z0 + step * np.eye(n)[i] for i in range(n)])
    values = np.array([f(z) for z in simplex])
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if values[-1] - values[0] < tol:
            break
        centre = simplex[:-1].mean(0)
        reflected = centre + (centre - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centre + 2 * (centre - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centre + 0.5 * (simplex[-1] - centre)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                values[1:] = [f(z) for z in simplex[1:]]
    return simplex[np.argmin(values)]


def fit(s: Stack, points: pd.DataFrame, restarts: int = 6) -> dict:
    """The transports' parameters minimising the sum of :func:`errors` over the stacked
    ``points`` (Nelder-Mead from :data:`START`, restarted from its result until the sum
    stops falling). Only the transports the points use are fitted."""
    names = sorted(set(s.intra_t_N) | {t for t, multi in zip(s.inter_t_N, s.multi_node_N) if multi})
    cost = lambda z: float(errors(stack_seconds(s, _unpack(z, names)), points).sum())
    z = _pack({t: START for t in names}, names)
    best = cost(z)
    for _ in range(restarts):
        z_new = nelder_mead(cost, z)
        new = cost(z_new)
        if new > best - 1e-9:
            break
        z, best = z_new, new
    return _unpack(z, names)


def subset(s: Stack, mask: np.ndarray) -> Stack:
    """The stacked points where ``mask`` holds."""
    idx = np.flatnonzero(mask)
    return Stack(s.intra_bytes_NP[idx], s.inter_bytes_NP[idx], s.intra_messages_NP[idx], s.inter_messages_NP[idx],
                 s.intra_Bps_N[idx], s.inter_Bps_N[idx], [s.intra_t_N[i] for i in idx], [s.inter_t_N[i] for i in idx],
                 s.multi_node_N[idx], s.overlap_N[idx])


def point_transports(s: Stack, i: int) -> set:
    """The transports point i's price reads."""
    return {s.intra_t_N[i]} | ({s.inter_t_N[i]} if s.multi_node_N[i] else set())


def leave_one_source_out(s: Stack, points: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Every point projected by a fit that did not see it: a fit point by the fit on the
    other sources' fit points (its source ``validated`` when they use every transport it
    reads), a check point (``role`` check) by the fit on every fit point. Returns the
    points with ``projected_s``, ``error``, ``fold`` (the source left out, or ``all``),
    ``validated``; and the parameters of every fold."""
    role_fit = (points.role == "fit").to_numpy()
    folds, out = {}, points.copy()
    out["projected_s"], out["fold"], out["validated"] = np.nan, "", False
    folds["all"] = fit(subset(s, role_fit), points[role_fit])
    for source in sorted(points[role_fit].source.unique()):
        train = role_fit & (points.source != source).to_numpy()
        folds[source] = fit(subset(s, train), points[train])
        seen = set().union(*(point_transports(s, i) for i in np.flatnonzero(train)))
        held = role_fit & (points.source == source).to_numpy()
        needed = set().union(*(point_transports(s, i) for i in np.flatnonzero(held)))
        validated = needed <= seen
        for i in np.flatnonzero(held):
            out.iloc[i, out.columns.get_loc("fold")] = source
            out.iloc[i, out.columns.get_loc("validated")] = validated
    for i in np.flatnonzero(~role_fit):
        out.iloc[i, out.columns.get_loc("fold")] = "all"
    for fold, params in folds.items():
        at = (out.fold == fold).to_numpy()
        full = {t: params.get(t, START) for t in set(s.intra_t_N) | set(s.inter_t_N)}
        if at.any():
            out.loc[at, "projected_s"] = stack_seconds(subset(s, at), full)
    out["error"] = errors(out.projected_s.to_numpy(float), out)
    return out, folds
