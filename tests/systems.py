"""The systems under test: every conf/system/*.yaml (and those of extra config folders),
with its typed config."""
from pathlib import Path

import yaml

from occult.ep import system_config

CONF = Path(__file__).resolve().parent.parent / "conf" / "system"


def system(target: str, name: str = "", **options) -> dict:
    """A system's dict (what conf/system/*.yaml holds) for class ``target`` with ``options``."""
    return {"name": name or target.rsplit(".", 1)[-1], "_target_": target, **options}


def system_configs(extra_dirs=()) -> dict:
    """name -> the system's YAML (name, _target_), from conf/system and ``extra_dirs``/system."""
    found = {}
    for folder in (CONF, *(Path(d) / "system" for d in extra_dirs)):
        for p in sorted(Path(folder).glob("*.yaml")):
            found.setdefault(p.stem, yaml.safe_load(p.read_text()))
    return found


def exact_systems(extra_dirs=()) -> dict:
    """Expert-parallel systems that claim exact top-k MoE with their default options (and
    with each of their other exact paths, ``SystemConfig.other_exact_paths``), and lossy
    ones with their loss switched off (``SystemConfig.lossless_options``); a variant is
    named ``name(option=value, ...)``: name -> the system's dict. The reference (no
    dispatcher) is what they are checked against."""
    out = {}
    for name, cfg in system_configs(extra_dirs).items():
        config = system_config(cfg)
        if not config.expert_parallel:
            continue
        if config.is_exact():
            out[name] = cfg
            for path in config.other_exact_paths():
                out[_variant(name, path)] = {**cfg, **path}
            continue
        off = config.lossless_options()
        if off:
            lossless = {**cfg, **off}
            assert system_config(lossless).is_exact(), f"{name} with {off} does not say it is exact"
            out[_variant(name, off)] = lossless
    return out


def _variant(name: str, options: dict) -> str:
    return name + "(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
