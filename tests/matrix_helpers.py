"""The combination matrix's cases as composed configs (one compose per task, model and world,
then the case's fields set), and the checks each case runs in a world
(:func:`matrix_world`). Importable by the tests; nothing here starts ranks."""
import copy

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from occult.config import CONF_DIR, register
from occult.matrix import NO_RULE, world_of

_BASE: dict = {}


def base_cfg(task: str, shortcut: bool, P: int):
    """The composed config of a task, model and world (cached: a compose costs ~0.3 s)."""
    key = (task, shortcut, P)
    if key not in _BASE:
        register()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            _BASE[key] = compose("config", overrides=[f"task={task}", f"cluster=cpu{P}",
                                                      f"model={'scmoe_proxy' if shortcut else 'olmoe_proxy'}"])
    return _BASE[key]


def system_dict(case: dict) -> dict:
    """The case's system: its conf/system YAML with the case's options."""
    d = yaml.safe_load((CONF_DIR / "system" / f"{case['system']}.yaml").read_text())
    if case["dispatch_mode"] != "dynamic":
        d["dispatch_mode"] = case["dispatch_mode"]
    if case["replica_rule"] != NO_RULE:
        d["replica_policy"] = case["replica_rule"]
    if case["payload"] != "fp32":
        d["payload"] = case["payload"]
    return d


def case_cfg(case: dict):
    """The composed config of a case (as ``run.py`` with :func:`occult.matrix.overrides`
    composes it; the system's options set as a dict, so that an option a system lacks is
    refused by validation, as on the command line by composition)."""
    P, G = world_of(case)
    cfg = copy.deepcopy(base_cfg(case["task"], case["shortcut"], P))
    with open_dict(cfg):
        cfg.cluster.devices_per_node = G
        cfg.system = system_dict(case)
        cfg.task.microbatches = case["microbatches"]
        if case["grad_sync"] != "end":
            cfg.task.grad_sync = case["grad_sync"]
        if case["placement"] != "contiguous":
            cfg.task.placement = "eplb"
            cfg.task.num_redundant = 4
        cfg.task.migration = case["migration"]
    return cfg
