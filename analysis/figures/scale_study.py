"""The field at deployed scale (``python run.py experiment=scale_study``; ``report: scale_study``),
from result tables only.

Every point is a ``task=simulate`` run (``clock=simulated``): a world of P ranks in nodes
that is never started, every rank's traffic plan added up. :func:`point_table` gives one row
per point: bytes per rank to the other ranks of its node and to other nodes, messages per
rank (peers sent a non-empty block) in all and across nodes, the dispatch's received rows
max / mean over ranks (every dispatch stage's rows a rank receives: a hierarchical
forwarder's too), C_T, all per MoE layer (mean over the sampled layers) and forward
(the study plans no backward). :func:`projected` prices every point's collectives and its
experts on each profile of ``profiles`` (e.g. nodes of 8 x H100, 8 x H200, a GB200 NVL72
rack: ``conf/profile``) with
the cost model (:mod:`analysis.projection`, labelled projected): per MoE layer, the
collectives' time and the experts' (busiest rank's rows: tokens per rank x K, the
balanced-load assumption of the cost model). :func:`crossovers` reads where the answer
changes: per model, workload and profile, the best strategy at each P, the smallest P at
which hierarchical (its better dedup) is faster than Occult, and the largest P at which
all-gather is faster than naive EP.

A point is a model, a workload, a node layout (``devices_per_node``: the ranks of a node, P when
the world is one node, :func:`node_size`) and P: two layouts at one P (nodes of 8, one NVLink
domain) are two points, and a profile prices only the points of its own layout
(:func:`analysis.projection.same_nodes`); ``vs naive`` compares within one layout.
:func:`per_gpu` and :func:`best_per_gpu` give, per model, workload and profile, the (P,
strategy) with the most MoE tokens per second per GPU under a per-workload bound on the MoE
layers' time per step (report option ``latency_ms``) among the points whose memory per GPU
(:func:`memory_GB`, also the advisor's) fits. :func:`agreement_text` says why two profiles
whose collectives are priced alike agree and where they do not, read from their fields
(:func:`field_roles`) and the points; :func:`domain_table` puts the layouts side by side.

Points are named by ``strategy``: the system, hierarchical with its dedup
(``hierarchical_node``, ``hierarchical_device``); workloads by the run's label
(``conf/workload``: decode, prefill, prefill_strong).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from occult.config import read_conf
from occult.ep.links import Link
from occult.ep.profiles import load_profile, profile_fields, profile_from_dict

from ..plots import plt, save, style, system_order
from ..projection import project_runs, projected_totals
from ..sections import Section, write_table

WORKLOADS = {"decode": "decode, 128 tokens per rank (weak)", "prefill": "prefill, 4096 tokens per rank (weak)",
             "prefill_strong": "prefill, 65,536 tokens in all (strong)"}
DEFAULT_PROFILES = ("sim_h100_nodes", "sim_h200_nodes")


def strategy_of(system: str, dedup: str) -> str:
    """A point's strategy name: the system, hierarchical with its ``dedup`` (the column)."""
    return f"hierarchical_{dedup}" if system == "hierarchical" else system


def _per_rank(run: pd.DataFrame, metric: str, phases=None) -> pd.Series:
    """``metric`` (forward) per rank and layer summed over phases (``phases``: only those),
    then the mean over layers: a Series over ranks."""
    sel = run[(run.metric == metric) & (run["rank"] >= 0) & (run["pass"] == "forward")]
    if phases is not None:
        sel = sel[sel.phase.isin(phases)]
    if sel.empty:
        return pd.Series(dtype=float)
    return sel.groupby(["layer", "rank"]).value.sum().groupby("rank").mean()


def dispatch_phase(phase: pd.Series) -> pd.Series:
    """The phases that carry token rows towards the experts: ``dispatch`` and a staged
    system's ``dispatch_<stage>`` (hierarchical's inter- and intra-node stages), not their
    metadata (``*_meta``, ``*_index``)."""
    return phase.str.startswith("dispatch") & ~phase.str.endswith(("_meta", "_index"))


def node_size(devices_per_node: int, P: int) -> int:
    """The ranks of a run's node: its ``devices_per_node``, or P when the world is one node
    (0, or a node as large as the world): the layout its traffic was counted in and that
    :func:`analysis.projection.same_nodes` matches against a profile's."""
    return devices_per_node if 0 < devices_per_node < P else P


def point_row(run: pd.DataFrame) -> dict:
    """One simulated point's traffic (see the module docstring)."""
    first = run.iloc[0]
    intra, inter = _per_rank(run, "intra_node_bytes"), _per_rank(run, "inter_node_bytes")
    msgs, inter_msgs = _per_rank(run, "messages"), _per_rank(run, "inter_node_messages")
    got = run[(run.metric == "received_rows") & dispatch_phase(run.phase) & (run["pass"] == "forward")
              & (run["rank"] >= 0)]
    per_layer = got.groupby(["layer", "rank"]).value.sum().groupby("layer")
    max_over_mean = (per_layer.max() / per_layer.mean()).mean() if not got.empty else np.nan
    ct = run[(run.metric == "ct_all") & (run["rank"] == -1)].value.mean()
    layers = sorted(int(x) for x in run[run.metric == "ct_all"].layer.unique())
    world_tokens = run[(run.metric == "tokens") & (run["rank"] == -1)].value.mean()
    resampled = run[run.metric == "resampled_tokens"].value
    P = int(first.world_size)
    return {"model": first.model, "workload": first.label, "strategy": strategy_of(first.system, first.dedup),
            "system": first.system, "world_size": P,
            "devices_per_node": node_size(int(first.devices_per_node) if "devices_per_node" in run else 0, P),
            "tokens_per_rank": int(first.tokens_per_rank),
            "world_tokens": int(world_tokens) if np.isfinite(world_tokens) else -1,
            "dispatch_rows_max": float(got.groupby(["layer", "rank"]).value.sum().max()) if not got.empty else 0.0,
            "intra_MB_per_rank": intra.mean() / 1e6, "inter_MB_per_rank": inter.mean() / 1e6,
            "max_rank_MB": (intra.add(inter, fill_value=0)).max() / 1e6,
            "messages_per_rank": msgs.mean(), "inter_messages_per_rank": inter_msgs.mean(),
            "received_rows_max_over_mean": max_over_mean, "ct_all": ct, "routing": first.routing,
            "resampled": bool(resampled.max()) if not resampled.empty else False,
            "layers": " ".join(map(str, layers)), "planning_s_per_layer":
                run[run.metric == "planning_time"].value.mean() / 1e3, "run_id": first.run_id}


def point_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per simulated point (:func:`point_row`)."""
    sim = df[(df.task == "simulate") & (df.clock == "simulated")]
    rows = [point_row(run) for _, run in sim.groupby("run_id", sort=False)]
    return pd.DataFrame(rows)


def projected(df: pd.DataFrame, profiles) -> pd.DataFrame:
    """Per point and profile (a name in conf/profile, or a loaded :class:`~occult.ep.profiles.Profile`):
    projected collective, expert and MoE-layer ms per layer."""
    sim = df[(df.task == "simulate") & (df.clock == "simulated")]
    frames = []
    for given in profiles:
        profile = load_profile(given) if isinstance(given, str) else given
        name = profile.name
        tot = projected_totals(project_runs(sim[sim.world_size.isin(profile.sizes())], profile))
        if tot.empty:
            continue
        frames.append(pd.DataFrame({"run_id": tot.run_id, "profile": name, "a2a_ms": tot.a2a_ms_per_layer,
                                    "experts_ms": tot.experts_ms_per_layer,
                                    "moe_layer_ms": tot.a2a_ms_per_layer + tot.experts_ms_per_layer}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# a point of the study: a model, a workload and a world laid out in nodes (two layouts at one P,
# nodes of 8 and one NVLink domain, are two points: their traffic crosses different links)
POINT_KEYS = ["model", "workload", "devices_per_node", "world_size"]


def study_table(df: pd.DataFrame, profiles, proj: pd.DataFrame = None) -> pd.DataFrame:
    """:func:`point_table` with each profile's projected times (:func:`with_projection`;
    ``proj``: :func:`projected`'s table, when the caller has it)."""
    table = point_table(df)
    if table.empty:
        return table
    return with_projection(table, projected(df, profiles) if proj is None else proj, profiles)


def with_projection(table: pd.DataFrame, proj: pd.DataFrame, profiles) -> pd.DataFrame:
    """Points (:func:`point_table`) with each profile's projected MoE-layer ms (``<profile> ms``,
    NaN where the profile does not price the point), its collectives' ms and its ratio to naive
    EP's at the same model, workload, layout and P (:data:`POINT_KEYS`)."""
    table = table.copy()
    for name in profiles:
        sel = proj[proj.profile == name] if not proj.empty else proj
        col = f"{name} ms"
        table[col] = table.run_id.map(sel.set_index("run_id").moe_layer_ms) if not sel.empty else np.nan
        table[f"{name} a2a ms"] = table.run_id.map(sel.set_index("run_id").a2a_ms) if not sel.empty else np.nan
        naive = table[table.strategy == "naive"].set_index(POINT_KEYS)[col]
        keys = list(zip(*(table[k] for k in POINT_KEYS)))
        table[f"{name} vs naive"] = table[col].to_numpy() / np.array([naive.get(k, np.nan) for k in keys])
    return table.sort_values(POINT_KEYS + ["strategy"]).reset_index(drop=True)


def _first(ps, cond) -> object:
    """The first P of ``ps`` (ascending) where ``cond`` holds, or "-"."""
    hit = [int(p) for p, ok in zip(ps, cond) if ok]
    return hit[0] if hit else "-"


def layout_text(nodes) -> str:
    """The node sizes a profile's points were laid out in (:func:`node_size`, one per P)."""
    return ", ".join(sorted({"one node" if int(n) == int(p) else f"nodes of {int(n)}" for p, n in nodes}))


def profile_view(table: pd.DataFrame, name: str) -> pd.DataFrame:
    """The points projected onto profile ``name`` (each profile takes the layout of its own
    nodes, :func:`analysis.projection.same_nodes`), one per P and strategy (two layouts that
    are one node at that P are the same world: the first)."""
    col = f"{name} ms"
    if col not in table:
        return table.iloc[:0]
    return table[table[col].notna()].drop_duplicates(["model", "workload", "world_size", "strategy"])


def crossovers(table: pd.DataFrame, profiles) -> pd.DataFrame:
    """Per model, workload and profile (on the layout of its own nodes: ``layout``): the best
    strategy at each P, where hierarchical's better dedup first beats Occult, and the largest
    P at which all-gather still beats naive EP."""
    out = []
    for (model, workload), g in table.groupby(["model", "workload"], sort=True):
        for name in profiles:
            col = f"{name} ms"
            mine = profile_view(g, name)
            if mine.empty:
                continue
            wide = mine.pivot_table(index="world_size", columns="strategy", values=col)
            ps = list(wide.index)
            best = wide.idxmin(axis=1)
            hier = wide[[c for c in wide if c.startswith("hierarchical")]].min(axis=1) if \
                any(c.startswith("hierarchical") for c in wide) else pd.Series(np.nan, index=wide.index)
            occ = wide.get("occult", pd.Series(np.nan, index=wide.index))
            ag, naive = (wide.get(s, pd.Series(np.nan, index=wide.index)) for s in ("allgather", "naive"))
            pays = [int(p) for p in ps if ag[p] < naive[p]]
            out.append({"model": model, "workload": workload, "profile": name,
                        "layout": layout_text(mine[["world_size", "devices_per_node"]].drop_duplicates().to_numpy())
                        if "devices_per_node" in mine else "",
                        "best by P": ", ".join(f"{p}: {best[p]}" for p in ps),
                        "hierarchical beats occult from P": _first(ps, (hier < occ).tolist()),
                        "allgather beats naive up to P": max(pays) if pays else "never"})
    return pd.DataFrame(out)


def moe_layers(model) -> int:
    """A model config's MoE layers: its layers but the first dense ones."""
    return int(model.num_layers) - int(model.first_k_dense)


def memory_GB(model, P: int, element_bytes: int, received_max_rows: float) -> float:
    """Per GPU: the routed experts' weights of every MoE layer (E / P experts of 3 D F elements)
    plus the largest dispatch buffer (``received_max_rows`` x D elements). Attention, shared
    experts, dense layers, embeddings and caches sit on every GPU too and are not counted (the
    same for every strategy), so fitting ``memory_GB`` by this is necessary, not sufficient."""
    weights = model.num_experts / P * 3 * model.hidden_size * model.expert_ffn_size * moe_layers(model)
    return (weights + received_max_rows * model.hidden_size) * element_bytes / 1e9


def bound_of(latency_ms, workload: str):
    """The per-step bound (ms of the MoE layers) for ``workload``: ``latency_ms`` one number
    for every workload, or ``{workload: ms}``; None: no bound."""
    if isinstance(latency_ms, (int, float)):
        return float(latency_ms) if latency_ms > 0 else None
    got = (latency_ms or {}).get(workload)
    return float(got) if got else None


def per_gpu(points: pd.DataFrame, proj: pd.DataFrame, latency_ms=None, profiles=None) -> pd.DataFrame:
    """Per point (:func:`point_table`) and profile it is projected on (:func:`projected`): the
    MoE layers' time of one step (``step_ms``: MoE-layer ms x the model's MoE layers; attention
    and dense layers are not modelled), the MoE layers' tokens per second per GPU (tokens per
    rank / step_ms), the memory per GPU (:func:`memory_GB`) and whether it fits the profile's
    ``memory_GB`` (yes when the profile states none), and whether the step is within the
    workload's bound (:func:`bound_of`; yes without one). ``profiles``: ``{name: Profile}`` as
    projected (a profile given as a file, or regrouped); by default each read by its name."""
    if points.empty or proj.empty:
        return pd.DataFrame()
    t = points.merge(proj[["run_id", "profile", "a2a_ms", "experts_ms", "moe_layer_ms"]], on="run_id")
    models = {m: read_conf("model", m) for m in t.model.unique()}
    profiles = {p: (profiles or {}).get(p) or load_profile(p) for p in t.profile.unique()}
    P = t.world_size.to_numpy(float)
    tokens = np.where(t.world_tokens > 0, t.world_tokens / P, t.tokens_per_rank)
    t["moe_layers"] = [moe_layers(models[m]) for m in t.model]
    t["step_ms"] = t.moe_layer_ms * t.moe_layers
    t["tokens_per_s_per_GPU"] = tokens / t.step_ms * 1e3
    t["memory_GB_per_GPU"] = [memory_GB(models[m], int(p), profiles[f].element_bytes, rows)
                              for m, p, f, rows in zip(t.model, t.world_size, t.profile, t.dispatch_rows_max)]
    cap = t.profile.map(lambda f: profiles[f].memory_GB or np.inf)
    t["fits"] = t.memory_GB_per_GPU <= cap
    t["bound_ms"] = [bound_of(latency_ms, w) for w in t.workload]
    t["within_bound"] = t.bound_ms.isna() | (t.step_ms <= t.bound_ms.fillna(np.inf))
    return t


def why_none(g: pd.DataFrame) -> str:
    """Why no point of ``g`` (one model, workload and profile of :func:`per_gpu`) qualifies."""
    fast = g.loc[g.step_ms.idxmin()]
    small = g.loc[g.memory_GB_per_GPU.idxmin()]
    over = f"the fastest step takes {fast.step_ms:.3g} ms (P = {int(fast.world_size)}, {fast.strategy}) > {fast.bound_ms:.3g} ms"
    if not g.fits.any():
        return f"none fits: the least memory per GPU is {small.memory_GB_per_GPU:.3g} GB (P = {int(small.world_size)})"
    if not g.within_bound.any():
        return f"none within the bound: {over}"
    fit = g[g.fits]
    f = fit.loc[fit.step_ms.idxmin()]
    return (f"the {int(g.within_bound.sum())} point(s) within the bound do not fit; the fastest that fits takes "
            f"{f.step_ms:.3g} ms (P = {int(f.world_size)}, {f.strategy})")


def best_per_gpu(gpu: pd.DataFrame, keys=("model", "workload", "profile")) -> pd.DataFrame:
    """Per ``keys``: the (P, strategy) with the most MoE tokens per second per GPU among the points
    within the bound that fit in memory (:func:`per_gpu`), or why none qualifies."""
    out = []
    for key, g in gpu.groupby(list(keys), sort=True):
        row = dict(zip(keys, key))
        ok = g[g.within_bound & g.fits]
        bound = g.bound_ms.iloc[0]
        row.update({"bound ms": bound if pd.notna(bound) else "none", "points": len(g),
                    "over the bound": int((~g.within_bound).sum()), "do not fit": int((~g.fits).sum())})
        if ok.empty:
            row.update({"P": "-", "strategy": "-", "tokens/s per GPU": np.nan, "step ms": np.nan,
                        "GB per GPU": np.nan, "answer": why_none(g)})
        else:
            b = ok.loc[ok.tokens_per_s_per_GPU.idxmax()]
            row.update({"P": int(b.world_size), "strategy": b.strategy, "tokens/s per GPU": b.tokens_per_s_per_GPU,
                        "step ms": b.step_ms, "GB per GPU": b.memory_GB_per_GPU,
                        "answer": f"P = {int(b.world_size)}, {b.strategy}"})
        out.append(row)
    return pd.DataFrame(out)


# the Link attributes the experts' price reads (analysis.pricing.expert_seconds); every other
# attribute of a Link prices a collective
EXPERT_LINK = ("flops", "memory_Bps", "expert_call_s")
# fields that name or cite a profile
NAMING_FIELDS = ("name", "source")


def field_roles(a: str, b: str) -> dict:
    """{field: (a's value, b's value, what it prices)} for every field profiles ``a`` and ``b``
    differ in (:func:`occult.ep.profiles.profile_fields`), the role found by giving ``a`` that
    one field of ``b`` and seeing what changes: the links that price a collective, the experts'
    compute or memory bandwidth (:data:`EXPERT_LINK`), the memory fit (``memory_GB``), the
    world sizes covered, the element size, or nothing the cost model reads."""
    fa, fb = profile_fields(a), profile_fields(b)
    pa = profile_from_dict(fa)
    out = {}
    for name in fa:
        if name in NAMING_FIELDS or fa[name] == fb[name]:
            continue
        try:
            pb = profile_from_dict({**fa, name: fb[name]})
        except ValueError:          # e.g. world sizes that do not fill a's nodes
            out[name] = (fa[name], fb[name], ["world sizes covered"])
            continue
        roles = []
        changed = [f.name for f in dataclasses.fields(Link) if pa.link and pb.link
                   and getattr(pa.link, f.name) != getattr(pb.link, f.name)]
        if any(c not in EXPERT_LINK for c in changed):
            roles.append("collectives")
        if any(c in EXPERT_LINK for c in changed):
            roles.append("experts")
        if pb.memory_GB != pa.memory_GB:
            roles.append("memory fit")
        if pb.sizes() != pa.sizes():
            roles.append("world sizes covered")
        if pb.dtype != pa.dtype:
            roles.append("element size")
        out[name] = (fa[name], fb[name], roles or ["not read by the cost model"])
    return out


def _links(link: Link, expert: bool) -> dict:
    """A profile's Link attributes that price the experts (``expert``) or the collectives."""
    return {f.name: getattr(link, f.name) for f in dataclasses.fields(Link) if (f.name in EXPERT_LINK) == expert}


def contrast_text(a: str, b: str) -> str:
    """What two profiles' fields make of their prices (:func:`field_roles`), in one paragraph."""
    roles = field_roles(a, b)
    la, lb = load_profile(a), load_profile(b)
    diff = "; ".join(f"`{k}` ({va!r} vs {vb!r}: {', '.join(r)})" for k, (va, vb, r) in roles.items())
    same = [what for what, expert in (("the links that price every collective", False),
                                      ("the experts' compute and memory bandwidth", True))
            if la.link and lb.link and _links(la.link, expert) == _links(lb.link, expert)]
    text = f"`{a}` and `{b}` differ in {diff or 'no field the cost model reads'}."
    if same:
        text += " Equal: " + " and ".join(same) + "."
    return text


def agreement_text(a: str, b: str, gpu: pd.DataFrame, cross: pd.DataFrame, best: pd.DataFrame) -> list:
    """For two profiles whose collectives are priced alike (:func:`field_roles`: no field of theirs
    that prices a collective differs): why their answers agree and where they differ, from the
    points projected on both (:func:`per_gpu` rows) and their crossovers and best per GPU."""
    both = gpu[gpu.profile.isin([a, b])].pivot_table(
        index=POINT_KEYS + ["strategy"], columns="profile",
        values=["a2a_ms", "experts_ms", "memory_GB_per_GPU", "fits"], aggfunc="first").dropna()
    if both.empty:
        return [contrast_text(a, b)]
    n = len(both)
    a2a_gap = float((both["a2a_ms"][a] - both["a2a_ms"][b]).abs().max())
    exp_a, exp_b = both["experts_ms"][a], both["experts_ms"][b]
    moved = ~np.isclose(exp_a, exp_b, rtol=1e-9)
    workloads = sorted(set(both[moved].index.get_level_values("workload")))
    spread = both["experts_ms"].groupby(level=POINT_KEYS).agg(lambda s: s.max() - s.min())
    flat = int((spread.abs().max(axis=1) < 1e-9).sum())
    text = [contrast_text(a, b) + f" Over the {n} points projected on both: the collectives' time differs by at most "
            f"{a2a_gap:.2g} ms; the experts' differs at {int(moved.sum())} point(s)"
            + (f" (workloads: {', '.join(workloads)}; {b} / {a} median {float((exp_b / exp_a)[moved].median()):.3g}: "
               "there the roofline makes the experts memory-bound)" if moved.any() else "")
            + f". At one model, workload, layout and P the experts cost the same for every strategy in {flat} of "
            f"{len(spread)} cases (the cost model gives each rank tokens per rank x K rows, balanced), so where that "
            "holds the experts cannot reorder the strategies: the order at each P is the collectives' order, "
            "the same on both."]
    ca, cb = (cross[cross.profile == p].set_index(["model", "workload"]) for p in (a, b))
    keys = ca.index.intersection(cb.index)
    cols = ["best by P", "hierarchical beats occult from P", "allgather beats naive up to P"]
    differ = [k for k in keys if any(str(ca.loc[k, c]) != str(cb.loc[k, c]) for c in cols)]
    text.append(f"Crossovers: the same on both in {len(keys) - len(differ)} of {len(keys)} (model, workload) rows"
                + (": they differ for " + ", ".join(f"{m} {w}" for m, w in differ) if differ else "") + ".")
    ba, bb = (best[best.profile == p].set_index(["model", "workload"]) for p in (a, b))
    keys = ba.index.intersection(bb.index)
    diff_best = [f"{m} {w} ({ba.loc[(m, w), 'answer']} on {a}; {bb.loc[(m, w), 'answer']} on {b})"
                 for m, w in keys if ba.loc[(m, w), "answer"] != bb.loc[(m, w), "answer"]]
    fit = both["fits"].astype(bool)
    only = fit[fit[a] != fit[b]].reset_index()
    fit_text = ", ".join(f"{m} P = {int(p)} ({b if ok_b else a} only)" for (m, p), ok_b in
                         only.groupby(["model", "world_size"])[b].first().items())
    text.append(f"Best (P, strategy) per GPU under the bound: the same in {len(keys) - len(diff_best)} of "
                f"{len(keys)} rows" + (": it moves for " + "; ".join(diff_best) if diff_best else "") + ". "
                + (f"Memory fit differs at: {fit_text}." if fit_text else "Memory fit: the same at every point."))
    return text


def domain_table(table: pd.DataFrame, profiles) -> pd.DataFrame:
    """Per model, workload and P that profiles of different layouts both cover (nodes of 8 and one
    NVLink domain): each profile's best strategy (and its MoE-layer ms) side by side; ``moves``:
    whether the best strategy differs between the layouts."""
    rows = {}
    for name in profiles:
        mine = profile_view(table, name)
        col = f"{name} ms"
        for (m, w, p), g in mine.groupby(["model", "workload", "world_size"]):
            b = g.loc[g[col].idxmin()]
            rows.setdefault((m, w, int(p)), {})[name] = (b.strategy, float(b[col]), int(b.devices_per_node))
    out = []
    for (m, w, p), got in sorted(rows.items()):
        if len({n for _, _, n in got.values()}) < 2:
            continue
        row = {"model": m, "workload": w, "world_size": p}
        for name in profiles:
            s, ms, n = got.get(name, ("-", np.nan, 0))
            row[f"{name} best"] = f"{s} ({ms:.3g} ms, {'one node' if n == p else f'nodes of {n}'})" if s != "-" else "-"
        layouts = {}
        for s, _, n in got.values():
            layouts.setdefault(n, set()).add(s)
        row["moves"] = "yes" if len({frozenset(v) for v in layouts.values()}) > 1 else "no"
        out.append(row)
    return pd.DataFrame(out)


def scaling_figure(table: pd.DataFrame, workload: str, profiles, out_dir: Path) -> list:
    """Rows: models; columns: bytes per rank (intra + inter node, MB; the points of the first
    profile's layout) and each profile's projected MoE-layer ms (its own layout's points,
    :func:`profile_view`), against P (log axes), one line per strategy."""
    t = table[table.workload == workload]
    models = sorted(t.model.unique())
    cols = [("bytes", "MB per rank per layer (to other ranks)")] + [(p, f"{p}: MoE layer ms (projected)")
                                                                  for p in profiles]
    style()
    fig, axes = plt.subplots(len(models), len(cols), figsize=(4.2 * len(cols), 2.4 * len(models)), squeeze=False)
    strategies = system_order(t.strategy)
    for i, model in enumerate(models):
        m = t[t.model == model]
        for j, (key, label) in enumerate(cols):
            ax = axes[i][j]
            view = profile_view(m, profiles[0] if key == "bytes" else key)
            for s in strategies:
                part = view[view.strategy == s].sort_values("world_size")
                if part.empty:
                    continue
                y = part.intra_MB_per_rank + part.inter_MB_per_rank if key == "bytes" else part[f"{key} ms"]
                ax.plot(part.world_size, y, marker="o", ms=3, label=s)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model}: {label}", fontsize=8)
            where = layout_text(view[["world_size", "devices_per_node"]].drop_duplicates().to_numpy())
            ax.set_xlabel(f"P (GPUs; {where})", fontsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"Scale study, {WORKLOADS.get(workload, workload)}: simulated bytes, projected time", y=1.0)
    fig.tight_layout()
    return save(fig, Path(out_dir) / f"scale_study_{workload}")


WORLD_SIZES = (8, 16, 32, 64, 128, 256)


def study_models() -> list:
    """The full model configs the study is for (conf/model: a family, not a proxy) whose routed
    experts some P of :data:`WORLD_SIZES` divides."""
    from occult.config import CONF_DIR
    out = []
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        m = read_conf("model", path.stem)
        if m.family and not m.proxy and any(m.num_experts % p == 0 for p in WORLD_SIZES):
            out.append(path.stem)
    return out


def coverage_text(table: pd.DataFrame) -> str:
    """Which of the study's models and strategies these runs hold, and which they do not."""
    from occult.config import CONF_DIR
    have, studied = set(table.model), study_models()
    missing = [m for m in studied if m not in have]
    points = table.groupby("model").size()
    line = "Points per model: " + ", ".join(f"{m} {n}" for m, n in points.items()) + "."
    if missing:
        line += " Not in these runs (the sweep did not reach them): " + ", ".join(missing) + "."
    configs = {p.stem: read_conf("model", p.stem) for p in sorted((CONF_DIR / "model").glob("*.yaml"))}
    none = [f"{name} ({m.num_experts} experts)" for name, m in configs.items()
            if m.family and not m.proxy and name not in studied]
    if none:
        line += " No P of the study divides the routed experts of " + ", ".join(none) + "."
    return line


def pairs_priced_alike(profiles) -> list:
    """The pairs of ``profiles`` whose collectives are priced alike (no field of theirs that
    prices a collective or the world sizes differs: :func:`field_roles`)."""
    out = []
    for i, a in enumerate(profiles):
        for b in profiles[i + 1:]:
            roles = {r for _, _, rs in field_roles(a, b).values() for r in rs}
            if not roles & {"collectives", "world sizes covered"}:
                out.append((a, b))
    return out


def per_gpu_text(best: pd.DataFrame, latency_ms) -> str:
    """What the best-per-GPU table answers, its bounds stated."""
    bounds = ", ".join(f"{w} {bound_of(latency_ms, w):g} ms" for w in sorted(set(best.workload))
                       if bound_of(latency_ms, w)) or "none given"
    return ("**Best P per GPU under a latency bound** (`scale_study_per_gpu`): per model, workload and profile, the "
            "(P, strategy) with the most MoE tokens per second per GPU (tokens per rank / the MoE layers' projected "
            "time of one step: MoE-layer ms x the model's MoE layers; attention and dense layers are not modelled) "
            "among the points whose step is within the workload's bound and whose memory per GPU (routed experts' "
            "weights of every MoE layer plus the largest dispatch buffer) fits the profile's `memory_GB`: a necessary condition, not a sufficient one: attention, shared experts, dense layers, embeddings and caches sit on every GPU too and are not counted (a P that fits here may not fit a whole model); `answer` says why "
            f"none qualifies where none does. Bounds (report option `latency_ms`, the MoE layers' ms per step): "
            f"{bounds}. Every point's step, tokens/s per GPU and memory: `scale_study_per_gpu_points.csv`.")


def domain_text(dom: pd.DataFrame, table: pd.DataFrame = None) -> str:
    """What the layouts' table says, counted; the strategies one layout's points lack at the P
    of the table (from ``table``, :func:`study_table`: a strategy not simulated there cannot be
    its best)."""
    if dom.empty:
        return "No P is covered by profiles of two layouts in these runs (nodes of 8 and one NVLink domain)."
    moved = dom[dom.moves == "yes"]
    lacking = ""
    if table is not None and not table.empty:
        at = table[table.world_size.isin(set(dom.world_size)) & table.model.isin(set(dom.model))]
        one = at.devices_per_node >= at.world_size
        missing = sorted(set(at[~one].strategy) - set(at[one].strategy))
        if missing:
            lacking = (f" The one-node points have no {', '.join(missing)} (not simulated there), so where the "
                       "nodes-of-8 best is one of them, the move says what the other strategies do in one node.")
    return ("**When EP fits one NVLink domain** (`scale_study_nvlink_domain`): at each model, workload and P that "
            "profiles of different node layouts cover, each profile's best strategy on its own layout's points. "
            f"The best strategy moves in {len(moved)} of {len(dom)} rows"
            + (": " + "; ".join(f"{r.model} {r.workload} P = {r.world_size}" for r in moved.itertuples())
               if 0 < len(moved) <= 12 else "") + "." + lacking)


def build(df: pd.DataFrame, out_dir, profiles=DEFAULT_PROFILES, latency_ms=None) -> list:
    """Report builder: the points table (``scale_study.csv``), the crossovers
    (``scale_study_crossovers.csv``), the best (P, strategy) per GPU under the bounds
    ``latency_ms`` (``{workload: ms}``, the MoE layers' time per step; ``scale_study_per_gpu``),
    why profiles priced alike agree, the layouts side by side (``scale_study_nvlink_domain``)
    and one figure per workload."""
    title = "The field at deployed scale: expert parallelism to 256 GPUs"
    profiles = list(profiles)
    sim = df[(df.task == "simulate") & (df.clock == "simulated")]
    if sim.empty:
        return [Section(title, ["Not drawn: no task=simulate runs."])]
    points = point_table(sim)
    proj = projected(sim, profiles)
    table = with_projection(points, proj, profiles)
    out_dir = Path(out_dir)
    write_table(table, out_dir, "scale_study")
    cross = crossovers(table, profiles)
    write_table(cross, out_dir, "scale_study_crossovers")
    gpu = per_gpu(points, proj, latency_ms)
    best = best_per_gpu(gpu) if not gpu.empty else pd.DataFrame()
    dom = domain_table(table, profiles)
    figs = []
    for w in [w for w in WORKLOADS if w in set(table.workload)]:
        figs += scaling_figure(table, w, profiles, out_dir)
    sized = table.groupby("model").world_size.max()
    text = [
        "Every number here is **simulated** (bytes, messages, rows, C_T: the systems' own traffic plans for "
        "every rank of a world that never ran, `task=simulate`, tested equal to what real runs log at P <= 16) "
        "or **projected** (times: the cost model on the profiles "
        + ", ".join(f"`{p}` ({load_profile(p).source})" for p in profiles) + "); nothing here was "
        "measured on a GPU. Per MoE layer (mean over the sampled `layers`), forward pass; bytes and messages "
        "per rank to other ranks; `received_rows_max_over_mean`: the dispatch's received rows, busiest rank over "
        "the mean; projected ms: the collectives plus the experts (balanced load). A point is a model, workload, "
        "layout (`devices_per_node`: the ranks of a node, P for one node) and P; a profile prices only the points "
        "of its own node layout, and `vs naive` compares within one layout. Every point's row: "
        "`scale_study.csv`; inline, per model, workload and profile: the best strategy at each P and where "
        "the strategies cross.",
        "Largest P per model: " + ", ".join(f"{m} {p}" for m, p in sized.items()) + ". " + coverage_text(table),
        "Routing: `router` points route held-out text through the trained proxy's routers (resampled with "
        "replacement where the world needs more tokens than the 32,768 routed: `resampled`); `uniform` points "
        "are synthetic."]
    tables = [("scale_study_crossovers", cross)]
    data = [("scale_study", table.drop(columns=["run_id"]))]
    if not best.empty:
        write_table(best, out_dir, "scale_study_per_gpu")
        text.append(per_gpu_text(best, latency_ms))
        tables.append(("scale_study_per_gpu", best))
        gpu.drop(columns=["run_id"]).to_csv(out_dir / "scale_study_per_gpu_points.csv", index=False)   # no figure
        for a, b in pairs_priced_alike(profiles):
            text.append(f"**Why `{a}` and `{b}` agree, and where they do not** (from the profiles' fields and these "
                        "points):")
            text += agreement_text(a, b, gpu, cross, best)
    text.append(domain_text(dom, table))
    if not dom.empty:
        write_table(dom, out_dir, "scale_study_nvlink_domain")
        tables.append(("scale_study_nvlink_domain", dom))
    # one row per simulated point (hundreds): its CSV and the figures; the summaries inline
    return [Section(title, text, tables, figs, data=data)]
