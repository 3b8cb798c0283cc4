"""The schemas of the run's model, cluster and pre-training configs (``conf/model``,
``conf/cluster``, the top-level ``pretrain`` fields): every field and its default declared
here, once. They import nothing of the project, so every level reads them:
:mod:`occult.config` puts them in Hydra's ConfigStore, and :func:`typed` gives code below the
runner a typed config from a partial one (a model YAML as written, a test's dict).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from .columns import later


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


def typed(schema: type, conf):
    """``conf`` (a ``schema`` instance, a dict or a DictConfig, partial or whole) as a
    structured config of ``schema``: the fields it lacks at their declared defaults (a typed
    instance is returned as it is)."""
    if isinstance(conf, schema):
        return conf
    if isinstance(conf, DictConfig) and OmegaConf.get_type(conf) is schema:
        return conf
    return OmegaConf.merge(OmegaConf.structured(schema), conf)


def plain(conf) -> dict:
    """``conf`` (a typed config, a DictConfig or a dict) as plain containers, resolved."""
    return OmegaConf.to_container(OmegaConf.create(conf), resolve=True)


def field_default(schema: type, name: str):
    """The default of field ``name`` of the dataclass ``schema`` (declared there, once)."""
    f = {f.name: f for f in dataclasses.fields(schema)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
