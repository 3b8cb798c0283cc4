"""Structured config schemas (Hydra ConfigStore), so a misspelt key fails at compose time.

The YAML files under ``conf/`` fill these in; ``system`` is free-form because
each system's options are the keyword arguments of its dispatcher class
(checked against the class signature in :mod:`occult.validate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConf:
    name: str = MISSING
    num_experts: int = MISSING          # E, routed experts per MoE layer
    top_k: int = MISSING                # K
    hidden_size: int = MISSING          # D
    expert_ffn_size: int = MISSING      # F
    norm_topk_prob: bool = False        # renormalise the top-k gate weights
    dtype: str = "float32"
    # whole models (tasks prefill / decode / train / pretrain); unused by task=layer
    family: str = ""                    # olmoe | qwen2_moe | deepseek_v2
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
    init: str = "trained"               # proxies: trained (cached; pre-trained first if missing) | random


@dataclass
class TaskConf:
    name: str = MISSING
    entry: str = MISSING                # dotted path of the rank function
    tokens_per_rank: int = 512          # T
    routing: str = "uniform"            # router | uniform | zipf
    zipf_s: float = 1.2                 # skew of task.routing=zipf
    warmup: int = 2
    iters: int = 5
    backward: bool = True
    check_parity: bool = True           # compare with the reference before timing
    sync_collectives: bool = False      # barrier before each collective: a2a_time = transfer only
    calibrate: bool = False             # task=layer: measure the loopback first (cost-model check)
    expert_parallel_only: bool = False  # the task needs a dispatcher (task=layer)
    whole_model: bool = False           # the task runs a whole model (needs model.family)
    prepare: str = ""                   # dotted path run in the launching process first (pre-training)
    # whole-model tasks
    batch_size: int = 4                 # sequences per rank
    seq_len: int = 128
    new_tokens: int = 16                # decode
    corpus: str = "shakespeare"         # text the batches come from
    split: str = "validation"
    tokenizer_vocab: int = 4096
    lr: float = 1e-3                    # train / pretrain / finetune
    steps: int = 0                      # pretrain / finetune
    balance_coef: float = 0.0           # load-balancing loss weight
    eval_every: int = 0
    save_routing: bool = False          # write routing.parquet (+ router logits) per run


@dataclass
class PretrainConf:
    """How CPU proxies are pre-trained (the cached checkpoint every proxy task uses)."""
    steps: int = 400
    lr: float = 3e-3
    batch_size: int = 16
    seq_len: int = 128
    balance_coef: float = 0.1
    tokenizer_vocab: int = 4096
    corpus: str = "shakespeare"
    eval_every: int = 250


@dataclass
class ClusterConf:
    name: str = MISSING
    world_size: int = MISSING           # P
    backend: str = "gloo"               # gloo (CPU) | nccl (GPU, under torchrun)
    threads_per_rank: int = 0           # 0: cores // world_size
    run_timeout_s: float = 3600.0       # whole run
    collective_timeout_s: float = 300.0
    # projection profiles (conf/cluster/sim_*.yaml): read by analysis.costmodel, refused by
    # validation as a cluster to run on. Bandwidths in GB/s per device and direction.
    simulated: bool = False
    devices_per_node: int = 0           # 0: every device in one node
    intra_node_GBps: float = 0.0        # device <-> device within a node (nominal)
    intra_node_latency_us: float = 0.0  # per all-to-all call within a node
    inter_node_GBps: float = 0.0        # one NIC, per direction (nominal)
    nics_per_node: int = 0              # NICs a node's devices share for inter-node traffic
    inter_node_latency_us: float = 0.0  # per all-to-all call that crosses nodes
    device_TFLOPs: float = 0.0          # dense matmul peak per device at `dtype`
    dtype: str = ""                     # element type of projected activations (bfloat16, float32)
    link_efficiency: float = 1.0        # achieved / nominal bandwidth (an assumption unless measured)
    compute_efficiency: float = 1.0     # achieved / peak matmul throughput (idem)
    source: str = ""                    # where the numbers come from
    calibration: List[Any] = field(default_factory=list)   # measured points per world size (CPU)


@dataclass
class RunConf:
    system: Dict[str, Any] = field(default_factory=dict)
    model: ModelConf = field(default_factory=ModelConf)
    task: TaskConf = field(default_factory=TaskConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    pretrain: PretrainConf = field(default_factory=PretrainConf)
    experiment_name: str = "adhoc"      # the results column "experiment"
    seed: int = 0
    resume: bool = True                 # skip a run whose results already exist
    out_dir: Optional[str] = None       # default: Hydra's output folder
    report: str = ""                    # figure builders of an experiment's report (analysis.figures)


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConf)
