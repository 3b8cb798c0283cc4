"""One typed run from the command line to the ranks: the runner builds a frozen
:class:`occult.spec.RunSpec` once and hands it to every task entry ``run(ctx, spec)``, which
reads typed fields; every default is declared once, in its schema (no ``getattr`` /
``.get`` with a default on a schema field anywhere in ``occult/``)."""
import ast
import dataclasses
import inspect
import pickle
from pathlib import Path

import pytest
import yaml

from occult.config import CONF_DIR, group_yamls
from occult.ep.profiles import ProfileConf
from occult.ep.system import import_object, system_config
from occult.schemas import ClusterConf, ModelConf, PretrainConf
from occult.tasks.schema import task_schema
from test_task_options import spec_of

ROOT = Path(__file__).resolve().parent.parent
TASKS = sorted(group_yamls([CONF_DIR], "task"))


def _schema(name: str):
    return task_schema(yaml.safe_load((CONF_DIR / "task" / f"{name}.yaml").read_text())["schema"])


@pytest.mark.parametrize("name", TASKS)
def test_every_task_entry_is_run_of_ctx_and_spec(name):
    """The entry a task's schema names takes the rank context and the spec; its set-up in the
    launching process takes a spec (and returns one)."""
    schema = _schema(name)
    entry = import_object(schema.entry)
    assert list(inspect.signature(entry).parameters) == ["ctx", "spec"], (name, schema.entry)
    if schema.prepare:
        assert list(inspect.signature(import_object(schema.prepare)).parameters) == ["spec"], (name, schema.prepare)


def test_a_spec_is_frozen_typed_and_pickles():
    """What the ranks receive: typed configs (no dicts beside them), frozen, equal after a
    pickle round trip (the ranks are processes)."""
    from occult.ep.system import SystemConfig
    from occult.tasks.schema import TaskConf

    spec = spec_of("task=prefill", "model=olmoe_proxy", "system=occult", "task.microbatches=2", out_dir="/tmp/x")
    assert isinstance(spec.model, ModelConf) and isinstance(spec.cluster, ClusterConf)
    assert isinstance(spec.task, TaskConf) and isinstance(spec.system, SystemConfig)
    assert (spec.task.microbatches, spec.out_dir, spec.run_digest) == (2, "/tmp/x", "d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.replace(checkpoint="c").checkpoint == "c" and spec.checkpoint is None
    routed = spec_of("task=simulate", "model=layer_small", "task.routing=router", "task.routers=olmoe_proxy",
                     "model.num_experts=64", "model.top_k=8")
    assert isinstance(routed.routers_model, ModelConf) and routed.routers_model.name == "olmoe_proxy"
    assert pickle.loads(pickle.dumps(routed)) == routed
    bench = spec_of("task=bench")
    assert bench.system is None and bench.task.compared_names() == ["naive", "occult"]


# ---------------------------------------------------------------------------
# each default declared once: no getattr / .get with a default on a schema field
# ---------------------------------------------------------------------------


def schema_fields() -> set:
    """Every field name of the model's, the cluster's, pre-training's, a projection profile's,
    every task's and every system's schema
    (``name``, ``schema`` and ``_target_`` left out: they name, they have no default to restate)."""
    names = {f.name for cls in (ModelConf, ClusterConf, PretrainConf, ProfileConf) for f in dataclasses.fields(cls)}
    for name in TASKS:
        names |= {f.name for f in dataclasses.fields(_schema(name))}
    for path in group_yamls([CONF_DIR], "system").values():
        names |= {f.name for f in dataclasses.fields(type(system_config(yaml.safe_load(path.read_text()))))}
    return names - {"name", "schema", "_target_"}


# reads of a field's name with a default that are not reads of a schema field: (function, call) -> why
ALLOWED: dict = {}


def defaulted_reads(source: str, fields: set) -> list:
    """``(enclosing function, call source)`` of every ``getattr(x, "f", default)`` and
    ``x.get("f", default)`` (``setdefault``, ``pop`` alike) in ``source`` whose ``"f"`` is in
    ``fields``."""
    found = []

    def visit(node, where):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Call):
            fn, key = node.func, None
            if isinstance(fn, ast.Name) and fn.id == "getattr" and len(node.args) == 3:
                key = node.args[1]
            elif isinstance(fn, ast.Attribute) and fn.attr in ("get", "setdefault", "pop") and \
                    (len(node.args) == 2 or node.keywords):
                key = node.args[0] if node.args else None
            if isinstance(key, ast.Constant) and key.value in fields:
                found.append((where, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(source), "<module>")
    return found


def test_no_schema_field_is_read_with_a_default_of_its_own():
    fields = schema_fields()
    assert {"microbatches", "grad_sync", "dispatch_mode", "migration", "num_experts", "devices_per_node"} <= fields
    bad = []
    for path in sorted((ROOT / "occult").rglob("*.py")):
        for where, call in defaulted_reads(path.read_text(), fields):
            if (where, call) not in ALLOWED:
                bad.append(f"{path.relative_to(ROOT)}: {where}: {call}")
    assert not bad, "a default restated beside its schema (read the typed field):\n" + "\n".join(bad)


def test_the_default_check_finds_each_kind_of_read():
    """The check fails on each form it looks for (and passes reads without a default)."""
    fields = {"microbatches", "grad_sync"}
    src = ("def f(t, m):\n    a = t.get('microbatches', 1)\n    b = getattr(t, 'grad_sync', 'end')\n"
           "    c = m.pop('microbatches', None)\n    d = t.get('microbatches')\n    e = getattr(t, 'grad_sync')\n"
           "    g = t.get('lr', 1.0)\n")
    assert [call for _, call in defaulted_reads(src, fields)] == [
        "t.get('microbatches', 1)", "getattr(t, 'grad_sync', 'end')", "m.pop('microbatches', None)"]


def test_a_run_stored_with_the_schemas_old_home_resumes(tmp_path):
    """``task.schema`` says where a task's class lives, not what runs: not hashed, and a run
    folder whose stored config names the old ``occult.tasks.options`` class is the same run
    (skipped on resume); a real difference still refuses."""
    from occult.errors import ConfigError
    from occult.records import RESULTS_FILE, write_run_config
    from occult.runner import already_done, run_hashed_config
    from test_task_options import cfg_with

    hashed = run_hashed_config(cfg_with("task=prefill", "model=olmoe_proxy"))
    assert "task.schema" not in hashed and hashed["task.name"] == "prefill"
    write_run_config(tmp_path, {**hashed, "task.schema": "occult.tasks.options.PrefillTask"})
    (tmp_path / RESULTS_FILE).write_bytes(b"")
    assert already_done(tmp_path, hashed)
    with pytest.raises(ConfigError, match="task.iters"):
        already_done(tmp_path, {**hashed, "task.iters": 7})


# ---------------------------------------------------------------------------
# tasks shaped like systems: a module per task, none importing another
# ---------------------------------------------------------------------------


def task_modules() -> dict:
    """``{task name: the module of its schema}`` (each task module nests its ``Config``)."""
    return {name: _schema(name).__module__ for name in TASKS}


def task_imports(module: str, source: str) -> set:
    """The task modules ``source`` (of ``module``) imports, lazily too, itself left out."""
    from test_imports import imports_of

    mine = set(task_modules().values()) - {module}
    return {m for m in imports_of(module, source) if m in mine}


def test_each_task_is_a_module_with_its_config_and_no_task_module_imports_another():
    modules = task_modules()
    bad = []
    for name, module in modules.items():
        schema = _schema(name)
        assert schema.__qualname__ == "Config" and schema.entry == f"{module}.run", (name, schema)
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        bad += [f"{module} -> {m}" for m in sorted(task_imports(module, source))]
    assert not bad, "task modules importing other task modules:\n" + "\n".join(bad)
    assert len(set(modules.values())) == len(modules)            # one module per task


def test_the_task_import_check_finds_an_arrow_put_back():
    assert task_imports("occult.tasks.bench", "def f():\n    from .layer import run\n") == {"occult.tasks.layer"}
    assert task_imports("occult.tasks.bench", "from .one_layer import build_layer\n") == set()
