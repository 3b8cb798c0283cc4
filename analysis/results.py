"""``make results``: reruns every experiment whose results are published in docs/results and
publishes each again; then writes docs/results/index.md.

    python -m analysis.results                      # every published experiment, in ORDER
    python -m analysis.results --only fig8_pattern,table1_ct_runtime
    python -m analysis.results --index              # only rewrite index.md from the log
    python -m analysis.results --list               # what would run, and what is done

Per experiment: ``python run.py experiment=NAME`` into ``runs/NAME`` (timed here, and under
``/usr/bin/time -v`` where GNU time is installed: its wall time and peak resident memory go
into the published file's header and the index), then
``python -m analysis.report runs/NAME --publish docs/results``, then its entry in the log
(``docs/results/results_log.json``: command, wall time, commit, clean tree, figures, the
headline numbers' samples) and index.md. An experiment is done when the log has it at a
commit whose code (everything but docs/results) equals the checkout's: a rerun skips it, so a
crash or a kill loses only the experiment under way (whose sweep resumes its finished points).
Run folders from other code are moved aside to ``runs/NAME.prev`` first.

On a tree with changes outside docs/results it refuses (``--allow-dirty`` runs anyway, warns
and records the tree as dirty). Headline experiments (analysis.headlines) whose numbers time
nothing are run RERUNS times (``runs/NAME_r2``, ...) for their spread.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from . import headlines as hl

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
LOG = DOCS / "results_log.json"
RUNS = ROOT / "runs"
# the order: the paper figures with headline numbers first (cheapest first), then the other hand
# copies, then the experiments already generated; any other published experiment after them
ORDER = ("table1_ct_runtime", "fig8_pattern", "fig12_scaling", "fig7_pruning", "fig1_latency",
         "fig3_lcc", "tutel_overlap", "placement_study", "exflow_affinity", "fig1_batch", "lossy_front",
         "strategies", "default_study", "proxies", "proxies_scmoe", "placement_load", "group_limit", "bench",
         "scale_study", "modern_models")
HAND_COPY_MARKS = ("not yet regenerated", "typed by hand", "Copied from the README")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def head() -> str:
    return git("rev-parse", "--short=12", "HEAD")


def dirty_files() -> list[str]:
    """Tracked files that differ from HEAD, docs/results left out (what is being published)."""
    out = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/results")
    return [line[3:] for line in out.splitlines() if line.strip()]


# files that cannot change a run's numbers or its report: the published results, this module and
# the headline table (they only write index.md), the tests and the Markdown docs
NOT_RESULT_CODE = (":(exclude,top)docs/results", ":(exclude,top)analysis/results.py",
                   ":(exclude,top)analysis/headlines.py", ":(exclude,top)tests", ":(exclude,top,glob)**/*.md")


def same_code(commit: str) -> bool:
    """Whether ``commit`` and the checkout's HEAD hold the same code (NOT_RESULT_CODE left out)."""
    return subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", ":(top)", *NOT_RESULT_CODE],
                          cwd=ROOT).returncode == 0


def published() -> list[str]:
    """Experiments with a published file docs/results/NAME.md, in ORDER."""
    names = {p.stem for p in DOCS.glob("*.md") if (ROOT / "conf" / "experiment" / f"{p.stem}.yaml").exists()}
    return [n for n in ORDER if n in names] + sorted(names - set(ORDER))


def load_log() -> dict:
    return json.loads(LOG.read_text()) if LOG.exists() else {}


def save_log(log: dict) -> None:
    LOG.write_text(json.dumps(log, indent=1, sort_keys=True) + "\n")


def reruns_of(name: str) -> int:
    """How often the command runs: RERUNS for a headline experiment whose numbers time nothing, else once."""
    return hl.RERUNS if hl.of(name) and name not in hl.TIMED else 1


def published_here(log: dict, name: str) -> bool:
    """The log has the experiment published from a clean tree at the checkout's code."""
    entry = log.get(name)
    return bool(entry) and entry.get("clean", False) and same_code(entry["commit"])


def done(log: dict, name: str) -> bool:
    """Published at this code, with every rerun its headlines need."""
    return published_here(log, name) and 1 + len(log[name].get("rerun_wall_s", [])) >= reruns_of(name)


def fresh_folder(folder: Path, commit: str) -> str:
    """Makes ``folder`` ready for a run at ``commit``: kept when an earlier attempt at the same
    code left it (its finished points are resumed), else moved aside. Returns what happened."""
    mark = folder / ".results_commit"
    if folder.exists():
        if mark.exists() and same_code(mark.read_text().strip()):
            return "resumed"
        prev = folder.with_name(folder.name + ".prev")
        shutil.rmtree(prev, ignore_errors=True)
        folder.rename(prev)
    folder.mkdir(parents=True)
    mark.write_text(commit + "\n")
    return "fresh"


LOAD_EVERY_S = 15.0
# GNU time: the whole command's wall time and its largest process's peak resident memory
TIME_V = Path("/usr/bin/time")
TIME_V_FIELDS = {"Elapsed (wall clock) time (h:mm:ss or m:ss)": "elapsed_s", "Maximum resident set size (kbytes)": "max_rss_kb"}


def timed_command(cmd: list[str], out: Path) -> list[str]:
    """``cmd`` under ``/usr/bin/time -v -o out`` where GNU time is installed, else ``cmd``."""
    return [str(TIME_V), "-v", "-o", str(out), *cmd] if TIME_V.is_file() else cmd


def read_time_v(path: Path) -> dict | None:
    """``{"elapsed_s", "max_rss_kb"}`` from a ``/usr/bin/time -v`` report (None without one)."""
    if not path.is_file():
        return None
    got = {}
    for line in path.read_text().splitlines():
        name, _, value = line.strip().rpartition(": ")
        if name in TIME_V_FIELDS:
            if TIME_V_FIELDS[name] == "elapsed_s":
                parts = [float(x) for x in value.split(":")]
                got["elapsed_s"] = round(sum(p * 60 ** i for i, p in enumerate(reversed(parts))), 2)
            else:
                got["max_rss_kb"] = int(value)
    return got if len(got) == len(TIME_V_FIELDS) else None


def time_v_words(t: dict | None) -> str:
    """``23.1 min, 2.31 GB`` from :func:`read_time_v`'s fields ("not measured" without them)."""
    return f"{t['elapsed_s'] / 60:.1f} min, {t['max_rss_kb'] * 1024 / 1e9:.2f} GB" if t else "not measured"


def stamp_time_v(published_md: Path, name: str, t: dict | None) -> None:
    """Adds the whole command's ``/usr/bin/time -v`` figures to the published file's header
    table, after its ``measured by`` row."""
    if not t or not published_md.is_file():
        return
    lines = published_md.read_text().splitlines()
    row = (f"| measured with `/usr/bin/time -v` | `python run.py experiment={name}`: {time_v_words(t)} peak resident "
           "memory (wall clock; largest single process: the sweep's, whose report runs in it, or a point's rank) |")
    at = next((i for i, ln in enumerate(lines) if ln.startswith("| measured by |")), None)
    if at is not None:
        published_md.write_text("\n".join(lines[:at + 1] + [row] + lines[at + 1:]) + "\n")


class LoadSampler:
    """The machine's 1-minute load average (``os.getloadavg``), read every ``every_s`` seconds
    in a thread while a sweep runs: how busy the cores were that its times were measured on
    (the sweep's own ranks included: a P = 4 world on 2 cores alone reads about 4)."""

    def __init__(self, every_s: float = LOAD_EVERY_S):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """``{"min", "median", "max", "n"}`` of the samples, rounded to 0.01."""
        s = self.samples
        return {"min": round(min(s), 2), "median": round(statistics.median(s), 2), "max": round(max(s), 2),
                "n": len(s)}


def run_logged(cmd: list[str], log_path: Path, prefix: str, load: LoadSampler | None = None) -> tuple[int, float]:
    """Runs ``cmd`` at the repository root, its output into ``log_path``; echoes the sweep's
    progress lines with ``prefix``; ``load``, when given, samples the machine's load meanwhile.
    Returns (exit status, wall seconds)."""
    t0 = time.monotonic()
    with open(log_path, "a") as logf, (load or contextlib.nullcontext()):
        logf.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            logf.write(line)
            if "[point " in line or "Error" in line or "FAILED" in line or "report:" in line:
                print(f"{prefix} {line.rstrip()[-160:]}", flush=True)
        rc = proc.wait()
    return rc, time.monotonic() - t0


def figures_of(name: str) -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in (DOCS / name).glob("*.png")) if (DOCS / name).is_dir() else []


def run_sweep(name: str, folder: Path, r: int, prefix: str, commit: str) -> tuple[float, dict, dict | None] | None:
    """Runs ``python run.py experiment=NAME`` into ``folder`` (run ``r`` of its reruns), under
    ``/usr/bin/time -v`` where installed (:func:`timed_command`); its wall seconds, the
    machine's load meanwhile (:class:`LoadSampler`) and the ``/usr/bin/time -v`` figures
    (:func:`read_time_v`), or None when it failed."""
    state = fresh_folder(folder, commit)
    cmd = [sys.executable, "run.py", f"experiment={name}"]
    if r > 1:
        cmd.append(f"hydra.sweep.dir=runs/{folder.name}")
    load = LoadSampler()
    time_v = RUNS / f"{folder.name}.time_v.txt"
    time_v.unlink(missing_ok=True)
    rc, wall = run_logged(timed_command(cmd, time_v), RUNS / f"{folder.name}.results.log",
                          f"{prefix} run {r}/{reruns_of(name)}:", load)
    spent = folder / ".results_wall"          # every attempt's seconds at this code (a resumed sweep's too)
    total = wall + (float(spent.read_text()) if spent.exists() else 0.0)
    spent.write_text(f"{total:.1f}\n")
    print(f"{prefix} run {r}/{reruns_of(name)} ({state}) exit {rc} after {wall / 60:.1f} min"
          + (f" ({total / 60:.1f} min with the earlier attempts)" if total > wall + 0.05 else ""), flush=True)
    if rc != 0:
        print(f"{prefix} FAILED: see runs/{folder.name}.results.log; the other experiments go on", flush=True)
        return None
    print(f"{prefix} load average (1 min) during the run: {_load_words(load.summary())}", flush=True)
    timing = read_time_v(time_v)
    print(f"{prefix} /usr/bin/time -v: {time_v_words(timing)}", flush=True)
    return total, load.summary(), timing


def _load_words(load: dict | None) -> str:
    """``min / median / max`` of a run's load samples, or "not recorded" (runs before it was)."""
    return f"{load['min']:.1f} / {load['median']:.1f} / {load['max']:.1f}" if load else "not recorded"


def run_one(name: str, i: int, n: int, clean: bool, log: dict) -> bool:
    """Runs, publishes and logs one experiment, then its reruns (each logged as it ends, so a
    kill keeps what was published); False when it failed."""
    prefix = f"[results {i}/{n} {name}]"
    commit = head()
    folders = [RUNS / name] + [RUNS / f"{name}_r{r}" for r in range(2, reruns_of(name) + 1)]
    before = (log.get(name) or {}).get("wall_s")
    print(f"{prefix} start at {commit}{'' if clean else ' (DIRTY TREE)'}"
          + (f"; last time {before / 60:.1f} min" if before else ""), flush=True)
    if not published_here(log, name):
        ran = run_sweep(name, folders[0], 1, prefix, commit)
        if ran is None:
            return False
        wall, load, timing = ran
        command = f"python -m analysis.report runs/{name} --publish docs/results"
        rc, _ = run_logged([sys.executable, "-m", "analysis.report", f"runs/{name}", "--publish", "docs/results"],
                           RUNS / f"{name}.results.log", f"{prefix} publish:")
        if rc != 0:
            print(f"{prefix} FAILED to publish: see runs/{name}.results.log", flush=True)
            return False
        stamp_time_v(DOCS / f"{name}.md", name, timing)
        log[name] = {"command": f"python run.py experiment={name}", "published_by": command, "commit": commit,
                     "clean": clean, "dirty_files": [] if clean else dirty_files(), "wall_s": round(wall, 1),
                     "rerun_wall_s": [], "load_1min": load, "time_v": timing, "rerun_load_1min": [], "finished": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "figures": figures_of(name)}
        log_headlines(log, name, folders[:1])
        print(f"{prefix} published docs/results/{name}.md ({wall / 60:.1f} min)", flush=True)
    entry = log[name]
    for r in range(2 + len(entry["rerun_wall_s"]), len(folders) + 1):
        ran = run_sweep(name, folders[r - 1], r, prefix, commit)
        if ran is None:
            return False
        entry["rerun_wall_s"].append(round(ran[0], 1))
        entry.setdefault("rerun_load_1min", []).append(ran[1])
        log_headlines(log, name, folders[:r])
    return True


def log_headlines(log: dict, name: str, folders: list[Path]) -> None:
    """Adds the headline numbers over ``folders`` to the log entry; saves the log and index.md."""
    if hl.of(name):
        log[name]["headlines"] = headline_samples(name, folders)
    save_log(log)
    write_index(log)


def headline_samples(name: str, folders: list[Path]) -> dict:
    """The headline numbers: ``{"value": {name: v}, "samples": {name: [...]}, "kind": ...}``."""
    from .load import load_runs

    df = load_runs([folders[0]])
    value = {k: v[0] for k, v in hl.evaluate(name, [df]).items()}
    if name in hl.TIMED:
        frames, kind = hl.timed_subsets(df), "timed samples (iterations) of the sweep"
    else:
        frames, kind = [df] + [load_runs([f]) for f in folders[1:]], "reruns of the whole command"
    return {"value": value, "samples": hl.evaluate(name, frames), "kind": kind}


def _fmt(v, old: str) -> str:
    """``v`` with one digit more than the hand-copied ``old`` showed."""
    if v is None:
        return "n/a"
    return f"{v:.{(len(old.split('.')[1]) if '.' in old else 0) + 1}f}"


def write_index(log: dict) -> Path:
    """docs/results/index.md from the log, the published files and the hand copies at OLD_COMMIT."""
    lines = ["# Results: every experiment, its command, wall time and figures (index)", "",
             "Generated by `make results` (`python -m analysis.results`) from `results_log.json`; do not edit by "
             "hand. Each experiment ran as `python run.py experiment=NAME` into `runs/NAME` and was published by "
             "`python -m analysis.report runs/NAME --publish docs/results`; its file states the runs' commit and "
             "date again. Wall time: the sweep here (this machine, shared with other jobs while these ran; a "
             "resumed sweep's attempts summed), pre-training of any proxy not yet cached included. Load: the "
             "machine's 1-minute load average sampled every 15 s during the sweep, min / median / max (2 cores; the "
             "sweep's own ranks count: a P = 4 world alone reads about 4; far above that, other jobs shared the "
             "cores and its times are slower and noisier). `/usr/bin/time -v`: the command's wall time and peak "
             "resident memory of its largest process, as GNU time measured them (the last attempt only).", "",
             "| experiment | command | wall time here | load | `/usr/bin/time -v` | figures | commit | tree | finished |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in published():
        e = log.get(name)
        if not e:
            continue
        figs = ", ".join(f"[{Path(f).stem}]({f})" for f in e["figures"]) or "none"
        lines.append(f"| [{name}]({name}.md) | `{e['command']}` | {e['wall_s'] / 60:.1f} min | "
                     f"{_load_words(e.get('load_1min'))} | {time_v_words(e.get('time_v'))} | {figs} | "
                     f"{e['commit']} | {'clean' if e['clean'] else 'DIRTY: ' + ', '.join(e['dirty_files'])} | "
                     f"{e['finished']} |")
    stale = sorted(p.name for p in DOCS.glob("*.md") if any(m in p.read_text() for m in HAND_COPY_MARKS)
                   and p.name != "index.md")
    not_run = [n for n in published() if n not in log]
    if not_run:
        lines += ["", "Not rerun by `make results` yet (their files are as published before): "
                  + ", ".join(f"[{n}]({n}.md)" for n in not_run) + "."]
    if stale:
        lines += ["", "Still hand copies (banner kept): " + ", ".join(f"[{s}]({s})" for s in stale) + "."]
    lines += ["", "## Headline numbers: the hand copies against the regenerated runs", "",
              f"Hand-copied: the value in `docs/results/<experiment>.md` at {hl.OLD_COMMIT} (the line named; read "
              "from git by `analysis.headlines`). New: the value the regenerated report gives; spread: min to max "
              "of the same number over samples (timed samples: the sweep's timed iterations, each evaluated "
              "alone; reruns: the whole command run again into `runs/NAME_r<n>`). Moved: the hand-copied value "
              "lies outside the spread widened by half a unit of its last digit. Numbers that time nothing (bytes, "
              "C_T, projections from them) are the same in every timed sample of a sweep: their spread over "
              "iterations is zero by construction; over reruns it says whether the command reproduces them.", "",
              "| experiment | number | hand-copied (line at " + hl.OLD_COMMIT + ") | new | spread (n, over) | moved |",
              "|---|---|---|---|---|---|"]
    for name in published():
        e = log.get(name) or {}
        if "headlines" not in e:
            continue
        old_lines = hl.old_file(name)
        for h in hl.of(name):
            old = hl.old_value(h, old_lines)
            new = e["headlines"]["value"].get(h.name)
            samples = [v for v in e["headlines"]["samples"].get(h.name, []) if v is not None]
            spread = (f"{_fmt(min(samples), old)} to {_fmt(max(samples), old)} ({len(samples)}, "
                      f"{'iterations' if name in hl.TIMED else 'reruns'})") if samples else "none"
            lines.append(f"| {name} | {h.name} | {old} (:{h.line}) | {_fmt(new, old)} | {spread} | {hl.moved(old, samples)} |")
    waiting = sorted({h.experiment for h in hl.HEADLINES} - {n for n, e in log.items() if "headlines" in e})
    if waiting:
        lines += ["", "Not compared yet (not rerun by `make results`; their hand copies keep their banner): "
                  + ", ".join(f"[{n}]({n}.md)" for n in waiting) + "."]
    path = DOCS / "index.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated experiments (default: every published one)")
    ap.add_argument("--allow-dirty", action="store_true", help="run on a tree with changes (recorded as dirty)")
    ap.add_argument("--force", action="store_true", help="rerun experiments the log has at this code")
    ap.add_argument("--index", action="store_true", help="only rewrite index.md from the log")
    ap.add_argument("--list", action="store_true", help="list the experiments and whether each is done")
    args = ap.parse_args()
    log = load_log()
    names = [n for n in args.only.split(",") if n] or published()
    unknown = [n for n in names if not (ROOT / "conf" / "experiment" / f"{n}.yaml").exists()]
    if unknown:
        sys.exit(f"results: --only names no experiment in conf/experiment: {', '.join(unknown)}")
    if args.index:
        print(write_index(log))
        return
    if args.list:
        for n in names:
            print(f"{n:22s} {'done at ' + log[n]['commit'] if done(log, n) else 'to run'}")
        return
    dirty = dirty_files()
    if dirty and not args.allow_dirty:
        sys.exit("results: the tree has changes outside docs/results (" + ", ".join(dirty) + "): commit them, "
                 "or pass --allow-dirty (make results ALLOW_DIRTY=1) to publish results marked dirty")
    if dirty:
        print("#" * 72 + "\n# WARNING: DIRTY TREE: results will be recorded as from a dirty tree:\n# "
              + ", ".join(dirty) + "\n" + "#" * 72, flush=True)
    RUNS.mkdir(exist_ok=True)
    todo = [n for n in names if args.force or not done(log, n)]
    print(f"results: {len(todo)} of {len(names)} experiment(s) to run ({len(names) - len(todo)} done at this code)",
          flush=True)
    failed = [n for i, n in enumerate(todo, 1) if not run_one(n, i, len(todo), not dirty, log)]
    write_index(log)
    if failed:
        sys.exit(f"results: failed: {', '.join(failed)} (rerun to retry; the others are published)")


if __name__ == "__main__":
    main()
