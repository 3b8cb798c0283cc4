"""Structured config schemas (Hydra ConfigStore), so a misspelt or mistyped key fails at
compose time.

The YAML files under ``conf/`` fill these in. Every group has its schema:

* ``system``: each system's own typed config, the ``Config`` dataclass nested in its
  class (:class:`occult.ep.system.SystemConfig`). :func:`register` finds the classes
  from the ``_target_`` of every ``system/*.yaml`` in the config folders and stores
  their schemas as ``system_schema/<name>``; ``conf/config.yaml`` merges the chosen
  system's schema under its YAML (``system_schema@system: ${system}``).
* ``task``: each task's own typed options, a subclass of
  :class:`occult.tasks.options.TaskConf` named by the ``schema`` of its ``task/*.yaml``
  (stored as ``task_schema/<name>``; ``conf/config.yaml``: ``task_schema@task: ${task}``):
  a field the task does not read is not in its schema, so setting it fails at compose time.
* ``model``, ``cluster`` (runnable worlds), ``pretrain``: the dataclasses below.
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
from .columns import columns_of, later, later_keys_of
from .ep.profiles import ProfileConf  # noqa: F401 - the profile group's schema, with the reader below systems


@dataclass
class ModelConf:
    name: str = MISSING
    num_experts: int = MISSING          # E, routed experts per MoE layer
    top_k: int = MISSING                # K
    hidden_size: int = MISSING          # D
    expert_ffn_size: int = MISSING      # F
    norm_topk_prob: bool = False        # renormalise the top-k gate weights
    # the rest of the router's gate rule (occult.ep.router.GateRule): scores, the weights'
    # scale, and the group limit (the top-k inside the topk_group best of n_group groups)
    scoring_func: str = "softmax"       # softmax | sigmoid | sqrtsoftplus
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    dtype: str = "float32"
    # whole models (tasks prefill / decode / train / pretrain); unused by task=layer
    family: str = ""                    # occult.models.families.FAMILIES (olmoe, deepseek_v3, mixtral, ...)
    num_layers: int = 1
    num_heads: int = 4
    vocab_size: int = 0                 # 0: the tokenizer's vocabulary
    num_shared_experts: int = 0
    shared_expert_ffn_size: int = 0
    dense_ffn_size: int = 0             # FFN of dense layers (the first first_k_dense layers)
    first_k_dense: int = 0
    max_position: int = 2048
    hf_overrides: Dict[str, Any] = field(default_factory=dict)   # family-specific config fields
    path: Optional[str] = None          # a local checkpoint folder (config.json + safetensors)
    proxy: bool = False                 # a CPU proxy: tasks use its pre-trained checkpoint
    # how a proxy is pre-trained to balance its experts: ``switch`` (E sum_e f_e p_e over the
    # batch, weight pretrain.balance_coef) | ``sequence`` (DeepSeek-V3's sequence-wise loss
    # on normalised scores, weight balance_coef) with the correction bias moved by each
    # step's load at bias_update_speed (DeepSeek-V3's auxiliary-loss-free balancing)
    balance_loss: str = "switch"
    balance_coef: Optional[float] = None    # null: pretrain.balance_coef
    bias_update_speed: float = 0.0
    init: str = "trained"               # proxies: trained (cached; pre-trained first if missing) | random


@dataclass
class PretrainConf:
    """How CPU proxies are pre-trained (the cached checkpoint every proxy task uses), and
    the tokenizer every task on them reads (trained on ``corpus``, ``tokenizer_vocab`` ids)."""
    steps: int = 400
    lr: float = 3e-3
    batch_size: int = 16
    seq_len: int = 128
    balance_coef: float = 0.1
    tokenizer_vocab: int = 4096
    corpus: str = "shakespeare"
    eval_every: int = 250
    # the held-out figures after training (loss, accuracy, expert loads): the first N batches of
    # 16 validation windows (null: the whole validation split, about 100 batches of the shakespeare corpus)
    eval_batches: Optional[int] = later(None)
    # CPU threads of the pre-training process: float sums are ordered by the thread count,
    # so the checkpoint is bit-for-bit the same on one machine only at the same count
    threads: int = 2


@dataclass
class ClusterConf:
    """A world that runs here: P ranks as processes on this machine (or a torchrun world)."""
    name: str = MISSING
    world_size: int = MISSING           # P
    backend: str = "gloo"               # gloo (CPU) | nccl (GPU, under torchrun)
    threads_per_rank: int = 0           # 0: cores // world_size
    # CPU ranks keep freed memory for reuse and use huge pages, as a GPU's caching allocator
    # does (occult.dist.HOST_MEMORY_CACHE); false: the C library's defaults
    host_memory_cache: bool = True
    # ranks per node (0: every rank in one node): node n holds ranks [n G, (n + 1) G); systems
    # that stage their exchange by node (system=hierarchical) read it, the analysis splits
    # bytes into intra- and inter-node by it
    devices_per_node: int = later(0)
    # at world size 1, run the backend's collectives (the rank sends to itself) instead of local
    # copies: make gpu-check's one-GPU NCCL world (NCCL refuses two ranks on one GPU)
    single_rank_collectives: bool = later(False)
    run_timeout_s: float = 3600.0       # whole run
    collective_timeout_s: float = 300.0


@dataclass
class RunConf:
    system: Any = MISSING               # the system's own schema (see the module docstring)
    model: ModelConf = field(default_factory=ModelConf)
    task: Any = MISSING                 # the task's own schema (occult.tasks.options)
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
        from .tasks.options import task_config
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
    from .tasks.options import task_schema

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


@cache
def later_keys() -> dict:
    """``{"<group>.<field>": value}``: the keys added after results were first written, each
    with the value configs held before it (the fields' declarations, :mod:`occult.columns`,
    over :func:`schemas`): a config at that value hashes as one without the key."""
    return later_keys_of(schemas())


@cache
def setting_columns() -> dict:
    """``{column: (group, absent value)}``: the schema fields declared as columns of every
    results row (:mod:`occult.columns`, over :func:`schemas`)."""
    return columns_of(schemas())


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
