"""The field at deployed scale (``python run.py experiment=scale_study``; ``report: scale_study``),
from result tables only.

Every point is a ``task=simulate`` run (``clock=simulated``): a world of P ranks in nodes of 8
that is never started, every rank's traffic plan added up. :func:`point_table` gives one row
per point: bytes per rank to the other ranks of its node and to other nodes, messages per
rank (peers sent a non-empty block) in all and across nodes, the dispatch's received rows
max / mean over ranks (every dispatch stage's rows a rank receives: a hierarchical
forwarder's too), C_T, all per MoE layer (mean over the sampled layers) and forward
(the study plans no backward). :func:`projected` prices every point's collectives and its
experts on each profile of ``profiles`` (nodes of 8 x H100, 8 x H200: ``conf/profile``) with
the cost model (:mod:`analysis.projection`, labelled projected): per MoE layer, the
collectives' time and the experts' (busiest rank's rows: tokens per rank x K, the
balanced-load assumption of the cost model). :func:`crossovers` reads where the answer
changes: per model, workload and profile, the best strategy at each P, the smallest P at
which hierarchical (its better dedup) is faster than Occult, and the largest P at which
all-gather is faster than naive EP.

Points are named by ``strategy``: the system, hierarchical with its dedup
(``hierarchical_node``, ``hierarchical_device``); workloads by the run's label
(``conf/workload``: decode, prefill, prefill_strong).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from occult.ep.profiles import load_profile

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
    return {"model": first.model, "workload": first.label, "strategy": strategy_of(first.system, first.dedup),
            "system": first.system, "world_size": int(first.world_size), "tokens_per_rank": int(first.tokens_per_rank),
            "world_tokens": int(world_tokens) if np.isfinite(world_tokens) else -1,
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
    """Per point and profile: projected collective, expert and MoE-layer ms per layer."""
    sim = df[(df.task == "simulate") & (df.clock == "simulated")]
    frames = []
    for name in profiles:
        profile = load_profile(name)
        tot = projected_totals(project_runs(sim[sim.world_size.isin(profile.sizes())], profile))
        if tot.empty:
            continue
        frames.append(pd.DataFrame({"run_id": tot.run_id, "profile": name, "a2a_ms": tot.a2a_ms_per_layer,
                                    "experts_ms": tot.experts_ms_per_layer,
                                    "moe_layer_ms": tot.a2a_ms_per_layer + tot.experts_ms_per_layer}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def study_table(df: pd.DataFrame, profiles) -> pd.DataFrame:
    """:func:`point_table` with each profile's projected MoE-layer ms (``<profile> ms``) and its
    ratio to naive EP's at the same model, workload and P."""
    table = point_table(df)
    if table.empty:
        return table
    proj = projected(df, profiles)
    for name in profiles:
        sel = proj[proj.profile == name] if not proj.empty else proj
        col = f"{name} ms"
        table[col] = table.run_id.map(sel.set_index("run_id").moe_layer_ms) if not sel.empty else np.nan
        table[f"{name} a2a ms"] = table.run_id.map(sel.set_index("run_id").a2a_ms) if not sel.empty else np.nan
        naive = table[table.strategy == "naive"].set_index(["model", "workload", "world_size"])[col]
        keys = list(zip(table.model, table.workload, table.world_size))
        table[f"{name} vs naive"] = table[col].to_numpy() / np.array([naive.get(k, np.nan) for k in keys])
    return table.sort_values(["model", "workload", "world_size", "strategy"]).reset_index(drop=True)


def _first(ps, cond) -> object:
    """The first P of ``ps`` (ascending) where ``cond`` holds, or "-"."""
    hit = [int(p) for p, ok in zip(ps, cond) if ok]
    return hit[0] if hit else "-"


def crossovers(table: pd.DataFrame, profiles) -> pd.DataFrame:
    """Per model, workload and profile: the best strategy at each P, where hierarchical's better
    dedup first beats Occult, and the largest P at which all-gather still beats naive EP."""
    out = []
    for (model, workload), g in table.groupby(["model", "workload"], sort=True):
        for name in profiles:
            col = f"{name} ms"
            if col not in g or g[col].isna().all():
                continue
            wide = g.pivot_table(index="world_size", columns="strategy", values=col)
            ps = list(wide.index)
            best = wide.idxmin(axis=1)
            hier = wide[[c for c in wide if c.startswith("hierarchical")]].min(axis=1) if \
                any(c.startswith("hierarchical") for c in wide) else pd.Series(np.nan, index=wide.index)
            occ = wide.get("occult", pd.Series(np.nan, index=wide.index))
            ag, naive = (wide.get(s, pd.Series(np.nan, index=wide.index)) for s in ("allgather", "naive"))
            pays = [int(p) for p in ps if ag[p] < naive[p]]
            out.append({"model": model, "workload": workload, "profile": name,
                        "best by P": ", ".join(f"{p}: {best[p]}" for p in ps),
                        "hierarchical beats occult from P": _first(ps, (hier < occ).tolist()),
                        "allgather beats naive up to P": max(pays) if pays else "never"})
    return pd.DataFrame(out)


def scaling_figure(table: pd.DataFrame, workload: str, profiles, out_dir: Path) -> list:
    """Rows: models; columns: bytes per rank (intra + inter node, MB) and each profile's
    projected MoE-layer ms, against P (log axes), one line per strategy."""
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
            for s in strategies:
                part = m[m.strategy == s].sort_values("world_size")
                if part.empty:
                    continue
                y = part.intra_MB_per_rank + part.inter_MB_per_rank if key == "bytes" else part[f"{key} ms"]
                ax.plot(part.world_size, y, marker="o", ms=3, label=s)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model}: {label}", fontsize=8)
            ax.set_xlabel("P (GPUs, nodes of 8)", fontsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"Scale study, {WORKLOADS.get(workload, workload)}: simulated bytes, projected time", y=1.0)
    fig.tight_layout()
    return save(fig, Path(out_dir) / f"scale_study_{workload}")


WORLD_SIZES = (8, 16, 32, 64, 128, 256)


def study_models() -> list:
    """The full model configs the study is for (conf/model: a family, not a proxy) whose routed
    experts some P of :data:`WORLD_SIZES` divides."""
    from occult.config import CONF_DIR, read_conf
    out = []
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        m = read_conf("model", path.stem)
        if m.family and not m.proxy and any(m.num_experts % p == 0 for p in WORLD_SIZES):
            out.append(path.stem)
    return out


def coverage_text(table: pd.DataFrame) -> str:
    """Which of the study's models and strategies these runs hold, and which they do not."""
    have = set(table.model)
    missing = [m for m in study_models() if m not in have]
    points = table.groupby("model").size()
    line = "Points per model: " + ", ".join(f"{m} {n}" for m, n in points.items()) + "."
    if missing:
        line += " Not in these runs (the sweep did not reach them): " + ", ".join(missing) + "."
    from occult.config import CONF_DIR, read_conf
    none = [f"{p.stem} ({read_conf('model', p.stem).num_experts} experts)" for p in sorted((CONF_DIR / "model").glob("*.yaml"))
            if read_conf("model", p.stem).family and not read_conf("model", p.stem).proxy
            and p.stem not in study_models()]
    if none:
        line += " No P of the study divides the routed experts of " + ", ".join(none) + "."
    return line


def build(df: pd.DataFrame, out_dir, profiles=DEFAULT_PROFILES) -> list:
    """Report builder: the points table (``scale_study.csv``), the crossovers
    (``scale_study_crossovers.csv``) and one figure per workload."""
    title = "The field at deployed scale: expert parallelism to 256 GPUs"
    profiles = list(profiles)
    table = study_table(df, profiles)
    if table.empty:
        return [Section(title, ["Not drawn: no task=simulate runs."])]
    out_dir = Path(out_dir)
    write_table(table, out_dir, "scale_study")
    cross = crossovers(table, profiles)
    write_table(cross, out_dir, "scale_study_crossovers")
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
        "the mean; projected ms: the collectives plus the experts (balanced load). Every point's row: "
        "`scale_study.csv`; inline, per model, workload and profile: the best strategy at each P and where "
        "the strategies cross.",
        "Largest P per model: " + ", ".join(f"{m} {p}" for m, p in sized.items()) + ". " + coverage_text(table),
        "Routing: `router` points route held-out text through the trained proxy's routers (resampled with "
        "replacement where the world needs more tokens than the 32,768 routed: `resampled`); `uniform` points "
        "are synthetic."]
    # one row per simulated point (hundreds): its CSV and the figures; the crossovers inline
    return [Section(title, text, [("scale_study_crossovers", cross)], figs,
                    data=[("scale_study", table.drop(columns=["run_id"]))])]
