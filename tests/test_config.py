"""Composition with the real conf/ folder, and validation errors that name the field."""
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from occult.config import register
from occult.validate import ConfigError, validate

CONF = str(Path(__file__).resolve().parent.parent / "conf")
register()


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_default_config_is_valid():
    cfg = cfg_with()
    assert cfg.system.name == "naive" and cfg.task.name == "layer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validate(cfg)


@pytest.mark.parametrize("name", [p.stem for p in (Path(CONF) / "cluster").glob("cpu*.yaml")])
def test_cluster_sets_world_size(name):
    assert cfg_with(f"cluster={name}").cluster.world_size == int(name[3:])


def test_misspelt_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as err:
        cfg_with("model.topk=2")
    assert "topk" in str(err.value.__cause__ or err.value)
    with pytest.raises(ConfigCompositionException):
        cfg_with("model.top_k=two")          # typed schema


def test_unknown_system_lists_the_choices():
    with pytest.raises(ConfigCompositionException) as err:
        cfg_with("system=nonesuch")
    assert "naive" in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.num_experts=8", "model.top_k=9"], r"model.top_k=9: allowed values are 1..model.num_experts=8"),
    (["model.top_k=0"], r"model.top_k=0"),
    (["model.num_experts=60", "model.top_k=4", "cluster=cpu8"],
     r"model.num_experts=60 is not divisible by the world size 8 .*Allowed world sizes: \[1, 2, 3, 4, 5, 6, 10"),
    (["task.routing=gauss"], r"task.routing='gauss': allowed values are \['router', 'uniform', 'zipf', 'imbalance', 'incast', 'trace'\]"),
    (["task.iters=0"], r"task.iters=0"),
    (["cluster.backend=mpi"], r"cluster.backend='mpi': allowed values"),
    (["system._target_=baselines.naive.Nope"], r"system=naive: cannot import"),
    (["+system.flavour=x"], r"system.flavour: unknown option of system 'naive'; allowed: \['payload', "
                            r"'combine_payload', 'replica_policy', 'slack', 'dispatch_mode', 'max_tokens_per_rank'\]"),
    (["system=reference"], r"system=reference has no expert-parallel dispatcher; task=layer needs one. "
                           r"Expert-parallel systems: \[.*'deepspeed', 'exflow', .*'lsh', 'luffy', 'megablocks', 'naive', 'occult'"),
    (["cluster=cpu4", "cluster.devices_per_node=3"],
     r"cluster.devices_per_node=3: allowed values are 0 \(one node\) or a divisor of cluster.world_size=4: \[1, 2, 4\]"),
    (["system=reference", "task=finetune", "model=olmoe_proxy"], r"task=finetune needs one"),
    (["system=reference", "task=prefill", "model=olmoe_proxy", "+system.flavour=x"],
     r"system.flavour: unknown option of system 'reference'; allowed: \[\]"),
    # today's models: the router's group limit, a family's fixed rule, the world, whole models
    (["model=deepseek_v3_proxy", "model.topk_group=9"], r"model.topk_group=9: allowed values are 1..model.n_group=8"),
    (["model=deepseek_v3_proxy", "model.n_group=64", "model.topk_group=1"],
     r"model.topk_group=1: 1 group\(s\) x 4 experts cannot hold model.top_k=8; allowed values are 2..64"),
    (["model=deepseek_v3_proxy", "model.n_group=7"], r"model.n_group=7: allowed values divide model.num_experts=256"),
    (["model=mixtral_proxy", "model.norm_topk_prob=false"],
     r"model.norm_topk_prob=False: the mixtral router computes only True; allowed values are \[True\]"),
    (["model=qwen3_moe_proxy", "model.bias_update_speed=0.001"],
     r"model.bias_update_speed=0.001: model.family='qwen3_moe' has no correction bias to move"),
    (["model=deepseek_v3_proxy", "task=prefill", "cluster=cpu2", "cluster.world_size=3"],
     r"model.num_experts=256 is not divisible by the world size 3"),
    (["model=gpt_oss", "task=prefill"], r"task=prefill runs a whole model; model.family=gpt_oss is refused: "),
    (["model=deepseek_v3_proxy", "system=group_limit", "system.topk_group=5"],
     r"system.topk_group=5: allowed values are 1..4 \(the world size"),
    (["model=mixtral", "system=group_limit", "system.topk_group=1", "cluster=cpu8"],
     r"system.topk_group=1: 1 device\(s\) x 1 experts cannot hold top_k=2; allowed values are 2..8"),
    (["model=scmoe_proxy", "model.num_layers=1"],
     r"^model.num_layers=1: a shortcut-connected model \(family scmoe\) feeds each MoE block from the MoE block "
     r"before it; with 1 MoE layer\(s\) there is none to feed"),
])
def test_validation_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_more_ranks_than_cores_is_a_warning(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    notes = validate(cfg_with("cluster=cpu8"))
    assert len(notes) == 1 and "more than this machine's 2 cores" in notes[0]


def test_packaging_keeps_test_tools_out_of_the_runtime_and_names_the_command():
    """pytest is the test extra's (make test installs it), not a run's dependency; the
    occult-bench command is run.py's entry point."""
    import tomllib
    project = tomllib.loads((Path(CONF).parent / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.split("=")[0].startswith("pytest")]
    assert {d.split("=")[0] for d in project["optional-dependencies"]["test"]} == {"pytest", "pytest-timeout"}
    assert project["scripts"] == {"occult-bench": "occult.main:console"}
