"""ExFlow's transition study on the trained proxies' routing traces.

For each prefill run with a routing trace (``task.save_routing=true``), the
trace's sequences are split into a *profile* half and a *held-out* half (by
sequence, on every rank). On the profile half: hop counts between consecutive
MoE layers (:func:`baselines.exflow_placement.transition_counts`) and an
affinity placement per device count P (recursive bisection, HiGHS, under a
time limit). Reported for both halves: the share of hops that cross devices
with the contiguous placement and with the affinity placement; the solver's
wall time, how many of its programs it proved optimal, and how much of the
gain the solver found beyond its start. Also the affinity itself: how often a
source expert's most likely successor is in the token's top-k at the next
layer (``affinity_top1``; routing independent of the previous layer would
give about K/E, ``independent_top1``).

What is computed, not measured: the hops are a function of the routing and
the placement; this harness does not run tokens from layer to layer on the
device of their last expert (see :mod:`baselines.exflow`).

Outputs (in the report folder): ``exflow_affinity.csv``, ``exflow_affinity.png``
/ ``.pdf``, a section of ``report.md`` (report builder :func:`exflow_affinity`,
with the defaults below), and one placement artifact per (model, P),
``exflow_placements_<model>_p<P>.json``, which ``system.placement_file`` reads.

    python run.py experiment=exflow_affinity                    # the three proxies
    python run.py experiment=exflow_affinity hydra.sweeper.params.model=olmoe_proxy
    python -m analysis.figures.exflow_affinity runs/exflow_affinity --world-sizes 4 8 --time-limit 60
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from baselines.exflow_placement import (SOURCES, conditional_probability, contiguous_placements,
                                        cross_device_fraction, place_by_affinity, routing_from_trace,
                                        save_exflow_placements, transition_counts)
from occult.routing_traces import load_trace

from ..plots import save, style
from ..sections import Section
from ..traces import traced_runs

CSV_NAME = "exflow_affinity.csv"


def split_by_sequence(df: pd.DataFrame, batch_size: int, seq_len: int, heldout_share: float
                      ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(profile, held-out) rows of a trace: on every rank, the last ``heldout_share`` of
    its ``batch_size`` sequences (at least one, at most all but one) are held out."""
    if batch_size < 2:
        raise ValueError(f"task.batch_size={batch_size}: the study needs at least 2 sequences per rank "
                         "(a profile half and a held-out half)")
    if not 0.0 < heldout_share < 1.0:
        raise ValueError(f"heldout_share={heldout_share}: must be in (0, 1)")
    held = min(max(round(batch_size * heldout_share), 1), batch_size - 1)
    heldout = (df.token // seq_len) >= batch_size - held
    return df[~heldout], df[heldout]


def affinity_top1(transitions: dict, top_k: int) -> float:
    """How predictable layer l+1 is from layer l: the probability that a source expert's
    most likely successor is in the token's top-k at l+1, averaged over source tokens and
    layer pairs. Routing independent of the previous layer gives about K/E (a little more
    on a finite sample); 1 means the successor is certain."""
    top = sources = 0.0
    for counts_EE in transitions.values():
        sources_E = counts_EE.sum(1) / top_k
        top += float((conditional_probability(counts_EE, top_k).max(dim=1).values * sources_E).sum())
        sources += float(sources_E.sum())
    return top / sources if sources else float("nan")


def study_run(run_dir, ctx: dict, out_dir, world_sizes, time_limit_s: float, source: str = "primary",
              heldout_share: float = 0.5) -> list[dict]:
    """The study of one run folder's trace (``ctx``: the run's model, num_experts, top_k,
    batch_size and seq_len); writes its placement artifacts into ``out_dir``."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    E, K = int(ctx["num_experts"]), int(ctx["top_k"])
    df, _ = load_trace(run_dir)
    halves = dict(zip(("profile", "heldout"),
                      split_by_sequence(df, int(ctx["batch_size"]), int(ctx["seq_len"]), heldout_share)))
    routing = {name: routing_from_trace(part) for name, part in halves.items()}
    layers = sorted(routing["profile"])
    transitions = {name: transition_counts(r, E, source) for name, r in routing.items()}
    rows = []
    for P in world_sizes:
        if E % P or P > E:
            print(f"exflow_affinity: {ctx['model']}: E={E} does not split over P={P} devices; skipped")
            continue
        result = place_by_affinity(transitions["profile"], E, P, layers=layers, time_limit_s=time_limit_s)
        contiguous = contiguous_placements(layers, E, P)
        hops = float(sum(c.sum() for c in transitions["profile"].values()))
        ip_gain = sum(b.start_cut - b.cut for b in result.bisections) / hops if hops else float("nan")
        summary = result.summary()
        fractions = {}
        for split, tr in transitions.items():
            before, after = cross_device_fraction(tr, contiguous), cross_device_fraction(tr, result.placements)
            fractions[split] = {"contiguous": before, "exflow_ip": after}
            rows.append({"model": ctx["model"], "num_experts": E, "top_k": K, "world_size": P, "source": source,
                         "split": split, "tokens": int(next(iter(routing[split].values()))[0].shape[0]),
                         "layer_pairs": len(tr), "contiguous": before, "exflow_ip": after,
                         "reduction": 1.0 - after / before if before else float("nan"),
                         "affinity_top1": affinity_top1(tr, K), "independent_top1": K / E,
                         "solver_s": result.seconds, "time_limit_s": time_limit_s,
                         "programs": summary["programs"], "proved_optimal": summary["proved_optimal"],
                         "ip_gain_over_start": ip_gain, "trace": str(run_dir)})
        save_exflow_placements(out_dir / f"exflow_placements_{ctx['model']}_p{P}.json", result,
                               {"model": ctx["model"], "source": source, "trace": str(run_dir),
                                "cross_device_fraction": fractions})
    return rows


def plot_affinity(table: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Held-out cross-device share, contiguous vs affinity placement, per model and P (the
    dashed line: (P - 1) / P, the share under a placement unrelated to the routing)."""
    style()
    held = table[table.split == "heldout"].melt(
        id_vars=["model", "world_size"], value_vars=["contiguous", "exflow_ip"],
        var_name="placement", value_name="cross-device share of hops")
    g = sns.catplot(data=held, x="model", y="cross-device share of hops", hue="placement",
                    col="world_size", kind="bar", height=3.2, aspect=1.2, palette=["#7f7f7f", "#bcbd22"])
    g.set_titles("P = {col_name} devices")
    for P, ax in g.axes_dict.items():     # a placement that ignores routing: (P - 1) / P of hops cross
        ax.axhline((P - 1) / P, color="black", linestyle="--", linewidth=0.8)
        ax.text(ax.get_xlim()[0], (P - 1) / P, " (P-1)/P", va="bottom", fontsize=7)
    g.figure.suptitle("ExFlow: consecutive-layer hops that cross devices (held-out tokens; computed "
                      "from routing and placement)", y=1.04, fontsize=9)
    return save(g.figure, Path(out_dir) / "exflow_affinity")


CONTEXT = ("model", "num_experts", "top_k", "batch_size", "seq_len")


def study(df: pd.DataFrame, out_dir, world_sizes, time_limit_s: float, source: str = "primary", heldout_share: float = 0.5) -> pd.DataFrame:
    """Every run of ``df`` (:func:`analysis.load.load_runs`) whose folder holds a routing
    trace: the table (also written as CSV), the figure and the placement artifacts."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: allowed values are {list(SOURCES)}")
    out_dir = Path(out_dir)
    rows = []
    for run_dir, run in traced_runs(df):
        ctx = run.iloc[0][list(CONTEXT)].to_dict()
        rows += study_run(run_dir, ctx, out_dir, [int(p) for p in world_sizes], time_limit_s, source,
                          heldout_share)
    table = pd.DataFrame(rows)
    if not table.empty:
        table.to_csv(out_dir / CSV_NAME, index=False)
    return table


SHOWN = ["model", "top_k", "world_size", "split", "tokens", "contiguous", "exflow_ip", "reduction",
         "affinity_top1", "independent_top1", "solver_s", "proved_optimal", "programs", "ip_gain_over_start"]


def build(df: pd.DataFrame, out_dir, *, world_sizes, time_limit_s: float) -> list:
    """Report builder: the study at the experiment's world sizes and solver budget per
    model and P (``report_options.exflow_affinity`` in conf/experiment/exflow_affinity.yaml)."""
    title = "ExFlow: inter-layer expert affinity and placement"
    table = study(df, out_dir, world_sizes, time_limit_s)
    if table.empty:
        return [Section(title, ["Not drawn: these runs have no routing trace (task.save_routing=true)."])]
    text = ["Hops between consecutive MoE layers, from each token's highest-weight expert at layer l to "
            "every expert of its top-k at l+1 (the device a token would sit on under ExFlow's context "
            "coherence), computed from the prefill's routing trace and the placements: not measured "
            "traffic. The placement is fitted on the profile half of the sequences (integer programs, "
            f"HiGHS, recursive bisection, {time_limit_s:g} s per model and P) and judged on the held-out "
            "half. `affinity_top1`: how often a source expert's likeliest successor is in the token's "
            "top-k (`independent_top1` = K/E if layer l+1 ignored layer l). `ip_gain_over_start`: share "
            "of hops the solver removed beyond its descent start.",
            "ExFlow's paper reports up to 67 % less cross-GPU routing latency from this placement "
            "(GPT MoE, 8 to 64 experts); quoted, not reproduced here."]
    figures = plot_affinity(table, Path(out_dir))
    print_summary(table)
    return [Section(title, text, [("exflow_affinity_summary", table[SHOWN])], figures)]


def print_summary(table: pd.DataFrame) -> None:
    """The before/after cross-device hop fractions, on stdout (the experiment's console)."""
    print("ExFlow affinity placement: cross-device share of hops between consecutive MoE layers", flush=True)
    print(table[SHOWN].to_string(index=False, float_format=lambda v: f"{v:.3f}"), flush=True)


def main(argv=None) -> None:
    from occult.config import read_conf

    from ..load import load_runs

    defaults = read_conf("experiment", "exflow_affinity").report_options["exflow_affinity"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run or sweep folders with prefill runs that saved routing traces")
    ap.add_argument("--out", default=None, help="where to write (default: the first folder)")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=list(defaults["world_sizes"]),
                    help="default: the experiment's (conf/experiment/exflow_affinity.yaml)")
    ap.add_argument("--time-limit", type=float, default=float(defaults["time_limit_s"]),
                    help="solver budget per (model, P), seconds; default: the experiment's")
    ap.add_argument("--source", choices=SOURCES, default="primary")
    ap.add_argument("--heldout-share", type=float, default=0.5)
    args = ap.parse_args(argv)
    if not math.isfinite(args.time_limit) or args.time_limit <= 0:
        raise SystemExit(f"--time-limit={args.time_limit}: must be a positive number of seconds")
    out = Path(args.out or args.paths[0])
    table = study(load_runs(args.paths), out, args.world_sizes, args.time_limit, args.source, args.heldout_share)
    if table.empty:
        raise SystemExit(f"no run with a routing trace under {args.paths} (run a prefill with task.save_routing=true)")
    plot_affinity(table, out)
    print_summary(table)


if __name__ == "__main__":
    main()
