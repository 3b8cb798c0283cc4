"""Projects measured runs onto a cluster profile with the cost model (labelled projected).

    python -m analysis.project runs/fig12_scaling --profile sim_a6000x4
    python -m analysis.project runs/fig1_latency --profile sim_a6000x4 --model real
    python -m analysis.project runs/fig12_scaling --profile sim_h100x8 --model olmoe_layer --out /tmp/p

Uses the runs measured at the profile's world size (their per-peer bytes and
tokens); ``--model``: ``own`` (each run's own width), ``real`` (the paper model
each CPU proxy stands for) or a name under conf/model. Writes
``projected_<profile>.csv`` (per layer and component) and
``projected_<profile>_totals.csv`` (per run), ``<profile>`` the profile's ``name``
(also for a profile given by path), and prints the totals; every row has
``source = projected``. Profiles: ``conf/profile/sim_*.yaml``, or a YAML path.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from occult.ep.profiles import available_profiles, load_profile

from .load import load_runs
from .projection import project_runs, projected_totals, target_model


def project(paths, profile_name: str, model: str = "own"):
    """(per-layer projection, per-run totals) of the runs under ``paths`` on a profile."""
    profile = load_profile(profile_name)
    target = None if model == "own" else "real" if model == "real" else target_model(model)
    df = load_runs(paths)
    proj = project_runs(df, profile, target)
    if proj.empty:
        sizes = sorted(int(p) for p in df.world_size.unique())
        want = profile.sizes()
        raise ValueError(f"profile={profile_name}: no run to project; it needs runs at world size {want}, "
                         f"these runs have {sizes}")
    return proj, projected_totals(proj)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run or sweep folders")
    ap.add_argument("--profile", required=True, help=f"a profile (conf/profile, or a YAML path): {', '.join(available_profiles())}")
    ap.add_argument("--model", default="own", help="own | real | a conf/model name (default: own)")
    ap.add_argument("--out", default=None, help="folder for the CSV files (default: the first path)")
    args = ap.parse_args()
    proj, totals = project(args.paths, args.profile, args.model)
    name = load_profile(args.profile).name          # a path's profile: its own name, not the path
    out = Path(args.out or args.paths[0])
    out.mkdir(parents=True, exist_ok=True)
    proj.to_csv(out / f"projected_{name}.csv", index=False)
    totals.to_csv(out / f"projected_{name}_totals.csv", index=False)
    shown = [c for c in ("system", "model", "task", "world_size", "top_k", "target_model", "a2a_ms_per_layer",
                         "experts_ms_per_layer", "moe_ms", "source", "profile") if c in totals]
    print(totals[shown].to_markdown(index=False, floatfmt=".4g"))
    print(out / f"projected_{name}_totals.csv")


if __name__ == "__main__":
    main()
