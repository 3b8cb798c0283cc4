"""`make results` (analysis.results) and its old-vs-new headline table (analysis.headlines):
the hand-copied values are read from git, not typed; "moved" compares against the new spread;
the index is written from the log; a dirty tree is refused."""
import subprocess
import sys

import pytest

from analysis import headlines as hl
from analysis import results

REQUIRED = {"fig1_latency", "fig7_pruning", "fig8_pattern", "fig12_scaling", "table1_ct_runtime"}


def _has_old_commit() -> bool:
    return subprocess.run(["git", "cat-file", "-e", hl.OLD_COMMIT], cwd=hl.ROOT).returncode == 0


@pytest.mark.skipif(not _has_old_commit(), reason=f"a shallow clone without {hl.OLD_COMMIT}")
def test_every_headline_reads_its_hand_copied_value_from_git():
    assert REQUIRED <= {h.experiment for h in hl.HEADLINES}
    for name in REQUIRED:
        lines = hl.old_file(name)
        for h in hl.of(name):
            float(hl.old_value(h, lines))          # the line says a number where the headline points
    bad = hl.Headline("fig8_pattern", "x", 7, r"nothing like this ([\d.]+)", lambda df: 0.0)
    with pytest.raises(ValueError, match="does not match"):
        hl.old_value(bad)


def test_moved_beyond_the_spread_allows_the_old_rounding():
    assert hl.moved("0.93", [0.934, 0.936]) == "no"      # 0.93 was 0.925..0.935 before rounding
    assert hl.moved("0.93", [0.95, 0.97]) == "yes"
    assert hl.moved("3.55", [3.4, 3.6]) == "no"
    assert hl.moved("7.108", [None, None]) == "no new value"


@pytest.mark.skipif(not _has_old_commit(), reason=f"a shallow clone without {hl.OLD_COMMIT}")
def test_index_lists_the_log_and_the_headlines(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "DOCS", tmp_path)
    (tmp_path / "table1_ct_runtime.md").write_text("# Results: table1_ct_runtime\n")
    (tmp_path / "fig3_lcc.md").write_text("> **Copied from the README at 82f5e01, not yet regenerated.**\n")
    names = [h.name for h in hl.of("table1_ct_runtime")]
    log = {"table1_ct_runtime": {
        "command": "python run.py experiment=table1_ct_runtime", "commit": "abc", "clean": True, "dirty_files": [],
        "wall_s": 60.0, "finished": "2026-12-05 04:00 UTC", "figures": ["table1_ct_runtime/table1_ct_runtime.png"],
        "load_1min": {"min": 1.5, "median": 3.25, "max": 9.0, "n": 4}, "time_v": {"elapsed_s": 61.0, "max_rss_kb": 10**6},
        "headlines": {"value": {n: 0.5 for n in names}, "samples": {n: [0.4, 0.5, 0.6] for n in names}}}}
    text = results.write_index(log).read_text()
    assert ("| [table1_ct_runtime](table1_ct_runtime.md) | `python run.py experiment=table1_ct_runtime` | 1.0 min | "
            "1.5 / 3.2 / 9.0 | 1.0 min, 1.02 GB |") in text
    assert "Still hand copies (banner kept): [fig3_lcc.md](fig3_lcc.md)." in text
    assert "| table1_ct_runtime | r(C_T, remote bytes per rank) | 0.93 (:6) | 0.500 | 0.400 to 0.600 (3, iterations) | yes |" in text
    assert "Not compared yet (not rerun by `make results`; their hand copies keep their banner): " \
        "[fig12_scaling](fig12_scaling.md), [fig1_latency](fig1_latency.md)," in text
    assert "| table1_ct_runtime | r(C_T, all-to-all fwd+bwd) | 0.60 (:7) | 0.500 | 0.400 to 0.600 (3, iterations) | no |" in text


def test_a_dirty_tree_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(results, "dirty_files", lambda: ["occult/x.py"])
    monkeypatch.setattr(sys, "argv", ["results", "--only", "table1_ct_runtime"])
    with pytest.raises(SystemExit, match="the tree has changes outside docs/results \\(occult/x.py\\)"):
        results.main()


def test_the_load_sampler_reads_the_load_while_a_command_runs(tmp_path, monkeypatch):
    """Every sample is the load average at its time (a fake clock of loads 1, 2, 3, ...), taken
    from the command's start to its end, at least once."""
    loads = iter(range(1, 1000))
    monkeypatch.setattr(results.os, "getloadavg", lambda: (float(next(loads)), 0.0, 0.0))
    sampler = results.LoadSampler(every_s=0.05)
    rc, wall = results.run_logged([sys.executable, "-c", "import time; time.sleep(0.3)"], tmp_path / "log", "", sampler)
    s = sampler.summary()
    assert rc == 0 and wall >= 0.3
    assert s["min"] == 1.0 and s["max"] == s["n"] and 3 <= s["n"] <= 2 + wall / 0.05
    assert s["median"] == (1 + s["n"]) / 2


def test_the_command_is_measured_with_gnu_time_and_its_figures_published(tmp_path, monkeypatch):
    """Where /usr/bin/time is installed, the experiment's command runs under ``time -v``; its
    wall time and peak resident memory go into the published file's header and the index."""
    report = tmp_path / "t.txt"
    report.write_text('\tCommand being timed: "python run.py experiment=x"\n'
                      "\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.50\n"
                      "\tMaximum resident set size (kbytes): 2000000\n\tExit status: 0\n")
    t = results.read_time_v(report)
    assert t == {"elapsed_s": 3723.5, "max_rss_kb": 2000000}
    assert results.read_time_v(tmp_path / "missing.txt") is None
    md = tmp_path / "x.md"
    md.write_text("# Results: x\n\n| | |\n|---|---|\n| experiment | `x` |\n| measured by | `python run.py "
                  "experiment=x` |\n| published | now |\n")
    results.stamp_time_v(md, "x", t)
    lines = md.read_text().splitlines()
    assert lines[6].startswith("| measured with `/usr/bin/time -v` | `python run.py experiment=x`: 62.1 min, 2.05 GB ")
    assert lines[7] == "| published | now |"
    monkeypatch.setattr(results, "TIME_V", tmp_path / "no_time")
    assert results.timed_command(["a"], report) == ["a"]
    monkeypatch.setattr(results, "TIME_V", report)
    assert results.timed_command(["a"], tmp_path / "o") == [str(report), "-v", "-o", str(tmp_path / "o"), "a"]
