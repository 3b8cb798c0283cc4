"""Occult beyond exact: the expert-placement study and the pruning-accuracy table.

**Placement study** (``python run.py experiment=placement_study``; task
``placement_study``, entry :func:`placement_study_rank`). On the trained proxy and P =
``cluster.world_size`` ranks, the expert-parallel model (``system=occult``, contiguous
placement) runs over

* a profiling set: ``task.tokens_per_rank`` tokens per rank of seeded random windows of
  ``task.corpus`` / ``task.split`` (shakespeare train), and
* held-out tokens: the whole validation split of ``task.corpus``, split evenly over ranks,

and the recorder keeps every token's top-k ids per MoE layer (and its home rank). Every
optimiser of :data:`OPTIMISERS` then runs at every load cap of :data:`LOAD_CAPS` on every
layer's profiling ids (the jobs are shared out over the ranks); each placement is judged on
the held-out ids. Written into the run folder:

* ``placement.csv``: one row per (optimiser, load cap, layer) with the held-out
  ``ct_all, ct_remote, intra_ratio, load_max_over_mean, busiest_rows_vs_contiguous``
  (the busiest device's (token, expert) rows, i.e. the max device load, over the same
  figure under the contiguous placement), ``solve_s``, then
  ``busiest_sfd_rows_vs_contiguous`` (the busiest device's received Occult rows, one per
  (token, device)) and the profiling figures ``ct_all_profiling``,
  ``load_max_over_mean_profiling``;
* ``placement.md``: the same, averaged over layers;
* ``placement_front.png/pdf``: held-out C_T against load balance, one point per
  (optimiser, cap), the trade-off front;
* ``placements_cap-<cap>.json``: for each cap the best placement per layer (lowest
  profiling C_T among the optimisers that meet the cap on the profiling set), an artifact
  for ``system=occult_placed system.placement_file=...``.

**Pruning accuracy** (``python run.py experiment=fig7_pruning``): a sweep of
``task=finetune`` over arms (``conf/arm``): no fine-tuning, standard fine-tuning, and
score / similarity pruning at N_d' = 1, 2, 4 (``experiment=pruning_no_finetune`` adds
pruning at N_d' = 1, 2 without fine-tuning, into the same folder). At the end of a sweep the
:class:`AccuracyTable` callback writes ``accuracy.csv`` and ``accuracy.md`` into the sweep
folder (:func:`accuracy_table`; ``python -m analysis.studies accuracy <sweep folder>``
rebuilds them) and the report builder :func:`fig7_pruning` draws the figure into
``report.md``.

Shapes: T tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
import torch.distributed as dist
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

OPTIMISERS = ("contiguous", "random", "greedy", "swap_search")
LOAD_CAPS = (None, 1.25, 1.15, 1.1)
SWAP_TIME_LIMIT_S = 10.0          # swap_search's time limit per (layer, cap)
TRACE_WINDOWS_PER_BATCH = 8


def cap_label(cap: Optional[float]) -> str:
    """``none`` or the cap as written (``1.25``)."""
    return "none" if cap is None else f"{cap:g}"


# ---------------------------------------------------------------------------
# placement study: routing traces
# ---------------------------------------------------------------------------


def _windows_forward(ctx, model, windows: list) -> dict:
    """Runs the rank model over ``windows`` (list of (x_BS, y_BS)); returns {layer: ids [T, K]}."""
    from occult.ep import Recorder
    from occult.ep.accounting import recording

    rec = Recorder(rank=ctx.rank)
    with torch.no_grad(), recording(rec):
        for x_BS, _ in windows:
            model(input_ids=x_BS)
    per_layer: dict = {}
    for layer, ids_TK, *_ in rec.routing:
        per_layer.setdefault(layer, []).append(ids_TK)
    return {layer: torch.cat(parts) for layer, parts in per_layer.items()}


def _gather_ids(ctx, local: dict) -> tuple[dict, torch.Tensor]:
    """Every rank's {layer: ids [T_r, K]} concatenated in rank order, and each token's home
    rank [T] (the same on every rank)."""
    gathered = [local]
    if ctx.world_size > 1:
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, local, group=ctx.ep.group)
    layers = sorted(gathered[0])
    ids = {layer: torch.cat([g[layer] for g in gathered]) for layer in layers}
    home = torch.cat([torch.full((g[layers[0]].shape[0],), r, dtype=torch.long) for r, g in enumerate(gathered)])
    return ids, home


def collect_traces(ctx, cfg) -> tuple[dict, dict, torch.Tensor]:
    """Profiling and held-out routing of the rank model: ``(profile_ids, held_ids,
    held_home)``, {layer: [T, K]} over all ranks, and the held-out tokens' home ranks."""
    from occult.data.batches import batch_iterator, eval_batches, token_ids
    from occult.tasks.finetune import rank_eval_ids
    from occult.tasks.model import setup

    t = cfg.task
    model, tok, _ = setup(ctx, cfg)
    train_ids = token_ids(t.corpus, t.split, tok)
    windows = max(1, t.tokens_per_rank // t.seq_len)
    per_batch = min(TRACE_WINDOWS_PER_BATCH, windows)
    prof = list(batch_iterator(train_ids, per_batch, t.seq_len, seed=cfg.seed * 1000 + ctx.rank + 1,
                               num_batches=-(-windows // per_batch)))
    held_N = rank_eval_ids(ctx, token_ids(t.corpus, "validation", tok), t.seq_len, 0)
    held = list(eval_batches(held_N, TRACE_WINDOWS_PER_BATCH, t.seq_len))
    if ctx.rank == 0:
        print(f"placement study: tracing {windows * t.seq_len} profiling and {held_N.numel() - 1} held-out "
              f"tokens per rank", flush=True)
    profile_ids, _ = _gather_ids(ctx, _windows_forward(ctx, model, prof))
    held_ids, held_home = _gather_ids(ctx, _windows_forward(ctx, model, held))
    return profile_ids, held_ids, held_home


# ---------------------------------------------------------------------------
# placement study: optimisation and figures
# ---------------------------------------------------------------------------


def sfd_rows_per_device(topk_ids_TK: torch.Tensor, placement) -> torch.Tensor:
    """Occult rows each device receives: tokens with at least one expert there, [P]."""
    T = topk_ids_TK.shape[0]
    hit_TP = torch.zeros(T, placement.num_devices, dtype=torch.bool)
    hit_TP[torch.arange(T).unsqueeze(1), placement.device_E[topk_ids_TK]] = True
    return hit_TP.sum(0)


def judge(placement, profile_ids: torch.Tensor, held_ids: torch.Tensor, held_home: torch.Tensor) -> dict:
    """Held-out C_T (all, remote), intra ratio, load balance and busiest device rows; the
    profiling C_T and load balance."""
    from occult.ep import ct_all, ct_remote, intra_ratio
    from occult.placement import device_load, load_max_over_mean

    return {"ct_all": ct_all(held_ids, placement), "ct_remote": ct_remote(held_ids, placement, held_home),
            "intra_ratio": intra_ratio(held_ids, placement),
            "load_max_over_mean": load_max_over_mean(held_ids, placement),
            "busiest_rows": int(device_load(held_ids, placement).max()),
            "busiest_sfd_rows": int(sfd_rows_per_device(held_ids, placement).max()),
            "ct_all_profiling": ct_all(profile_ids, placement),
            "load_max_over_mean_profiling": load_max_over_mean(profile_ids, placement)}


def study_jobs(layers: list) -> list:
    """(optimiser, cap, layer) of every job; optimiser outermost, so that handing job i to
    rank i % P spreads each optimiser's (slow swap_search) jobs evenly."""
    return [(name, cap, layer) for name in OPTIMISERS for cap in LOAD_CAPS for layer in layers]


def run_jobs(ctx, jobs: list, profile_ids: dict, held_ids: dict, held_home: torch.Tensor, num_experts: int,
             seed: int) -> list:
    """This rank's share of the jobs (job i on rank i % P); returns result dicts."""
    from occult.placement import optimise

    out = []
    mine = [job for i, job in enumerate(jobs) if i % ctx.world_size == ctx.rank]
    for j, (name, cap, layer) in enumerate(mine):
        t0 = time.perf_counter()
        pl = optimise(name, profile_ids[layer], num_experts, ctx.world_size, load_cap=cap, seed=seed,
                      time_limit_s=SWAP_TIME_LIMIT_S)
        solve_s = time.perf_counter() - t0
        res = {"optimiser": name, "load_cap": cap_label(cap), "layer": layer, "solve_s": solve_s,
               "groups": pl.groups(), **judge(pl, profile_ids[layer], held_ids[layer], held_home)}
        out.append(res)
        if ctx.rank == 0:
            print(f"  [{j + 1}/{len(mine)} on rank 0] {name} cap={cap_label(cap)} layer {layer}: "
                  f"held-out C_T {res['ct_all']:.3f}, load {res['load_max_over_mean']:.3f}, "
                  f"{solve_s:.1f} s", flush=True)
    return out


def placement_frame(results: list) -> pd.DataFrame:
    """The ``placement.csv`` table from the job results (busiest rows relative to the
    contiguous placement of the same layer)."""
    df = pd.DataFrame([{k: v for k, v in r.items() if k != "groups"} for r in results])
    base = df[(df.optimiser == "contiguous") & (df.load_cap == "none")].set_index("layer")
    df["busiest_rows_vs_contiguous"] = df.busiest_rows / df.layer.map(base.busiest_rows)
    df["busiest_sfd_rows_vs_contiguous"] = df.busiest_sfd_rows / df.layer.map(base.busiest_sfd_rows)
    order = {name: i for i, name in enumerate(OPTIMISERS)}
    caps = {cap_label(c): i for i, c in enumerate(LOAD_CAPS)}
    df = df.sort_values(["optimiser", "load_cap", "layer"], key=lambda s: s.map(order) if s.name == "optimiser"
                        else s.map(caps) if s.name == "load_cap" else s).reset_index(drop=True)
    cols = ["optimiser", "load_cap", "layer", "ct_all", "ct_remote", "intra_ratio", "load_max_over_mean",
            "busiest_rows_vs_contiguous", "solve_s", "busiest_sfd_rows_vs_contiguous", "ct_all_profiling",
            "load_max_over_mean_profiling"]
    return df[cols]


def best_per_cap(results: list) -> dict:
    """{cap label: {layer: result}}: per layer, the lowest profiling C_T among placements
    within the cap on the profiling set (the most balanced one if none is)."""
    best: dict = {}
    for cap in LOAD_CAPS:
        label = cap_label(cap)
        for r in (r for r in results if r["load_cap"] == label):
            ok = cap is None or r["load_max_over_mean_profiling"] <= cap + 1e-9
            key = (not ok, r["ct_all_profiling"] if ok else r["load_max_over_mean_profiling"],
                   r["load_max_over_mean_profiling"])
            cur = best.setdefault(label, {}).get(r["layer"])
            if cur is None or key < cur[0]:
                best[label][r["layer"]] = (key, r)
    return {label: {layer: kr[1] for layer, kr in per.items()} for label, per in best.items()}


def save_artifacts(results: list, out_dir: Path, meta: dict) -> list:
    """One placement artifact per cap (best placement per layer); returns the paths."""
    from occult.ep import Placement
    from occult.placement import save_placements

    paths = []
    for label, per_layer in best_per_cap(results).items():
        path = out_dir / f"placements_cap-{label}.json"
        save_placements(path, {layer: Placement.from_groups(r["groups"]) for layer, r in per_layer.items()},
                        {**meta, "load_cap": None if label == "none" else float(label),
                         "layers": {str(layer): {"optimiser": r["optimiser"], "ct_all_heldout": r["ct_all"],
                                                 "ct_all_profiling": r["ct_all_profiling"],
                                                 "load_max_over_mean_heldout": r["load_max_over_mean"]}
                                    for layer, r in sorted(per_layer.items())}})
        paths.append(path)
    return paths


def plot_front(df: pd.DataFrame, out_dir: Path) -> list:
    """Held-out C_T (mean over layers) against load balance, per (optimiser, cap)."""
    from analysis.plots import plt, save

    mean = df.groupby(["optimiser", "load_cap"], sort=False)[["ct_all", "load_max_over_mean"]].mean().reset_index()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    markers = {"none": "o", "1.25": "s", "1.15": "^", "1.1": "D"}
    for i, name in enumerate(OPTIMISERS):
        sel = mean[mean.optimiser == name]
        # caps that gave the same placement quality share one point and one label
        points = sel.groupby([sel.load_max_over_mean.round(6), sel.ct_all.round(6)], sort=False).load_cap.apply(list)
        for j, ((x, y), caps) in enumerate(points.items()):
            ax.scatter(x, y, color=f"C{i}", marker=markers.get(caps[0], "o"), s=40, label=name if j == 0 else None)
            text = "any cap" if len(caps) == len(LOAD_CAPS) else "/".join(caps)
            ax.annotate(text, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("held-out device load, max / mean")
    ax.set_ylabel("held-out C_T (devices/token, mean over layers)")
    ax.set_title("Expert placement: C_T vs load balance (labels: load cap)")
    ax.legend(fontsize=7)
    return save(fig, out_dir / "placement_front")


def placement_markdown(df: pd.DataFrame) -> str:
    """The study averaged over layers, as a Markdown table."""
    mean = df.groupby(["optimiser", "load_cap"], sort=False).mean(numeric_only=True).drop(columns="layer")
    return mean.reset_index().to_markdown(index=False, floatfmt=".4g")


def study_rows(df: pd.DataFrame) -> list:
    """Result rows of the study: one per figure, ``phase`` = ``<optimiser>@<cap>``."""
    from occult.records import row

    units = {"ct_all": "devices/token", "ct_remote": "devices/token", "intra_ratio": "ratio",
             "load_max_over_mean": "ratio", "busiest_rows_vs_contiguous": "ratio",
             "busiest_sfd_rows_vs_contiguous": "ratio", "solve_s": "s", "ct_all_profiling": "devices/token",
             "load_max_over_mean_profiling": "ratio"}
    return [row(metric, getattr(r, metric), unit, layer=int(r.layer), phase=f"{r.optimiser}@{r.load_cap}")
            for r in df.itertuples() for metric, unit in units.items()]


def placement_study_rank(ctx, cfg_dict: dict) -> list:
    """task=placement_study on one rank (see the module docstring); rank 0 writes the outputs."""
    cfg = OmegaConf.create(cfg_dict)
    E = cfg.model.num_experts
    t0 = time.perf_counter()
    profile_ids, held_ids, held_home = collect_traces(ctx, cfg)
    jobs = study_jobs(sorted(profile_ids))
    if ctx.rank == 0:
        print(f"placement study: {len(jobs)} jobs ({len(OPTIMISERS)} optimisers x {len(LOAD_CAPS)} caps x "
              f"{len(profile_ids)} layers) on {ctx.world_size} rank(s)", flush=True)
    mine = run_jobs(ctx, jobs, profile_ids, held_ids, held_home, E, cfg.seed)
    gathered = [mine]
    if ctx.world_size > 1:
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.ep.group)
    if ctx.rank != 0:
        return []
    results = [r for part in gathered for r in part]
    out_dir = Path(cfg_dict.get("out_dir_resolved") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    df = placement_frame(results)
    df.to_csv(out_dir / "placement.csv", index=False)
    (out_dir / "placement.md").write_text(placement_markdown(df) + "\n")
    plot_front(df, out_dir)
    meta = {"model": cfg.model.name, "checkpoint": cfg_dict.get("checkpoint"), "num_experts": E,
            "world_size": ctx.world_size, "top_k": cfg.model.top_k, "profiling": f"{cfg.task.corpus}/{cfg.task.split}",
            "profiling_tokens": int(next(iter(profile_ids.values())).shape[0]),
            "heldout_tokens": int(held_home.numel()), "seed": cfg.seed}
    paths = save_artifacts(results, out_dir, meta)
    print(placement_markdown(df), flush=True)
    print(f"placement study: {out_dir / 'placement.csv'}, artifacts {[p.name for p in paths]} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return study_rows(df)


# ---------------------------------------------------------------------------
# pruning accuracy table
# ---------------------------------------------------------------------------

ARM_ORDER = ("no_finetune", "standard", "score_1", "score_2", "score_4", "similarity_1", "similarity_2",
             "similarity_4", "score_1_no_finetune", "score_2_no_finetune", "similarity_1_no_finetune",
             "similarity_2_no_finetune")


def arm_of(system: str, budget: Optional[int], steps: int) -> str:
    """The arm of one finetune run: ``no_finetune``, ``standard``, ``score_<budget>`` or
    ``similarity_<budget>`` (with ``_no_finetune`` when a pruned run has no steps)."""
    kinds = {"occult_prune_score": "score", "occult_prune_sim": "similarity"}
    if system not in kinds:
        return "standard" if steps else "no_finetune"
    return f"{kinds[system]}_{budget}" + ("" if steps else "_no_finetune")


def _budget(run_dir: Path) -> Optional[int]:
    """system.budget of a run folder, from its composed Hydra config (None without one)."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    return OmegaConf.load(path).system.get("budget")


def accuracy_table(sweep_dir) -> pd.DataFrame:
    """:func:`accuracy_frame` of a sweep folder's runs."""
    from analysis.load import load_runs

    return accuracy_frame(load_runs([sweep_dir]))


def accuracy_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finetune run of ``df``: arm, held-out loss / perplexity / accuracy on
    each domain, mean C_T (over MoE layers) on each domain and over both."""
    df = df[df.task == "finetune"]
    out = []
    for run_dir, run in df.groupby("run_dir"):
        system, budget, steps = run.system.iloc[0], _budget(Path(run_dir)), int((run.metric == "train_loss").sum())
        rec = {"arm": arm_of(system, budget, steps), "system": system, "budget": budget, "steps": steps}
        corpora = sorted(run[run.metric == "eval_loss"].phase.unique())
        for corpus in corpora:
            for metric in ("eval_loss", "eval_perplexity", "eval_accuracy"):
                rec[f"{corpus}_{metric[5:]}"] = run[(run.metric == metric) & (run.phase == corpus)].value.item()
            rec[f"{corpus}_ct_all"] = run[(run.metric == "ct_all") & (run.phase == corpus)].value.mean()
        rec["ct_all"] = run[run.metric == "ct_all"].value.mean()
        out.append(rec)
    table = pd.DataFrame(out)
    table["budget"] = table.budget.astype("Int64")
    order = {a: i for i, a in enumerate(ARM_ORDER)}
    return table.sort_values("arm", key=lambda s: s.map(lambda a: order.get(a, len(order)))).reset_index(drop=True)


def write_accuracy_table(sweep_dir) -> Path:
    """Writes ``accuracy.csv`` and ``accuracy.md`` into ``sweep_dir``; returns the CSV path."""
    sweep_dir = Path(sweep_dir)
    table = accuracy_table(sweep_dir)
    table.to_csv(sweep_dir / "accuracy.csv", index=False)
    lines = ["# Collaboration pruning: held-out accuracy after fine-tuning", "",
             "Loss in nats/token; accuracy = next-token accuracy; C_T = devices per token (mean over "
             "MoE layers) during evaluation. Arms: no fine-tuning (task.steps=0), standard fine-tuning "
             "(system=occult), score / similarity pruning at N_d' = budget, all with the same step "
             "budget and frozen set.", "", table.to_markdown(index=False, floatfmt=".4g"), ""]
    (sweep_dir / "accuracy.md").write_text("\n".join(lines))
    return sweep_dir / "accuracy.csv"


FIG7_METHODS = {"score": "routing-score pruning", "similarity": "similarity pruning"}


def fig7_pruning(df: pd.DataFrame, out_dir) -> list:
    """Report builder (``report: analysis.studies.fig7_pruning``), Occult Fig. 7 in shape:
    held-out loss and accuracy on the fine-tuned domain, and the C_T measured while
    evaluating, against the device budget N_d', for score and similarity pruning, with
    standard and no fine-tuning as reference lines."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from .figures import Section
    from .plots import save, style

    title = "Fig. 7: collaboration pruning, accuracy and C_T vs device budget"
    table = accuracy_frame(df)
    if table.empty:
        return [Section(title, ["Not drawn: no task=finetune runs."])]
    domain = next((c[:-len("_loss")] for c in table.columns if c.endswith("_loss") and c != "shakespeare_loss"),
                  "shakespeare")
    tuned = table[table.steps > 0]
    pruned = tuned[tuned.budget.notna()].assign(
        method=lambda t: t.arm.str.split("_").str[0].map(FIG7_METHODS), budget=lambda t: t.budget.astype(int))
    lines = {"standard fine-tuning": tuned[tuned.arm == "standard"], "no fine-tuning": table[table.arm == "no_finetune"]}
    style()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, col, label in zip(axes, (f"{domain}_loss", f"{domain}_accuracy", "ct_all"),
                              (f"held-out loss on {domain} (nats/token)", f"next-token accuracy on {domain}",
                               "C_T while evaluating (devices/token)")):
        if not pruned.empty:
            sns.lineplot(data=pruned, x="budget", y=col, hue="method", style="method", markers=True, dashes=False,
                         ax=ax, hue_order=list(FIG7_METHODS.values()))
        for (name, ref), ls in zip(lines.items(), ("--", ":")):
            if ref.empty:
                continue
            if name == "no fine-tuning" and col != "ct_all":   # far off the pruning scale: named, not drawn
                ax.plot([], [], " ", label=f"{name}: {ref[col].mean():.3f} (off the axis)")
            else:
                ax.axhline(ref[col].mean(), color="k", ls=ls, lw=1, label=name)
        ax.set_xlabel("device budget N_d' (devices per token)")
        ax.set_ylabel(label)
        ax.set_xticks(sorted(pruned.budget.unique()) if not pruned.empty else [])
        ax.legend(fontsize=7)
    fig.tight_layout()
    figs = save(fig, Path(out_dir) / "fig7_pruning")
    text = [f"One fine-tuning run per arm (same steps, frozen set and batches) on the {domain} domain; loss and "
            "accuracy on its held-out split; C_T measured during that evaluation. Occult reports that pruning "
            "to 2 devices keeps standard fine-tuning's accuracy and that similarity pruning beats score "
            "pruning (SPEC.md); compare the lines here, which are one seed of a CPU proxy."]
    return [Section(title, text, [("fig7_pruning", table)], figs)]


class AccuracyTable(Callback):
    """Hydra callback closing the fig7_pruning sweep: writes accuracy.csv / .md."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if any(sweep_dir.rglob("results.parquet")):
            path = write_accuracy_table(sweep_dir)
            print(f"accuracy table: {path}\n{(sweep_dir / 'accuracy.md').read_text()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="Rebuild a study's table from its run folders.")
    ap.add_argument("study", choices=["accuracy"], help="which table")
    ap.add_argument("sweep_dir", help="the sweep folder (e.g. runs/fig7_pruning)")
    args = ap.parse_args()
    print(write_accuracy_table(args.sweep_dir))


if __name__ == "__main__":
    main()
