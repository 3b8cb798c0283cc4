"""Structured config schemas (Hydra ConfigStore), so a misspelt or mistyped key fails at
compose time.

The YAML files under ``conf/`` fill these in. Every group has its schema:

* ``system``: each system's own typed config, the ``Config`` dataclass nested in its
  class (:class:`occult.ep.system.SystemConfig`). :func:`register` finds the classes
  from the ``_target_`` of every ``system/*.yaml`` in the config folders and stores
  their schemas as ``system_schema/<name>``; ``conf/config.yaml`` merges the chosen
  system's schema under its YAML (``system_schema@system: ${system}``).
* ``task``: each task's own typed options, a subclass of
  :class:`occult.tasks.schema.TaskConf`, its module's ``Config``, named by the ``schema`` of its ``task/*.yaml``
  (stored as ``task_schema/<name>``; ``conf/config.yaml``: ``task_schema@task: ${task}``):
  a field the task does not read is not in its schema, so setting it fails at compose time.
* ``model``, ``cluster`` (runnable worlds), ``pretrain``: the dataclasses of
  :mod:`occult.schemas` (below every other module, so that any level reads them).
* ``profile`` (``conf/profile/sim_*.yaml``): projection profiles of clusters that are not
  here; never run on. Their schema, :class:`ProfileConf`, lives beside their one reader
  (:mod:`occult.ep.profiles`), below the systems that read profiles at run time.

The registered systems are every ``system/*.yaml`` of ``conf/`` and of the folders the
last :func:`register` added (:func:`registered_dirs`), each with its class's capability
record (:func:`system_records`). Experiments that compare every system that can do
something select them by a query on those records, resolved when the config is composed:
``${systems_with:expert_parallel, exact_backward, not shortcut_overlap, except occult_placed}``
(:func:`systems_with`; the resolved list kept in ``selected_systems``, so the run's config holds it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from . import CONF_DIR
from .columns import columns_of, later_keys_of
from .ep.profiles import ProfileConf  # noqa: F401 - the profile group's schema, with the reader below systems
from .schemas import ClusterConf, ModelConf, PretrainConf


@dataclass
class RunConf:
    system: Any = MISSING               # the system's own schema (see the module docstring)
    model: ModelConf = field(default_factory=ModelConf)
    task: Any = MISSING                 # the task's own schema (its module's Config, occult.tasks.schema)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    pretrain: PretrainConf = field(default_factory=PretrainConf)
    experiment_name: str = "adhoc"      # the results column "experiment"
    label: str = ""                     # the results column "label" (an experiment's name for a point)
    seed: int = 0
    resume: bool = True                 # skip a run whose results (of the same config) already exist
    out_dir: Optional[str] = None       # default: Hydra's output folder
    report: str = ""                    # report builders of an experiment (modules of analysis.figures)
    report_options: Dict[str, Any] = field(default_factory=dict)   # {builder: {option: value}}: its knobs
    # {name: the systems a capability query selected, comma-separated}: an experiment's
    # ``${systems_with:...}`` (see the module docstring), which its sweep's grids read; recorded
    # in run_config.json, neither hashed nor compared on resume (occult.records.RECORDED_ONLY)
    selected_systems: Dict[str, str] = field(default_factory=dict)


GROUP_SCHEMAS = {"model": ModelConf, "cluster": ClusterConf, "profile": ProfileConf}


def read_conf(group: str, name: str):
    """``conf/<group>/<name>.yaml`` through its group's schema (:data:`GROUP_SCHEMAS`;
    ``system`` and ``task``: their own typed configs; ``experiment``: the run fields it sets, in
    :class:`RunConf`): defaults filled in, a misspelt or mistyped
    field a one-line :class:`ConfigError` naming it. The one way code outside Hydra's
    composition reads a config file."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .ep.system import system_config
    from .errors import ConfigError

    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ConfigError(f"{group}={name}: no such config; available: {', '.join(names)}")
    if group == "system":
        return system_config(OmegaConf.load(path))
    if group == "task":
        from .tasks.schema import task_config
        return task_config(OmegaConf.load(path))
    if group == "experiment":      # a global delta: its run fields (report, report_options, task, ...)
        raw = OmegaConf.load(path)
        fields = {k: raw[k] for k in raw if k not in ("defaults", "hydra")}
        try:
            return OmegaConf.merge(OmegaConf.structured(RunConf), fields)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"experiment={name}: {str(exc).splitlines()[0]}") from exc
    if group not in GROUP_SCHEMAS:
        raise ConfigError(f"read_conf: group={group!r}; allowed: {sorted(GROUP_SCHEMAS) + ['experiment', 'system', 'task']}")
    try:
        return OmegaConf.merge(OmegaConf.structured(GROUP_SCHEMAS[group]), OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{group}={name}: {str(exc).splitlines()[0]}") from exc


def group_yamls(conf_dirs: Sequence[Path], group: str = "system") -> dict:
    """``{name: path}`` of every ``<group>/*.yaml`` in the config folders (the first folder
    that has a name wins, as in Hydra's search path)."""
    found: dict = {}
    for d in conf_dirs:
        for p in sorted((Path(d) / group).glob("*.yaml")):
            found.setdefault(p.stem, p)
    return found


def system_yamls(conf_dirs: Sequence[Path]) -> dict:
    """``{name: path}`` of every ``system/*.yaml`` in the config folders."""
    return group_yamls(conf_dirs, "system")


def _schema_of(path: Path):
    """The typed config class named by a system YAML's ``_target_`` (None when it cannot be
    imported: validation then reports why). A class without its own capability record
    fails here, at registration (:class:`occult.ep.capabilities.NoCapabilities`)."""
    from .ep.capabilities import NoCapabilities
    from .ep.system import import_object, system_schema
    from .errors import ConfigError

    target = (yaml.safe_load(path.read_text()) or {}).get("_target_", "")
    try:
        return system_schema(import_object(target))
    except NoCapabilities:
        raise
    except (ImportError, AttributeError, ValueError, ConfigError):
        return None


def _task_schema_of(path: Path):
    """The task schema a task YAML's ``schema`` names (None when it cannot be imported:
    validation then reports why)."""
    from .errors import ConfigError
    from .tasks.schema import task_schema

    try:
        return task_schema((yaml.safe_load(path.read_text()) or {}).get("schema", ""))
    except ConfigError:
        return None


def schemas(conf_dirs: Sequence[Path] = ()) -> dict:
    """``{group: [schema class, ...]}`` of the run's groups: the cluster's, the model's and
    pre-training's schemas, every system's and every task's (of ``conf/`` and ``conf_dirs``; one that cannot
    be imported is left out, as validation reports it)."""
    dirs = [CONF_DIR, *conf_dirs]
    found = {"system": [_schema_of(p) for p in system_yamls(dirs).values()],
             "task": [_task_schema_of(p) for p in group_yamls(dirs, "task").values()]}
    return {"cluster": [ClusterConf], "model": [ModelConf], "pretrain": [PretrainConf],
            **{group: list(dict.fromkeys(c for c in classes if c is not None)) for group, classes in found.items()}}


def later_keys() -> dict:
    """``{"<group>.<field>": value}``: the keys added after results were first written, each
    with the value configs held before it (the fields' declarations, :mod:`occult.columns`,
    over :func:`schemas` of the registered folders): a config at that value hashes as one
    without the key."""
    return _later_keys(tuple(_REGISTERED_DIRS))


def setting_columns() -> dict:
    """``{column: (group, absent value)}``: the schema fields declared as columns of every
    results row (:mod:`occult.columns`, over :func:`schemas` of the registered folders)."""
    return _setting_columns(tuple(_REGISTERED_DIRS))


@cache
def _later_keys(conf_dirs: tuple) -> dict:
    return later_keys_of(schemas(conf_dirs))


@cache
def _setting_columns(conf_dirs: tuple) -> dict:
    return columns_of(schemas(conf_dirs))


# the config folders the last register() added to conf/ (a user's, on hydra.searchpath)
_REGISTERED_DIRS: list = []
# the resolver of capability queries (conf/experiment/*.yaml)
SYSTEMS_WITH = "systems_with"


def registered_dirs() -> list:
    """``conf/`` and the folders the last :func:`register` added: where the registered
    systems' YAML files are."""
    return [CONF_DIR, *_REGISTERED_DIRS]


def system_records(conf_dirs: Optional[Sequence[Path]] = None) -> dict:
    """``{system name: Capabilities}`` of every system YAML in ``conf_dirs`` (default: the
    registered folders, :func:`registered_dirs`), sorted by name."""
    from .ep.capabilities import check_declared
    from .ep.system import import_object

    out = {}
    for name, path in sorted(system_yamls(registered_dirs() if conf_dirs is None else conf_dirs).items()):
        target = (yaml.safe_load(path.read_text()) or {}).get("_target_", "")
        out[name] = check_declared(import_object(target))
    return out


def select_systems(terms: Sequence[str], conf_dirs: Optional[Sequence[Path]] = None) -> list:
    """The registered systems (sorted by name) whose records match every term: ``<capability>``
    (the record grants it), ``not <capability>`` (it lacks it) or ``except <system>`` (left
    out by name: a system the experiment runs elsewhere, e.g. with an artifact it needs).
    A term naming no capability or no system is a one-line :class:`ConfigError`."""
    import dataclasses

    from .ep.capabilities import Capabilities
    from .errors import ConfigError

    records = system_records(conf_dirs)
    allowed = sorted(f.name for f in dataclasses.fields(Capabilities) if f.type in ("bool", "Can")) + ["slots"]
    wanted, lacked, left_out = [], [], []
    for term in (str(t).strip() for t in terms):
        word, _, rest = term.partition(" ")
        if word == "except" and rest.strip() in records:
            left_out.append(rest.strip())
        elif word == "not" and rest.strip() in allowed:
            lacked.append(rest.strip())
        elif term in allowed:
            wanted.append(term)
        else:
            raise ConfigError(f"{SYSTEMS_WITH}: {term!r}: a term is <capability>, not <capability> or except "
                              f"<system>; capabilities: {', '.join(allowed)}; systems: {', '.join(records)}")
    return [name for name, caps in records.items() if name not in left_out
            and all(caps.has(c) for c in wanted) and not any(caps.has(c) for c in lacked)]


def systems_with(*terms: str) -> str:
    """The resolver ``${systems_with:term, ...}``: :func:`select_systems`, comma-separated
    (the form a sweep's param takes)."""
    return ",".join(select_systems(terms))


def register(conf_dirs: Sequence[Path] = ()) -> None:
    """Stores the run schema, every system's schema and every task's schema (from ``conf/``
    and ``conf_dirs``, e.g. a user's folders on ``hydra.searchpath``) in Hydra's ConfigStore;
    ``conf_dirs`` become the registered folders (:func:`registered_dirs`), and the capability
    query resolver (:func:`systems_with`) is registered."""
    from omegaconf import OmegaConf

    _REGISTERED_DIRS[:] = [Path(d) for d in conf_dirs]
    OmegaConf.register_new_resolver(SYSTEMS_WITH, systems_with, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConf)
    dirs = [CONF_DIR, *conf_dirs]
    for name, path in system_yamls(dirs).items():
        schema = _schema_of(path)
        cs.store(group="system_schema", name=name, node=schema if schema is not None else {})
    for name, path in group_yamls(dirs, "task").items():
        schema = _task_schema_of(path)
        cs.store(group="task_schema", name=name, node=schema if schema is not None else {})


def searchpath_dirs(argv: Sequence[str]) -> list:
    """The local folders a command line adds with ``hydra.searchpath=[...]`` (``file://``
    entries or plain paths; ``pkg://`` entries are not folders)."""
    dirs = []
    for arg in argv:
        if not arg.startswith("hydra.searchpath="):
            continue
        value = arg.split("=", 1)[1].strip().strip("[]")
        for item in value.split(","):
            item = item.strip().strip("'\"")
            if item and not item.startswith("pkg://"):
                dirs.append(Path(item[len("file://"):] if item.startswith("file://") else item))
    return dirs
