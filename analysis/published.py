"""Published GPU measurements of expert-parallel exchanges (``conf/published/*.yaml``), as data.

One file per source (a repository's file at a pinned commit); in it, tables, each with its
shapes (tokens per rank, hidden, top-k, experts, dispatch and combine dtypes and row bytes),
its hardware and the projection profile that stands for it, its kernels and its points. A
kernel declares, before any fit, the harness system that moves its rows (``system``,
``system_options``), its ``transport`` (``one_sided``: the valid rows are written into a
padded receive buffer; ``two_sided``: an equal-split all-to-all sends the whole buffer), its
``links`` (``nvlink``, ``nvlink+rdma``), whether it overlaps NVLink and the NIC
(``overlap``), whether its timed call includes a counts exchange (``counts``) and the
source's rule for counting bytes (``byte_rule.rows``: :data:`BYTE_RULES`); optionally the
granularity of its NIC messages as its source's code issues them (``messages.unit``:
:data:`MESSAGE_UNITS`, with ``messages.cited``: repository, file, line and commit), used by the
report's message-granularity diagnostic (undeclared: ``peer``, the price's own count). A point is one
published run: kernel, EP size, nodes, phase (dispatch | combine) and its latency (us) and /
or bandwidth (GB/s). A table's or a kernel's ``role`` is ``fit`` (used by the fits) or
``check`` (held out of every fit, reported as the check of the fitted model).

:func:`load_points` flattens every source into one row per point (the table's and kernel's
fields on each row); a malformed file is a one-line ``ValueError`` naming the field.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from occult import CONF_DIR

PUBLISHED_DIR = CONF_DIR / "published"
BYTE_RULES = {
    "pairs": "a row per (token, expert) pair of the rank's tokens",
    "rank_dedup_received": "the rows a rank receives, one per (token, rank)",
    "node_dedup_sent": "the rank's (token, node) pairs",
}
MESSAGE_UNITS = {
    "peer": "one NIC message per remote peer with a non-empty block (batched per peer)",
    "pair": "one NIC message per (token, expert) row sent across nodes",
}
TRANSPORTS = ("one_sided", "two_sided")
LINKS = ("nvlink", "nvlink+rdma")
PHASES = ("dispatch", "combine")
ROLES = ("fit", "check")
TABLE_FIELDS = ("name", "section", "role", "hardware", "profile", "tokens_per_rank", "hidden", "top_k",
                "num_experts", "dispatch_dtype", "combine_dtype", "dispatch_row_bytes", "combine_row_bytes",
                "kernels", "points")
KERNEL_FIELDS = ("system", "system_options", "transport", "links", "overlap", "counts", "byte_rule")


def source_files() -> list[Path]:
    """The published sources, one YAML per source."""
    return sorted(PUBLISHED_DIR.glob("*.yaml"))


def _need(d: dict, fields, where: str) -> None:
    """One line naming the first missing field."""
    for f in fields:
        if f not in d or d[f] is None:
            raise ValueError(f"{where}: missing field {f!r}")


def _allowed(value, allowed, where: str) -> None:
    if value not in allowed:
        raise ValueError(f"{where}={value!r}: allowed values {list(allowed)}")


def kernel_rows(path: Path) -> list[dict]:
    """One source file's points, one dict per point (see the module docstring)."""
    c = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    name = path.stem
    _need(c, ("source", "tables", "exclusions"), name)
    src = c["source"]
    _need(src, ("name", "repo", "file", "commit"), f"{name}.source")
    if len(str(src["commit"])) != 40:
        raise ValueError(f"{name}.source.commit={src['commit']!r}: allowed values are 40-hex-digit commits")
    out = []
    for t in c["tables"]:
        where = f"{name}.{t.get('name', '?')}"
        _need(t, TABLE_FIELDS, where)
        _allowed(t["role"], ROLES, f"{where}.role")
        for kname, k in t["kernels"].items():
            _need(k, KERNEL_FIELDS, f"{where}.kernels.{kname}")
            _allowed(k["transport"], TRANSPORTS, f"{where}.kernels.{kname}.transport")
            _allowed(k["links"], LINKS, f"{where}.kernels.{kname}.links")
            _allowed(k["byte_rule"].get("rows"), BYTE_RULES, f"{where}.kernels.{kname}.byte_rule.rows")
            _allowed(k.get("role", t["role"]), ROLES, f"{where}.kernels.{kname}.role")
            if k.get("messages") is not None:
                _need(k["messages"], ("unit", "cited"), f"{where}.kernels.{kname}.messages")
                _allowed(k["messages"]["unit"], MESSAGE_UNITS, f"{where}.kernels.{kname}.messages.unit")
        for i, p in enumerate(t["points"]):
            pw = f"{where}.points[{i}]"
            _need(p, ("kernel", "ep", "nodes", "phase"), pw)
            _allowed(p["kernel"], list(t["kernels"]), f"{pw}.kernel")
            _allowed(p["phase"], PHASES, f"{pw}.phase")
            if p.get("latency_us") is None and p.get("GBps") is None:
                raise ValueError(f"{pw}: needs latency_us or GBps")
            if p["ep"] % p["nodes"]:
                raise ValueError(f"{pw}: ep={p['ep']} does not fill nodes={p['nodes']} evenly")
            k = t["kernels"][p["kernel"]]
            out.append({
                "source": src["name"], "repo": src["repo"], "file": src["file"], "commit": src["commit"],
                "table": t["name"], "role": k.get("role", t["role"]), "kernel": p["kernel"],
                "hardware": k.get("hardware", t["hardware"]), "profile": k.get("profile") or t["profile"],
                "ep": int(p["ep"]), "nodes": int(p["nodes"]), "devices_per_node": int(p["ep"]) // int(p["nodes"]),
                "phase": p["phase"], "tokens_per_rank": int(t["tokens_per_rank"]), "hidden": int(t["hidden"]),
                "top_k": int(t["top_k"]), "num_experts": int(t["num_experts"]),
                "dispatch_dtype": t["dispatch_dtype"], "combine_dtype": t["combine_dtype"],
                "row_bytes": int(t[f"{p['phase']}_row_bytes"]),
                "system": k["system"], "system_options": dict(k["system_options"] or {}),
                "transport": k["transport"], "links": k["links"], "overlap": bool(k["overlap"]),
                "counts": bool(k["counts"]), "byte_rule": k["byte_rule"]["rows"],
                "message_unit": (k.get("messages") or {}).get("unit", "peer"),
                "message_declared": k.get("messages") is not None,
                "latency_us": float(p["latency_us"]) if p.get("latency_us") is not None else float("nan"),
                "GBps": float(p["GBps"]) if p.get("GBps") is not None else float("nan"),
            })
    return out


def load_points(paths=None) -> pd.DataFrame:
    """Every published point of every source (:func:`kernel_rows`), one row each."""
    rows = []
    for path in paths or source_files():
        rows += kernel_rows(Path(path))
    if not rows:
        raise ValueError(f"no published sources under {PUBLISHED_DIR}")
    return pd.DataFrame(rows)


def exclusions(paths=None) -> list[dict]:
    """Every source's excluded entries (evident typos), each with its source and why."""
    out = []
    for path in paths or source_files():
        c = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        out += [{"source": c["source"]["name"], **e} for e in c.get("exclusions") or []]
    return out
