"""The systems under test: every conf/system/*.yaml, with its dispatcher class."""
from pathlib import Path

import yaml

from occult.validate import import_object, system_options

CONF = Path(__file__).resolve().parent.parent / "conf" / "system"


def system_configs() -> dict:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(CONF.glob("*.yaml"))}


def exact_systems() -> dict:
    """Expert-parallel systems that claim exact top-k MoE with their default options:
    name -> (class path, options). The reference (no dispatcher) is what they are checked against."""
    out = {}
    for name, cfg in system_configs().items():
        cls = import_object(cfg["_target_"])
        if getattr(cls, "exact", True) and getattr(cls, "expert_parallel", True):
            out[name] = (cfg["_target_"], system_options(cfg))
    return out
