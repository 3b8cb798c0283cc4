"""The three paper models as transformers model families, and how the harness reads
their MoE blocks.

Each family names its transformers classes and says how its MoE block is laid
out: the router module (``block.gate``, kept as it is: the model's own gate
rule), fused experts ``experts.gate_up_proj`` [E, 2F, D] and
``experts.down_proj`` [E, D, F], and how the shared experts join the output.

Shapes: E experts, D hidden, F expert FFN size, T tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as nnf
import transformers


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: str
    model_cls: str
    moe_block_cls: str
    shared_output: Optional[Callable]      # (block, x_TD) -> [T, D], or None
    deviations: str = ""

    def config_class(self):
        return getattr(transformers, self.config_cls)

    def model_class(self):
        return getattr(transformers, self.model_cls)

    def is_moe_block(self, module) -> bool:
        return type(module).__name__ == self.moe_block_cls


def _qwen_shared(block, x_TD: torch.Tensor) -> torch.Tensor:
    """Qwen1.5-MoE: one gated shared expert, sigmoid(g(x)) * shared(x)."""
    return nnf.sigmoid(block.shared_expert_gate(x_TD)) * block.shared_expert(x_TD)


def _deepseek_shared(block, x_TD: torch.Tensor) -> torch.Tensor:
    """DeepSeek-MoE: the shared experts as one ungated MLP (n_shared * F wide)."""
    return block.shared_experts(x_TD)


FAMILIES = {
    "olmoe": Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "OlmoeSparseMoeBlock", None),
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeSparseMoeBlock",
                        _qwen_shared),
    "deepseek_v2": Family(
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Moe", _deepseek_shared,
        deviations=(
            "DeepSeek-MoE-16B is not a native transformers class; DeepseekV2 is the closest: the same "
            "MoE block (64 routed experts, top-6 softmax gate without renormalisation, 2 ungated "
            "shared experts, dense first layer via first_k_dense_replace=1, routed_scaling_factor=1), "
            "but multi-head latent attention (MLA) in place of DeepSeek-MoE's plain multi-head "
            "attention. Expert-parallel communication does not depend on the attention."),
    ),
}


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"model.family={model_type!r}: allowed values are {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def expert_weights_from_block(block) -> dict:
    """The block's fused experts in the harness's layout (x @ W):
    {'w_gate': [E, D, F], 'w_up': [E, D, F], 'w_down': [E, F, D]} (views where possible)."""
    gate_up_E2FD, down_EDF = block.experts.gate_up_proj, block.experts.down_proj
    F = gate_up_E2FD.shape[1] // 2
    return {"w_gate": gate_up_E2FD[:, :F, :].transpose(1, 2), "w_up": gate_up_E2FD[:, F:, :].transpose(1, 2),
            "w_down": down_EDF.transpose(1, 2)}


def hf_expert_grads(w_gate_grad_EDF, w_up_grad_EDF, w_down_grad_EFD) -> tuple:
    """The harness-layout expert gradients back in the transformers layout:
    (gate_up_proj [E, 2F, D], down_proj [E, D, F])."""
    gate_up = torch.cat([w_gate_grad_EDF.transpose(1, 2), w_up_grad_EDF.transpose(1, 2)], dim=1)
    return gate_up, w_down_grad_EFD.transpose(1, 2)
