"""What a report is made of: sections, their rendering as report.md, and the lookup of
the builders that make them.

A report builder is the ``build(df, out_dir) -> list[Section]`` function of one module of
:mod:`analysis.figures`, named by that module: ``fig3_lcc`` is
``analysis.figures.fig3_lcc.build``. An experiment names its builders in its ``report``
field (comma-separated), ``python -m analysis.report --figures`` the same way; that name
is the only way to name one. Builders are imported by name when a report asks for them,
so this module imports none of them.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

FIGURES_PACKAGE = "analysis.figures"
log = logging.getLogger("occult")


@dataclass
class Section:
    """A part of report.md: a title, paragraphs, named tables and figures, and named long tables
    (per-point data a figure draws) that go to their CSV only, named in report.md, not printed."""

    title: str
    text: list = field(default_factory=list)
    tables: list = field(default_factory=list)      # (name, DataFrame)
    figures: list = field(default_factory=list)     # paths (PNG and PDF)
    data: list = field(default_factory=list)        # (name, DataFrame): <name>.csv only


def no_data(title: str, what: str) -> list[Section]:
    """The one section of a builder whose runs lack what it draws."""
    return [Section(title, [f"Not drawn: these runs have no {what}."])]


def write_table(table: pd.DataFrame, out_dir, name: str) -> None:
    """Writes a builder's table as ``<name>.csv`` and ``<name>.md`` into ``out_dir``."""
    out_dir = Path(out_dir)
    table.to_csv(out_dir / f"{name}.csv", index=False)
    (out_dir / f"{name}.md").write_text(readable(table).to_markdown(index=False, floatfmt=".4g") + "\n")


def available_builders() -> list[str]:
    """The builder names: the modules of :mod:`analysis.figures`."""
    folder = Path(__file__).resolve().parent / "figures"
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_"))


def builder_names(spec) -> list[str]:
    """``"fig3_lcc, table1_ct_runtime"`` (or a list) -> the names, in order, without blanks."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec or [])
    return [s.strip() for s in parts if s and s.strip()]


def resolve_builders(spec) -> list[Callable]:
    """Builder names (:func:`builder_names`) -> their ``build`` functions; an unknown name
    is a one-line ``ValueError`` that lists the allowed ones."""
    allowed = available_builders()
    out = []
    for name in builder_names(spec):
        if name not in allowed:
            raise ValueError(f"report={name!r}: unknown report builder; allowed: {allowed} "
                             f"(the modules of {FIGURES_PACKAGE})")
        out.append(importlib.import_module(f"{FIGURES_PACKAGE}.{name}").build)
    return out


def builder_name(build: Callable) -> str:
    """The name a builder is known by (its module's)."""
    return build.__module__.rsplit(".", 1)[-1]


def guarded(build: Callable, df: pd.DataFrame, out: Path, options: dict = None) -> list[Section]:
    """A builder's sections (``options``: its keyword arguments); if it fails, a section
    that says so (the other sections and the sweep's results stay intact) and the error in
    the log."""
    name = builder_name(build)
    try:
        return build(df, out, **(options or {}))
    except Exception as exc:  # noqa: BLE001 - one figure must not lose the whole report
        log.exception("report: %s failed", name)
        return [Section(f"{name}: not drawn", [f"The builder failed: `{type(exc).__name__}: {exc}` "
                                               f"(traceback in the log). Rerun with "
                                               f"`python -m analysis.report {out} --figures {name}`."])]


def readable(table: pd.DataFrame) -> pd.DataFrame:
    """A table as report.md prints it (its CSV keeps every column as it is): ``system_options``
    reduced to the options in which one system's rows differ
    (:func:`analysis.summary.options_that_differ`), preceded by the task settings in which the
    rows differ and no column shows (:func:`analysis.summary.settings_that_differ`: rows that
    would else read alike, e.g. before and after fine-tuning); the column is gone when they
    differ in none; and ``run_dir`` (a folder path: provenance, kept in the CSV) left out."""
    from .summary import options_that_differ, settings_that_differ

    settings = settings_that_differ(table)          # "" everywhere without run_dir
    if "system_options" in table:
        at = table.columns.get_loc("system_options")
        options = options_that_differ(table.system_options, table.system if "system" in table else None,
                                      columns=set(table.columns))
        table = table.drop(columns=["system_options"])
    else:                                           # one config per system: the settings go last
        at = table.columns.get_loc("run_dir") if "run_dir" in table else len(table.columns)
        options = pd.Series("", index=table.index)
    options = pd.Series([", ".join(p for p in parts if p) for parts in zip(settings, options)], index=table.index)
    if (options != "").any():
        table = table.copy()
        table.insert(at, "options", options)
    if "run_dir" in table:
        table = table.drop(columns=["run_dir"])
    return table


def slug(name: str) -> str:
    """A file name for a table's name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def section_lines(sec: Section, out: Path, figure_dir: str = "") -> list[str]:
    """One section as Markdown lines (its tables also written as CSV into ``out``);
    ``figure_dir``: the prefix of figure links (report.md: none, beside the figures and
    their PDF copies)."""
    lines = [f"## {sec.title}", ""]
    for para in sec.text:
        lines += [para, ""]
    for name, table in sec.tables:
        table.to_csv(out / f"{slug(name)}.csv", index=False)
        lines += [f"**{name}** (`{slug(name)}.csv`)", "",
                  readable(table).to_markdown(index=False, floatfmt=".4g") if not table.empty else "(empty)", ""]
    for name, table in sec.data:
        table.to_csv(out / f"{slug(name)}.csv", index=False)
        lines += [f"**{name}**: {len(table)} rows in [{slug(name)}.csv]({figure_dir}{slug(name)}.csv), drawn in "
                  "the figure.", ""]
    for fig in sec.figures:
        if Path(fig).suffix == ".png":
            png, pdf = Path(fig).name, Path(fig).with_suffix(".pdf").name
            lines += [f"![{Path(fig).stem}]({figure_dir}{png})" + ("" if figure_dir else f" (also `{pdf}`)"), ""]
    return lines


def render(sections: list[Section], out: Path, title: str) -> Path:
    """Writes each table as CSV and everything as report.md; returns its path."""
    lines = [f"# {title}", ""]
    for sec in sections:
        lines += section_lines(sec, out)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
