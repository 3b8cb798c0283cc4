"""Building the paper's models from config: transformers classes, checkpoints, and the
expert-parallel version of a model for one rank.

* :func:`hf_config` turns a ``model`` config into the family's transformers config.
* :func:`init_model` builds it with seeded random weights; :func:`save_checkpoint` and
  :func:`load_checkpoint` move it through a local folder (config.json + safetensors;
  never pickle, never the network).
* :func:`to_expert_parallel` swaps every MoE block for an :class:`EPMoEBlock` that holds
  only this rank's experts; everything else stays replicated.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..ep import GateRule, Placement
from ..schemas import ModelConf, typed
from .ep_block import EPMoEBlock
from .families import Family, family_of
from .shortcut import ShortcutMLP, connect_shortcuts


class CheckpointError(RuntimeError):
    """A checkpoint folder that is missing, incomplete or does not fit the model."""


def hf_config(m, vocab_size: Optional[int] = None):
    """The transformers config of a ``model`` config (typed, a DictConfig or a dict: the
    fields it lacks at their defaults, :class:`occult.schemas.ModelConf`)."""
    m = typed(ModelConf, m)
    fam = family_of(m.family)
    E, K, D, F = m.num_experts, m.top_k, m.hidden_size, m.expert_ffn_size
    heads = m.num_heads
    common = dict(vocab_size=vocab_size or m.vocab_size, hidden_size=D,
                  num_hidden_layers=m.num_layers, num_attention_heads=heads,
                  num_key_value_heads=heads, max_position_embeddings=m.max_position,
                  num_experts_per_tok=K, norm_topk_prob=m.norm_topk_prob,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    first_dense = m.first_k_dense
    shared, shared_F = m.num_shared_experts, m.shared_expert_ffn_size
    dense_F = m.dense_ffn_size
    rsf, n_group, topk_group = m.routed_scaling_factor, m.n_group, m.topk_group
    if fam.name in ("olmoe", "mixtral", "gpt_oss"):
        if shared or first_dense:
            raise ValueError(f"model: {fam.name} has no shared experts and no dense layers "
                             "(num_shared_experts and first_k_dense must be 0)")
        kw = dict(intermediate_size=F, num_experts=E) if fam.name == "olmoe" else \
            dict(intermediate_size=F, num_local_experts=E)
    elif fam.name in ("qwen2_moe", "scmoe", "qwen3_5_moe"):
        if shared != 1:
            raise ValueError(f"model.num_shared_experts={shared}: {fam.name} has exactly one gated shared expert")
        kw = dict(num_experts=E, moe_intermediate_size=F, shared_expert_intermediate_size=shared_F)
        if fam.name in ("qwen2_moe", "scmoe"):
            kw.update(intermediate_size=dense_F or shared_F, decoder_sparse_step=1,
                      mlp_only_layers=list(range(first_dense)))
        elif first_dense:
            raise ValueError("model.first_k_dense: Qwen3.5-MoE has no dense layers (must be 0)")
    elif fam.name == "qwen3_moe":
        if shared:
            raise ValueError("model.num_shared_experts: Qwen3-MoE has no shared experts (must be 0)")
        kw = dict(num_experts=E, moe_intermediate_size=F, intermediate_size=dense_F or 4 * D, decoder_sparse_step=1,
                  mlp_only_layers=list(range(first_dense)))
    elif fam.name == "deepseek_v4":
        layers = m.num_layers
        kw = dict(n_routed_experts=E, moe_intermediate_size=F, n_shared_experts=shared,
                  routed_scaling_factor=rsf, scoring_func=m.scoring_func,
                  mlp_layer_types=["hash_moe" if i < min(3, layers - 1) else "moe" for i in range(layers)])
    else:   # deepseek_v2 (DeepSeek-MoE) and deepseek_v3 (DeepSeek-V3, Kimi K2)
        kw = dict(n_routed_experts=E, moe_intermediate_size=F, n_shared_experts=shared,
                  intermediate_size=dense_F or 4 * D, first_k_dense_replace=first_dense,
                  routed_scaling_factor=rsf, n_group=n_group, topk_group=topk_group,
                  head_dim=m.hf_overrides.get("qk_rope_head_dim", 64))
        if fam.name == "deepseek_v2":
            kw.update(topk_method="greedy", n_group=None, topk_group=None)
    kw = {**common, **kw, **dict(m.hf_overrides)}
    return fam.config_class()(**kw)


class RouterTap:
    """Forward hooks on every MoE block's router: keeps (logits_TE, topk_ids_TK, topk_weights_TK)
    per call (the gate's own output)."""

    def __init__(self, model, family):
        self.calls = []
        self.handles = [block.gate.register_forward_hook(self._hook) for _, _, block in moe_blocks(model, family)]

    def _hook(self, module, inputs, output):
        self.calls.append((output[0], output[2], output[1]))

    def remove(self):
        for h in self.handles:
            h.remove()


def init_model(family: Family, config, seed: int) -> nn.Module:
    """The family's causal LM with seeded random weights, float32, on the host, in eval mode."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = family.model_class()(config).float()
    return _wired(model, family).eval()


def _wired(model: nn.Module, family: Family) -> nn.Module:
    """The family's data flow beyond its transformers class (ScMoE's shortcut)."""
    if family.shortcut:
        connect_shortcuts(model, family.is_moe_block)
    return model


def _mlp_slot(layer: nn.Module) -> nn.Module:
    """What fills a decoder layer's MLP slot: its MoE block, also inside a shortcut wrapper."""
    return layer.mlp.moe if isinstance(layer.mlp, ShortcutMLP) else layer.mlp


def save_checkpoint(model: nn.Module, path, extra: Optional[dict] = None) -> Path:
    """Writes config.json + model.safetensors (and ``occult.json`` with ``extra``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    wrapped = [(layer, layer.mlp) for layer in model.model.layers if isinstance(layer.mlp, ShortcutMLP)]
    for layer, mlp in wrapped:          # the transformers class's own weight names
        layer.mlp = mlp.moe
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        for layer, mlp in wrapped:
            layer.mlp = mlp
    if extra is not None:
        (path / "occult.json").write_text(json.dumps(extra, indent=2, sort_keys=True))
    return path


def load_checkpoint(family: Family, path) -> nn.Module:
    """Loads a local checkpoint folder with safetensors only; a missing folder, missing
    weights or tensors that do not fit the config are a :class:`CheckpointError` naming
    the file and the tensor."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model.path={path}: no config.json there")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"model.path={path}: no *.safetensors file (other weight formats are not "
                              "loaded: they would need unpickling)")
    cls = family.model_class()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()   # P ranks load at once: one bar each would fill the log
    try:
        with torch.device("cpu"):
            model, info = cls.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                              output_loading_info=True, dtype=torch.float32)
    except Exception as exc:  # transformers raises several types for a bad file
        raise CheckpointError(f"model.path={path}: cannot load {[w.name for w in weights]}: {exc}") from exc
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        found = info.get(kind) or []
        if found:
            problems.append(f"{kind.replace('_', ' ')}: {sorted(map(str, found))[:8]}")
    if problems:
        raise CheckpointError(f"model.path={path} ({', '.join(w.name for w in weights)}) does not fit "
                              f"the {family.model_cls} config: " + "; ".join(problems))
    return _wired(model, family).eval()


def moe_blocks(model: nn.Module, family: Family) -> list:
    """``(layer_idx, parent_layer, block)`` for every MoE block of the model."""
    return [(i, layer, _mlp_slot(layer)) for i, layer in enumerate(model.model.layers)
            if family.is_moe_block(_mlp_slot(layer))]


def to_expert_parallel(model: nn.Module, family: Family, make_dispatcher: Callable[[int], object],
                       rule: Optional[GateRule] = None) -> nn.Module:
    """Replaces every MoE block by an :class:`EPMoEBlock` (in place); ``make_dispatcher(layer_idx)``
    gives the layer's dispatcher (which carries its placement); ``rule``: the model's gate rule
    (:func:`occult.models.families.gate_rule`; default softmax top-k)."""
    for layer_idx, layer, block in moe_blocks(model, family):
        ep_block = EPMoEBlock(block, family, make_dispatcher(layer_idx), layer_idx, rule)
        if isinstance(layer.mlp, ShortcutMLP):
            layer.mlp.moe = ep_block
        else:
            layer.mlp = ep_block
    return model


def contiguous_placements(model: nn.Module, family: Family, world_size: int) -> dict:
    return {i: Placement.contiguous(block.experts.gate_up_proj.shape[0], world_size)
            for i, _, block in moe_blocks(model, family)}
