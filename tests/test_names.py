"""Every name a project file reads is bound somewhere in that file (an import, an
assignment, a definition, an argument) or is a builtin: a module that uses ``torch``
without importing it fails here, not on the machine where that line first runs (it did:
tests/test_baselines_capacity.py, only once megablocks was installed)."""
import ast
import builtins

import pytest

from test_imports import ROOT, project_files

EXTRA = ["tests"]


def bound_names(tree: ast.AST) -> set:
    """Every name the file binds, in any scope."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            out.add(node.name)
    return out


def unbound_names(source: str) -> list:
    """Names read but bound nowhere in ``source`` (and not builtins)."""
    tree = ast.parse(source)
    known = bound_names(tree) | set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__"}
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                   and n.id not in known})


def test_every_name_read_is_bound():
    files = project_files() + sorted(p for d in EXTRA for p in (ROOT / d).rglob("*.py"))
    bad = {str(p.relative_to(ROOT)): names for p in files if (names := unbound_names(p.read_text()))}
    assert not bad, f"names read but never bound: {bad}"


@pytest.mark.parametrize("source, names", [
    ("def f():\n    return torch.zeros(1)\n", ["torch"]),               # the capacity test's fault
    ("import torch\ndef f():\n    return torch.zeros(1)\n", []),
    ("def f(x):\n    return [y for y in x if z]\n", ["z"]),
])
def test_the_check_finds_a_name_never_bound(source, names):
    assert unbound_names(source) == names
