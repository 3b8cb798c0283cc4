"""Imports point down. Every import in the project's Python files (module level and inside
functions) is parsed; an import from a module to one above it fails the test.

The intended order, top (entry points) to bottom (the neutral core and below); a module
may import its own level and any level below:

  0  run.py, occult.main, hydra_plugins, Hydra entry point and sweeper; the GPU check
     occult.gpu_check, its steps (occult.gpu_steps), occult.gpu_wheels
  1  analysis                            reads result tables: reports, figures, cost model
  2  occult.runner, occult.cli,          compose -> validate -> launch -> write; the
     occult.validate, occult.config,     capability table and the combination matrix
     occult.capability_table, occult.matrix
  3  occult.tasks, occult.dist           what runs on the ranks, and starting them
  4  occult.models, occult.parity,       whole models, the parity check, data, memory
     occult.data, occult.memory
  5  baselines, occult.collab            the systems (Occult's method is one of them)
  6  occult.pruning, occult.placement,   pieces of the method, result files
     occult.kernels, occult.records,
     occult.routing_traces
  7  occult.ep                           the neutral core: knows no system by name
  8  occult.errors, occult.synthetic,    below everything (occult.columns: how a schema
     occult.columns                      field declares a setting column or a later key)

And rules that the order alone does not say: ``analysis`` never starts ranks (it does
not import the launcher, the runner, the tasks or the parity runs), and the method
(``occult.collab``) does not import tasks, models or data (router profiling is a task).

No circles between files either, within a level too: the imports between the project's
files (lazy ones inside functions included; those under ``if TYPE_CHECKING:``, which
never run, excluded) form no cycle.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LEVELS = {
    "run": 0, "hydra_plugins": 0, "occult.gpu_check": 0, "occult.gpu_steps": 0, "occult.gpu_wheels": 0, "occult.main": 0,
    "analysis": 1,
    "occult.runner": 2, "occult.cli": 2, "occult.validate": 2, "occult.config": 2,
    "occult.capability_table": 2, "occult.matrix": 2,
    "occult.tasks": 3, "occult.dist": 3,
    "occult.models": 4, "occult.parity": 4, "occult.data": 4, "occult.memory": 4,
    "baselines": 5, "occult.collab": 5,
    "occult.pruning": 6, "occult.placement": 6, "occult.kernels": 6, "occult.records": 6,
    "occult.routing_traces": 6, "occult.workloads": 6,
    "occult.ep": 7,
    "occult.errors": 8, "occult.synthetic": 8, "occult.columns": 8,
}
FORBIDDEN = {   # importer prefix -> imported prefixes it must not use, whatever the levels say
    "analysis": ("occult.dist", "occult.runner", "occult.cli", "occult.tasks", "occult.parity"),
    "occult.collab": ("occult.tasks", "occult.models", "occult.data"),
}
SOURCES = ["run.py", "hydra_plugins", "analysis", "occult", "baselines"]


def level_of(module: str):
    """The level of a project module (longest matching prefix), None for third-party ones."""
    if module == "occult":
        return LEVELS["occult.errors"]      # the package's __init__: imports nothing of its own
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LEVELS:
            return LEVELS[key]
    if parts[0] in ("occult", "analysis", "baselines", "hydra_plugins", "run"):
        raise AssertionError(f"module {module} has no level in tests/test_imports.py: place it")
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(module: str, source: str, is_package: bool = False) -> list:
    """Every project module ``module``'s source imports (absolute names)."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append(target)
            out += [f"{target}.{a.name}" for a in node.names]     # `from pkg import submodule`
    return out


def violations(module: str, source: str, is_package: bool = False) -> list:
    """``importer -> imported`` arrows of ``source`` that point up or break a rule."""
    mine = level_of(module)
    bad = []
    for target in imports_of(module, source, is_package):
        try:
            theirs = level_of(target)
        except AssertionError:
            theirs = None          # `from pkg import name`: a name, not a module
        if theirs is None:
            continue
        rules = [bad_prefix for prefix, banned in FORBIDDEN.items() if module.startswith(prefix)
                 for bad_prefix in banned if target == bad_prefix or target.startswith(bad_prefix + ".")]
        if theirs < mine or rules:
            bad.append(f"{module} (level {mine}) -> {target} (level {theirs})")
    return sorted(set(bad))


def _resolved(package: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative ones resolved in ``package``)."""
    if not node.level:
        return node.module
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def run_time_imports(module: str, source: str, modules, is_package: bool = False) -> set:
    """The project files (names in ``modules``) that ``module``'s source imports when it
    runs: module level and inside functions, not under ``if TYPE_CHECKING:``.
    ``from pkg import sub`` is an arrow to ``pkg.sub`` when that is a file, else to ``pkg``."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node):
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node):
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node):
            target = _resolved(package, node)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs if len(subs) == len(node.names) else [target, *subs])

    Visitor().visit(ast.parse(source))
    return {m for m in found if m in modules and m != module}


def circles(graph: dict) -> list:
    """Every strongly connected set of two or more modules of ``{module: imported modules}``
    (Tarjan's algorithm, iterative), each as one cycle ``a -> b -> ... -> a``."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                members = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    members.add(w)
                    if w == v:
                        break
                if len(members) > 1:
                    found.append(_cycle_through(v, members, graph))
    return found


def _cycle_through(start: str, members: set, graph: dict) -> str:
    """One cycle from ``start`` back to itself inside ``members`` (breadth first), as text."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & members):
            if w == start:
                return " -> ".join(path + [start])
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return " -> ".join(sorted(members))


def import_graph(overrides: dict = None) -> dict:
    """``{module: project modules it imports at run time}`` of every project file;
    ``overrides``: ``{module: source}`` to use instead of (or beside) the files."""
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in project_files()}
    for module, source in (overrides or {}).items():
        sources[module] = (source, sources.get(module, ("", False))[1])
    return {m: run_time_imports(m, src, sources, pkg) for m, (src, pkg) in sources.items()}


def project_files() -> list:
    files = []
    for name in SOURCES:
        p = ROOT / name
        files += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return files


def test_every_import_points_down():
    bad = []
    for path in project_files():
        bad += violations(module_name(path), path.read_text(), path.name == "__init__.py")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_no_circle_between_files():
    found = circles(import_graph())
    assert not found, "import circles (lazy imports included):\n" + "\n".join(found)


def _with_line(module: str, line: str) -> dict:
    """``module``'s source with ``line`` appended inside a function (a lazy import)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    return {module: path.read_text() + f"\n\ndef _put_back():\n    {line}\n"}


@pytest.mark.parametrize("module, line", [
    ("occult.ep.payload", "from .system import SystemConfig"),          # the config back in the codec
    ("analysis.calibration", "from .figures.costmodel_check import build"),   # the fit reaching the check
    ("analysis.pricing", "from .projection import project_run"),        # pricing <-> projection
    ("analysis.sections", "from .figures.fig3_lcc import build"),       # the lookup importing builders
])
def test_the_circle_check_fails_on_each_circle_put_back(module, line):
    """Each circle the issue removed is caught when an arrow of it is put back (lazily)."""
    assert circles(import_graph(_with_line(module, line))), f"{module}: {line} put back, and no circle found"


def test_circles_on_a_hand_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == ["a -> b -> c -> a"]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module, source", [
    ("occult.ep.experts", "from ..kernels import use_triton"),                # the core knowing Occult's kernels
    ("occult.ep.experts", "from ..collab.experts import GatheredRows"),
    ("occult.collab.variants", "from ..tasks.pretrain import RouterTap"),     # the method running a task
    ("occult.collab.variants", "from ..models.build import moe_blocks"),
    ("occult.collab.variants", "from ..data.batches import batch_iterator"),
    ("analysis.figures.bench", "from occult.dist import launch"),             # analysis starting ranks
    ("analysis.figures.placement_study", "from occult.tasks.model import setup"),
    ("occult.runner", "from analysis.report import write_report"),            # the runner writing reports
])
def test_the_check_fails_on_each_arrow_put_back(module, source):
    """Each arrow the house issue removed is caught when it is put back."""
    assert violations(module, f"def f():\n    {source}\n")
