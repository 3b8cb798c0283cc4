"""The field's exact strategies beside Occult (``python run.py experiment=strategies``).

One table and one figure from the sweep's result tables:

* **bytes** each system moved per iteration (forward pass, every collective, rows to
  other ranks only), at P = 4 here, and at P = 16 split into intra- and inter-node by the
  run's node layout (``devices_per_node``: 2 nodes of 8); inter-node messages per rank and
  layer (the (source, destination) pairs that carried rows across nodes);
* **collectives per MoE layer** (forward), from the ``<kind>_calls`` rows;
* **exposed communication** per MoE layer, measured here: the MoE layer's time minus its
  expert compute (the time no computation hid);
* **time ratios to naive EP**: measured here (P = 4, the task's latency), and projected by
  the cost model (:mod:`analysis.projection`, labelled projected) for the MoE layers of the
  real model on 4 x RTX A6000 (from the P = 4 runs), 8 x H100 (P = 8) and 2 nodes of
  8 x H100 (P = 16).

The figure shows, per model and task, every system's ratio to naive on each machine, the
best one marked: which strategy wins where. A sweep's other rows (the placement study that
made occult_placed's artifact, the pipelining study's layer runs) are read where they say
something: :func:`pipelining` tabulates the layer runs of ``system=pipelined``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from occult.ep.profiles import load_profile

from ..plots import plt, save, style, system_order
from ..projection import pipeline_degree, project_runs, projected_totals, target_model
from ..sections import Section, no_data
from ..summary import RUN_KEYS, a2a_total_ms, baseline_value, ratio_to, task_latency

# where each machine's projection comes from: (column, profile, world size of its runs)
MACHINES = [("4 x A6000", "sim_a6000x4", 4), ("8 x H100", "sim_h100x8", 8), ("2 x 8 H100", "sim_h100x2node", 16)]
MEASURED_WORLD = 4
WHOLE_MODEL_TASKS = ["prefill", "train", "decode"]


# what one row of the table is: a system (with the label an experiment gave one of its
# configs, e.g. hierarchical's dedup modes) on a model and task, joined across world sizes
ROW_KEYS = ["model", "task", "system", "label"]


def node_traffic(run: pd.DataFrame, direction: str = "forward") -> dict:
    """Rows a run sent to other ranks in one pass, split by the run's node layout: MB within
    and across nodes per iteration (all ranks), and messages (pairs with rows) per rank and
    MoE layer across nodes."""
    P = int(run.world_size.iloc[0])
    G = int(run.devices_per_node.iloc[0]) or P
    b = run[(run.metric == "bytes") & (run["pass"] == direction) & (run.src_rank != run.dst_rank)
            & (run.src_rank >= 0)]
    cross = (b.src_rank // G) != (b.dst_rank // G)
    layers = max(b.layer.nunique(), 1)
    return {"intra_MB": b[~cross].value.sum() / 1e6, "inter_MB": b[cross].value.sum() / 1e6,
            "inter_messages": int(((b.value > 0) & cross).sum()) / (P * layers),
            "remote_MB": b.value.sum() / 1e6}


def collectives_per_layer(run: pd.DataFrame, direction: str = "forward") -> float:
    """Collectives one rank runs per MoE layer in one pass (rank 0's ``<kind>_calls`` rows)."""
    c = run[run.metric.str.endswith("_calls") & (run.unit == "calls") & (run["pass"] == direction)
            & (run["rank"] == 0)]
    return c.value.sum() / c.layer.nunique() if not c.empty else float("nan")


def co_executed(run: pd.DataFrame) -> bool:
    """Whether the run's micro-batches were co-executed (its ``microbatches`` column,
    ``task.microbatches``, > 1): its spans then hold the other strands' turns, and only
    ``exposed_comm`` is communication."""
    return int(run.microbatches.iloc[0]) > 1


def exposed_ms(run: pd.DataFrame) -> float:
    """Measured MoE time not spent in expert compute, per MoE layer (forward): per rank and
    sample, the layers' ``dispatch``, ``combine`` and ``exposed_comm`` spans (a system that
    times its layer as one ``moe`` span: that minus its ``experts``; co-executed
    micro-batches: their ``exposed_comm`` only, the waits for collectives that the other
    strands' compute did not hide), the slowest rank per sample, the median over samples,
    divided by the MoE layers."""
    t = run[(run.metric == "time") & (run["pass"] == "forward") & (run["sample"] >= 0) & (run.layer >= 0)]
    if t.empty:
        return float("nan")
    sums = t.groupby(["sample", "rank", "phase"]).value.sum().unstack("phase", fill_value=0.0)
    column = lambda phase: sums[phase] if phase in sums else 0.0
    if co_executed(run):
        exposed = column("exposed_comm")
    elif "moe" in sums:
        exposed = column("moe") - column("experts")
    else:
        exposed = column("dispatch") + column("combine") + column("exposed_comm")
    return float(exposed.groupby("sample").max().median()) / t.layer.nunique()


def run_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per whole-model run (``run_id``): traffic, collectives and exposed communication."""
    out = []
    for run_id, run in df[df.task.isin(WHOLE_MODEL_TASKS)].groupby("run_id", sort=False):
        out.append({**{k: run[k].iloc[0] for k in RUN_KEYS + ["system", "label"]}, "run_id": run_id,
                    **node_traffic(run), "collectives_per_layer": collectives_per_layer(run),
                    "exposed_comm_ms_per_layer": exposed_ms(run)})
    return pd.DataFrame(out)


def vs_plain_naive(table: pd.DataFrame, column: str) -> pd.Series:
    """``column`` over naive EP's in the row with the same run keys, naive's own run being the
    unlabelled one (not a labelled schedule of naive: its micro-batches, its gradient sync)."""
    return table[column] / baseline_value(table.assign(system=table.system.where(table.label == "", "")), column)


def projections(df: pd.DataFrame) -> pd.DataFrame:
    """Projected MoE time per run on each machine, and its ratio to naive: one row per
    (run, machine)."""
    frames = []
    for machine, profile_name, P in MACHINES:
        runs = df[(df.world_size == P) & df.task.isin(WHOLE_MODEL_TASKS)]      # not the pipelining study's layers
        tot = projected_totals(project_runs(runs, load_profile(profile_name), target="real"))
        if tot.empty:
            continue
        tot["label"] = tot.run_id.map(runs.groupby("run_id").label.first())
        tot["ratio"] = vs_plain_naive(tot, "moe_ms")
        tot["machine"] = machine
        frames.append(tot)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _by_row(table: pd.DataFrame, other: pd.DataFrame, column: str) -> pd.Series:
    """Per row of ``table`` (one run at P = MEASURED_WORLD), ``other``'s ``column`` in the
    same :data:`ROW_KEYS`: its own run's where ``other`` holds it (same ``run_id``), else
    the median over the runs of another world size with those keys."""
    if other.empty:
        return pd.Series(np.nan, index=table.index)
    own = table.run_id.map(other.groupby("run_id")[column].first())
    same_keys = other.groupby(ROW_KEYS)[column].median()
    keyed = table.set_index(ROW_KEYS).index.map(lambda k: same_keys.get(k, np.nan)).to_numpy(dtype=float)
    return own.fillna(pd.Series(keyed, index=table.index))


def strategies_table(df: pd.DataFrame) -> pd.DataFrame:
    """The report's table: one row per run at P = MEASURED_WORLD (``run_id``), with the
    runs of the other world sizes that have its :data:`ROW_KEYS` beside it."""
    runs = run_summary(df)
    lat = task_latency(df)
    if runs.empty or lat.empty:
        return pd.DataFrame()
    table = lat[lat.world_size == MEASURED_WORLD].copy()
    table["measured_vs_naive"] = vs_plain_naive(table, "latency_ms")
    table = table[ROW_KEYS + ["latency_ms", "measured_vs_naive", "run_id"]].reset_index(drop=True)
    here, p16 = runs[runs.world_size == MEASURED_WORLD], runs[runs.world_size == 16]
    for column, frame, source in (("remote_MB_P4", here, "remote_MB"),
                                  ("collectives_per_layer", here, "collectives_per_layer"),
                                  ("exposed_comm_ms_per_layer", here, "exposed_comm_ms_per_layer"),
                                  ("intra_MB_P16", p16, "intra_MB"), ("inter_MB_P16", p16, "inter_MB"),
                                  ("inter_messages_P16", p16, "inter_messages")):
        table[column] = _by_row(table, frame, source)
    proj = projections(df)
    for machine, _, _ in MACHINES:
        sel = proj[proj.machine == machine] if not proj.empty else pd.DataFrame()
        table[f"projected_vs_naive {machine}"] = _by_row(table, sel, "ratio")
    return table.sort_values(["model", "task", "measured_vs_naive"])


def winners_figure(table: pd.DataFrame, out_dir: Path) -> list:
    """Per (model, task): every system's (and labelled config's) time ratio to naive on each
    machine (measured here, projected elsewhere), the best of each machine boxed."""
    cols = ["measured_vs_naive"] + [f"projected_vs_naive {m}" for m, _, _ in MACHINES]
    names = [f"here, P = {MEASURED_WORLD}\n(measured)"] + [f"{m}\n(projected)" for m, _, _ in MACHINES]
    style()
    named = table.assign(name=table.system.where(table.label == "", table.label))
    panels = list(named.groupby(["model", "task"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 0.34 * named.name.nunique() + 2.2),
                             squeeze=False, gridspec_kw={"wspace": 0.6})     # room for each panel's row names
    for ax, ((model, task), t) in zip(axes[0], panels):
        t = t.iloc[np.argsort([system_order(t.system).index(s) for s in t.system], kind="stable")].set_index("name")
        values = t[cols].to_numpy(dtype=float)
        im = ax.imshow(np.log2(values), cmap="RdYlGn_r", vmin=-1.5, vmax=1.5, aspect="auto")
        for i in range(values.shape[0]):
            for j in range(values.shape[1]):
                if np.isfinite(values[i, j]):
                    ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=7)
        for j in range(values.shape[1]):
            column = values[:, j]
            if np.isfinite(column).any():
                i = int(np.nanargmin(column))
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec="black"))
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_yticks(range(len(t)), t.index, fontsize=8)
        ax.set_title(f"{model}, {task}", fontsize=9)
        ax.grid(False)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="time / naive EP (log2 colour; boxed: best)")
    fig.suptitle("Which strategy wins where: MoE time relative to naive EP", y=1.02)
    return save(fig, Path(out_dir) / "strategies_winners")


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """The strategies report: the table, the winners figure, the pipelining study."""
    title = "The field's exact strategies beside Occult"
    table = strategies_table(df)
    if table.empty:
        return no_data(title, f"whole-model runs at P = {MEASURED_WORLD}")
    figs = winners_figure(table, out_dir)
    text = [f"One row per model, task and system. Measured here (P = {MEASURED_WORLD} ranks on this "
            "machine's cores): the task's latency (prefill: time to first token; train: step time; slowest "
            "rank, median over samples) over naive EP's in the same sweep; remote MB: rows every rank sent "
            "to the others in the forward pass of one iteration, every collective (tokens, weights, "
            "metadata, counts); collectives per layer: what one rank runs per MoE layer forward; exposed "
            "communication: the MoE layer's time minus its expert compute, per layer. At P = 16 (2 nodes "
            "of 8: cluster.devices_per_node=8; bytes only, one iteration) the same forward bytes split into "
            "intra- and inter-node, and the messages per rank and layer that crossed nodes. Projected "
            "(cost model, labelled projected): the MoE layers of the real model (hidden rows and expert "
            "weights re-sized to its D and F in bfloat16), from the runs at each machine's world size; "
            "attention and dense layers are the same for every system and not included, so whole-model "
            "ratios lie between 1 and these. Rule-driven systems (shadow, pipelined) decide with the "
            "profile of the machine they are projected onto (system.profile in the experiment)."]
    missing = [m for m, _, _ in MACHINES if table[f"projected_vs_naive {m}"].isna().all()]
    if missing:
        text.append("Not projected (no runs at that world size in this sweep): " + ", ".join(missing) + ".")
    sections = [Section(title, text, [("strategies", table)], figs)]
    return sections + schedules(df) + two_nodes(df) + pipelining(df, out_dir)


def _slowest_median(run: pd.DataFrame, metric: str, phase=None, direction=None) -> float:
    """A metric's timed values summed per rank and sample (one phase and pass, when given),
    the slowest rank per sample, the median over samples (NaN without any)."""
    t = run[(run.metric == metric) & (run["sample"] >= 0) & (run["rank"] >= 0)]
    if phase is not None:
        t = t[t.phase == phase]
    if direction is not None:
        t = t[t["pass"] == direction]
    if t.empty:
        return float("nan")
    return float(t.groupby(["sample", "rank"]).value.sum().groupby("sample").max().median())


def schedules(df: pd.DataFrame) -> list[Section]:
    """Micro-batch co-execution and the gradient sync's schedules (docs/schedules.md): every
    whole-model run at P = MEASURED_WORLD of a system that also ran a schedule, its latency
    over the same system's plain run, its forward collectives' time and the part of it left
    exposed, and (train) the backward's all-to-all time and the gradient all-reduce left after
    the backward."""
    runs = df[(df.world_size == MEASURED_WORLD) & df.task.isin(WHOLE_MODEL_TASKS)]
    lat = task_latency(runs)
    if lat.empty:
        return []
    rows = []
    for run_id, run in runs.groupby("run_id", sort=False):
        layers = max(run[(run.metric == "a2a_time") & (run.layer >= 0)].layer.nunique(), 1)
        fwd = a2a_total_ms(run).get(run_id, float("nan")) / layers
        rows.append({"run_id": run_id, "microbatches": int(run.microbatches.iloc[0]), "grad_sync": run.grad_sync.iloc[0],
                     "collectives_ms_per_layer": fwd,
                     # without co-execution the rank waits for every collective: all of it is exposed
                     "exposed_comm_ms_per_layer": exposed_ms(run) if co_executed(run) else fwd,
                     "backward_a2a_ms": a2a_total_ms(run, ("backward",)).get(run_id, float("nan")),
                     "grad_sync_exposed_ms": _slowest_median(run, "time", "grad_sync", "backward"),
                     "allreduces_in_backward": _slowest_median(run, "grad_sync_started_in_backward"),
                     "allreduces": _slowest_median(run, "grad_sync_allreduces")})
    table = lat.merge(pd.DataFrame(rows), on="run_id")
    scheduled = (table.microbatches > 1) | ~table.grad_sync.isin(["", "end"])
    if not scheduled.any():
        return []
    keys = ["model", "task", "system"]
    table = table[table.set_index(keys).index.isin(table[scheduled].set_index(keys).index)]
    plain = table[~scheduled.loc[table.index] & (table.label == "")].groupby(keys).latency_ms.median()
    table = table.assign(vs_plain=table.latency_ms / table.set_index(keys).index.map(
        lambda k: plain.get(k, np.nan)).to_numpy(dtype=float))
    cols = ["model", "task", "system", "label", "microbatches", "grad_sync", "latency_ms", "vs_plain",
            "collectives_ms_per_layer", "exposed_comm_ms_per_layer", "backward_a2a_ms", "grad_sync_exposed_ms",
            "allreduces", "allreduces_in_backward"]
    text = [f"P = {MEASURED_WORLD} here. Micro-batch co-execution (task.microbatches, DHelix's strands, the two-batch "
            "overlap of DeepSeek-V3's and SGLang's inference) and the gradient sync's schedule (task.grad_sync: "
            "end, overlap as DDP's buckets, Lina's partitions between the all-to-alls) beside the same system's "
            "plain run (vs_plain: latency over it; prefill: time to first token, train: step time). "
            "collectives_ms_per_layer: the forward's collectives per MoE layer (start to end of wait, slowest "
            "rank, median; a co-executed one's run from start to the end of its wait, the other micro-batch's turn "
            "included); exposed_comm_ms_per_layer: what no computation hid (a plain run waits for all of its "
            "collectives' time, which is what this column holds for it; the table above counts a plain run's "
            "dispatch and combine spans, local permutations included; a co-executed run waits for what the "
            "other micro-batch's turn did not cover). The cost model's projections above price a co-executed "
            "run's collectives one after the other (it models no co-execution). Train: the "
            "backward's all-to-all time per step (competing with the gradient all-reduce under overlap and "
            "lina), the all-reduce left after the backward, and its calls (and how many started during the "
            "backward). On this machine's 2 shared cores the strands and gloo's transfers share the same cores: "
            "these numbers measure the schedule, not a GPU's overlap (docs/schedules.md)."]
    return [Section("Schedules: micro-batch co-execution and the gradient sync", text,
                    [("schedules", table[cols].sort_values(["model", "task", "system", "microbatches", "grad_sync"]))],
                    [])]


def two_nodes(df: pd.DataFrame) -> list[Section]:
    """Every system (and labelled config) at P = 16 as 2 nodes of 8: bytes within and across nodes, messages across
    nodes, collectives, and the projected MoE time on 2 x 8 H100 over naive's."""
    runs = run_summary(df)
    runs = runs[(runs.world_size == 16) & (runs.devices_per_node == 8)]
    if runs.empty:
        return []
    proj = projections(df[df.run_id.isin(runs.run_id)])
    table = runs[ROW_KEYS + ["intra_MB", "inter_MB", "inter_messages", "collectives_per_layer", "run_id"]].copy()
    table["inter_MB_vs_naive"] = ratio_to(runs, "inter_MB", keys=["model", "task"])
    if not proj.empty:
        table["projected_vs_naive 2 x 8 H100"] = table.run_id.map(proj.groupby("run_id").ratio.first())
    text = ["P = 16 ranks as 2 nodes of 8 (cluster.devices_per_node=8), one iteration, forward pass: MB per "
            "iteration (all ranks) to ranks of the same node and of the other node, the (source, destination) "
            "pairs per rank and MoE layer that carried rows across nodes, collectives per layer, and the "
            "projected MoE time on 2 x 8 H100 over naive EP's. Hierarchical's labels are its dedup modes."]
    return [Section("Two nodes of eight: intra- and inter-node traffic", text,
                    [("two_nodes", table.sort_values(["model", "task", "inter_MB"]))], [])]


def pipelining(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """The pipelining study: task=layer runs of system=pipelined (and naive beside them) at
    several degrees: layer time, expert time and exposed communication measured here, and the
    same runs projected on the machines of matching world size."""
    layer = df[(df.task == "layer") & df.system.isin(["pipelined", "naive"])]
    if layer.empty or not (layer.system == "pipelined").any():
        return []
    rows = []
    for run_id, run in layer.groupby("run_id", sort=False):
        t = run[(run.metric == "time") & (run["sample"] >= 0) & (run["pass"] == "forward")]
        slow = lambda phase: t[t.phase == phase].groupby(["sample", "rank"]).value.sum().groupby("sample").max().median()
        degree = int(pipeline_degree(run, 0))
        rows.append({"system": run.system.iloc[0], "label": run.label.iloc[0],
                     "world_size": int(run.world_size.iloc[0]), "degree": degree, "layer_fwd_ms": slow("layer"),
                     "experts_ms": slow("experts"), "exposed_comm_ms": exposed_ms(run), "run_id": run_id})
    table = pd.DataFrame(rows)
    for machine, profile_name, P in MACHINES:
        runs = layer[layer.world_size == P]
        tot = projected_totals(project_runs(runs, load_profile(profile_name), target_model("olmoe_layer")))
        if not tot.empty:
            table[f"projected ms {machine}"] = table.run_id.map(tot.groupby("run_id").moe_ms.first())
    text = ["task=layer at the comm-heavy shape of conf/experiment/strategies.yaml (grid `pipe`), forward "
            "only: the layer's time, its expert compute and the rest (exposed communication), measured "
            "here, slowest rank, median over samples; projected: the same runs' bytes and FLOPs at "
            "olmoe_layer's width with the pipeline model (chunks overlap; the cost model's `overlap` "
            "component). Here the 2 cores run the ranks' experts and gloo's transfers alike, so chunks "
            "add collectives and latency and can hide little."]
    return [Section("Pipelining: degree against exposed communication", text,
                    [("pipelining", table.drop(columns=["run_id"]).sort_values(["system", "degree"]))], [])]
