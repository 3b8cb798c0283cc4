"""Each task reads the fields its schema declares, and is refused the others: at compose
time for a field it never reads (one line naming the task's fields), at validation for a
field these values leave unread. Tasks that run no top-level system refuse one given on
the command line and do not hash it."""
import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from occult.cli import describe
from occult.config import CONF_DIR, register
from occult.tasks.options import TaskConf, task_config
from occult.validate import ConfigError, available, validate

register()
# every field a task of the harness has had (the union TaskConf of before, the class
# attributes that were fields among them)
EVERY_FIELD = ["tokens_per_rank", "routing", "zipf_s", "warmup", "iters", "backward", "check_parity",
               "sync_collectives", "calibrate", "batch_size", "seq_len", "new_tokens", "corpus", "split", "lr",
               "steps", "timing_iters", "save_routing", "compare", "workload", "parity_tokens", "entry", "prepare",
               "expert_parallel_only", "whole_model",
               "optimisers", "load_caps", "swap_time_limit_s",     # the placement study's knobs, once constants
               "held_out_tokens",                                   # the placement study's held-out bound
               "trace", "source_tokens", "peer_rows",              # task=simulate's routing source and rows
               "max_over_mean", "incast_device", "incast_share",    # the load workloads (issue 26)
               "placement", "num_redundant",                        # EPLB's slot placements
               "total_tokens", "routers", "sample_layers", "synthetic_tokens",   # the scale study's worlds
               "optimiser", "load_cap", "time_limit_s",             # task=place
               "profiling_split", "affinity_weight",                # task=placement_load
               "microbatches", "grad_sync",                         # the schedules (issue 28)
               "cuda_graph",                                        # static decode in a CUDA graph
               "migration"]                                         # Luffy's sequence migration


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_every_task_has_a_schema_and_every_field_is_one_of_them():
    for name in available("task"):
        task = task_config(cfg_with(f"task={name}").task)
        assert isinstance(task, TaskConf) and task.name == name and task.entry, name
        assert set(task.option_names()) <= set(EVERY_FIELD), name


@pytest.mark.parametrize("name", available("task"))
def test_a_field_the_task_does_not_read_is_refused_in_one_line(name):
    """Every field a task does not read is refused by its schema (what composition merges
    the command line into); the first of them through Hydra's composition, for the line a
    user sees."""
    from omegaconf.errors import ConfigKeyError

    task = task_config(cfg_with(f"task={name}").task)
    fields = task.option_names()
    unread = [f for f in EVERY_FIELD if f not in fields]
    assert unread
    for field in unread:
        with pytest.raises(ConfigKeyError):
            OmegaConf.merge(OmegaConf.structured(type(task)), {"name": name, field: 1})
    with pytest.raises(ConfigCompositionException) as err:
        cfg_with(f"task={name}", f"task.{unread[0]}=1")
    assert describe(err.value) == f"task.{unread[0]}: task={name} does not read it; its fields: {', '.join(fields)}"


@pytest.mark.parametrize("overrides, line", [
    (["task=bench_model", "task.new_tokens=4"], "task.new_tokens=4: task=bench_model does not read it here "
                                                "(read only with task.workload=decode)"),
    (["task=bench_model", "task.lr=0.1"], "task.lr=0.1: task=bench_model does not read it here"),
    (["task=bench_model", "task.workload=train", "task.split=train"], "task.split='train': task=bench_model"),
    (["task=layer", "task.zipf_s=2.0"], "task.zipf_s=2.0: task=layer does not read it here (read only with "
                                        "task.routing=zipf)"),
    (["task=finetune", "task.steps=0", "task.lr=0.1"], "task.lr=0.1: task=finetune does not read it here"),
    (["task=calibrate", "task.iters=2"], "task.iters=2: must be at least 3"),
    (["task=bench_model", "task.workload=score"], "task.workload='score': allowed values are"),
    (["task=prefill", "task.microbatches=0"], "task.microbatches=0: allowed values are 1..task.batch_size=4"),
    (["task=train", "task.batch_size=2", "task.microbatches=3"],
     "task.microbatches=3: allowed values are 1..task.batch_size=2"),
    (["task=decode", "task.microbatches=2", "task.sync_collectives=true"],
     "task.sync_collectives=true: a barrier before every collective stops the micro-batches' overlap"),
    (["task=prefill", "system=pipelined", "task.microbatches=2"],
     "task.microbatches=2: system=pipelined does not co-execute micro-batches: its chunks already overlap"),
    (["task=train", "task.grad_sync=ring"], "task.grad_sync='ring': allowed values are ['end', 'overlap', 'lina']"),
])
def test_a_field_these_values_leave_unread_is_refused_at_validation(overrides, line):
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(*overrides))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


@pytest.mark.parametrize("task", ["prefill", "decode", "layer", "bench_model"])
def test_a_gradient_sync_on_a_task_that_does_not_train_is_refused_in_one_line(task):
    with pytest.raises(ConfigCompositionException) as err:
        cfg_with(f"task={task}", "task.grad_sync=lina")
    assert describe(err.value).startswith(f"task.grad_sync: task={task} does not read it; its fields: ")


def test_the_values_that_read_a_field_are_accepted():
    validate(cfg_with("task=layer", "task.routing=zipf", "task.zipf_s=2.0"))
    validate(cfg_with("task=bench_model", "model=olmoe_proxy", "task.workload=decode", "task.new_tokens=4",
                      "cluster=cpu2"))


def test_a_task_without_the_top_level_system_refuses_one_and_does_not_hash_it():
    from occult.runner import run_hashed_config
    cfg = cfg_with("task=bench", "system=occult")
    with pytest.raises(ConfigError, match=r"^system=occult: task=bench does not run the top-level system"):
        validate(cfg, ["system=occult"])
    with pytest.raises(ConfigError, match=r"^system.kernels=epd: task=bench"):
        validate(cfg_with("task=bench", "system=occult", "system.kernels=epd"), ["task.iters=2", "system.kernels=epd"])
    validate(cfg_with("task=bench"), ["task.iters=2"])
    assert not any(k.startswith("system") for k in run_hashed_config(cfg))
    assert run_hashed_config(cfg) == run_hashed_config(cfg_with("task=bench"))      # the system is not the run's
    assert any(k.startswith("system.") for k in run_hashed_config(cfg_with("task=layer")))


def test_a_tasks_columns_say_when_it_has_no_such_field():
    from occult.runner import run_context
    layer = run_context(cfg_with("task=layer"), {}, "d")
    assert (layer["batch_size"], layer["seq_len"], layer["tokens_per_rank"], layer["routing"]) == (-1, -1, 512,
                                                                                                    "uniform")
    prefill = run_context(cfg_with("task=prefill", "model=olmoe_proxy"), {}, "d")
    assert (prefill["batch_size"], prefill["tokens_per_rank"], prefill["routing"]) == (4, -1, "router")
    bench = run_context(cfg_with("task=bench"), {}, "d")
    assert (bench["system"], bench["system_options"]) == ("", "{}")


def test_the_workload_names_are_the_workloads():
    from occult.tasks.model import WORKLOADS
    from occult.tasks.options import WORKLOAD_NAMES
    assert sorted(WORKLOAD_NAMES) == sorted(WORKLOADS)


def test_a_compared_system_takes_options_and_names_a_bad_one():
    from occult.tasks.bench import compared_system
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        occult = compared_system({"name": "occult", "kernels": "epd"}, 1)
        assert occult["kernels"] == "epd" and occult["_target_"].endswith("OccultDispatcher")
        assert compared_system("naive", 0)["name"] == "naive"
        with pytest.raises(ConfigError, match=r"^task.compare\[1\]: system.kernelz: unknown option of system 'occult'"):
            compared_system({"name": "occult", "kernelz": "epd"}, 1)
        with pytest.raises(ConfigError, match=r"^task.compare\[0\]: no system 'nonesuch'"):
            compared_system("nonesuch", 0)
        with pytest.raises(ConfigError, match=r"^task.compare\[2\]=3: each compared system is"):
            compared_system(3, 2)


def test_every_schema_field_has_a_default():
    """A task's YAML may change its defaults, never need to supply them."""
    import occult.tasks.options as options
    for cls in vars(options).values():
        if isinstance(cls, type) and issubclass(cls, TaskConf) and cls is not TaskConf:
            for f in dataclasses.fields(cls):
                if f.name not in ("name", "schema"):
                    assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, \
                        (cls.__name__, f.name)
    assert OmegaConf.structured(options.LayerTask).backward is True
