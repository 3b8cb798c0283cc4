"""The capability records: each system's record agrees with its code, and nothing probes a
system for attributes (no hasattr / getattr on a system or its config)."""
import re
from pathlib import Path

import pytest

from occult.capability_table import records
from occult.config import read_conf
from occult.ep import Dispatcher, system_config
from occult.ep.capabilities import Capabilities
from occult.ep.static import StaticConfig
from occult.ep.system import PayloadConfig, ReplicaConfig
from occult.validate import available

ROOT = Path(__file__).resolve().parent.parent


def test_a_record_has_no_defaults_and_refuses_bad_values():
    with pytest.raises(TypeError):
        Capabilities(impl="harness")          # every field must be given
    good = records()["naive"]
    import dataclasses
    with pytest.raises(ValueError, match="Capabilities.co_execution=''"):
        dataclasses.replace(good, co_execution="")          # a refusal gives its reason
    with pytest.raises(ValueError, match="Capabilities.impl='mine'"):
        dataclasses.replace(good, impl="mine")


@pytest.mark.parametrize("name", available("system"))
def test_each_record_agrees_with_its_config_and_class(name):
    config = system_config(read_conf("system", name))
    caps, cls = config.capabilities(), config.system_class()
    # a fixed-buffer dispatch needs the options of one (megablocks has them, from naive's, and refuses static)
    assert not caps.has("static_dispatch") or isinstance(config, StaticConfig)
    assert (caps.payloads != ("fp32",)) == isinstance(config, PayloadConfig)
    assert bool(caps.replica_rules) == isinstance(config, ReplicaConfig)
    if caps.expert_parallel:
        assert issubclass(cls, Dispatcher)
        assert caps.has("traffic_plan") == (cls.plan is not Dispatcher.plan), "a plan is declared iff implemented"
        assert caps.shortcut_overlap == ("start_moe" in vars(cls))
    assert config.is_exact() == caps.exact_forward


def test_validation_and_the_model_blocks_probe_no_system():
    """``hasattr`` / ``getattr(x, "name", default)`` on a system or its config is gone from
    validation, the model's blocks and the systems' configs: they read the record. (The one
    lookup left is the nested ``Config`` that makes a class a system, in ``system_schema``.)"""
    probe = re.compile(r"(?:hasattr|getattr)\((?:self|config|system|cls|t|self\.dispatcher|self\.config)\s*,"
                       r"\s*[\"'](\w+)[\"']")
    for path in ("occult/validate.py", "occult/models/ep_block.py", "occult/ep/static.py", "occult/ep/system.py",
                 "occult/tasks/simulate.py", "occult/tasks/world.py", "occult/tasks/schema.py"):
        found = [name for name in probe.findall((ROOT / path).read_text()) if name != "Config"]
        assert not found, f"{path} probes {found}"
