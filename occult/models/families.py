"""The model families as transformers classes, and how the harness reads their MoE blocks.

Each family names its transformers classes and says how its MoE block is laid
out: the router module (``block.gate``, kept as it is: the model's own gate
rule), fused experts ``experts.gate_up_proj`` [E, 2F, D] and
``experts.down_proj`` [E, D, F], and how the shared experts join the output. It
also says what its router fixes of the gate rule (:class:`occult.ep.router.GateRule`:
the model config's ``scoring_func``, ``norm_topk_prob``, ``routed_scaling_factor``,
``n_group``, ``topk_group``) and whether the router selects with a correction bias;
:func:`gate_rule` turns a model config into that rule, the one the parity gate, the
layer task and the routing transforms use.

Shapes: E experts, D hidden, F expert FFN size, T tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as nnf

from ..ep.router import GateRule
from ..schemas import ModelConf, typed


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: str
    model_cls: str
    moe_block_cls: str
    shared_output: Optional[Callable]      # (block, x_TD) -> [T, D], or None
    deviations: str = ""
    # what the family's router fixes: {model config field: the only value it takes}
    fixed_rule: tuple = ()
    correction_bias: bool = False          # the router selects with e_score_correction_bias
    # why whole-model tasks refuse the family ("" when they run it)
    whole_model_refusal: str = ""
    # ScMoE's shortcut: each MoE block's routed experts read the previous MoE block's
    # representation (occult.models.shortcut)
    shortcut: bool = False

    def config_class(self):
        import transformers
        return getattr(transformers, self.config_cls)

    def model_class(self):
        import transformers
        return getattr(transformers, self.model_cls)

    def is_moe_block(self, module) -> bool:
        return type(module).__name__ == self.moe_block_cls


def _qwen_shared(block, x_TD: torch.Tensor) -> torch.Tensor:
    """Qwen1.5-MoE: one gated shared expert, sigmoid(g(x)) * shared(x)."""
    return nnf.sigmoid(block.shared_expert_gate(x_TD)) * block.shared_expert(x_TD)


def _deepseek_shared(block, x_TD: torch.Tensor) -> torch.Tensor:
    """DeepSeek-MoE: the shared experts as one ungated MLP (n_shared * F wide)."""
    return block.shared_experts(x_TD)


SOFTMAX_UNGROUPED = (("scoring_func", "softmax"), ("n_group", 1), ("topk_group", 1))
RENORMALISED = SOFTMAX_UNGROUPED + (("norm_topk_prob", True), ("routed_scaling_factor", 1.0))

FAMILIES = {
    "olmoe": Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "OlmoeSparseMoeBlock", None,
                    fixed_rule=SOFTMAX_UNGROUPED + (("routed_scaling_factor", 1.0),)),
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeSparseMoeBlock",
                        _qwen_shared, fixed_rule=SOFTMAX_UNGROUPED + (("routed_scaling_factor", 1.0),)),
    "deepseek_v2": Family(
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Moe", _deepseek_shared,
        deviations=(
            "DeepSeek-MoE-16B is not a native transformers class; DeepseekV2 is the closest: the same "
            "MoE block (64 routed experts, top-6 softmax gate without renormalisation, 2 ungated "
            "shared experts, dense first layer via first_k_dense_replace=1, routed_scaling_factor=1), "
            "but multi-head latent attention (MLA) in place of DeepSeek-MoE's plain multi-head "
            "attention. Expert-parallel communication does not depend on the attention."),
        fixed_rule=SOFTMAX_UNGROUPED + (("norm_topk_prob", False),),
    ),
    # DeepSeek-V3 and Kimi K2: sigmoid scores, selection with the correction bias inside
    # the best groups, weights renormalised and scaled
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3MoE",
                          _deepseek_shared, fixed_rule=(("scoring_func", "sigmoid"),), correction_bias=True),
    "deepseek_v4": Family(
        "deepseek_v4", "DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4SparseMoeBlock", _deepseek_shared,
        fixed_rule=(("scoring_func", "sqrtsoftplus"), ("norm_topk_prob", True), ("n_group", 1), ("topk_group", 1)),
        correction_bias=True,
        whole_model_refusal=(
            "DeepSeek-V4's first MoE layers route by a token-id hash table and its residual is a stack of "
            "hyper-connection streams; the harness runs its router and shapes in layer tasks (task=layer, "
            "task=bench) and its routed experts with the others, not the whole model")),
    "scmoe": Family(
        "scmoe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeSparseMoeBlock", _qwen_shared, shortcut=True,
        deviations=(
            "ScMoE (shortcut-connected MoE, arXiv 2404.05019) has no transformers class: Qwen2-MoE's classes "
            "(routed experts and one gated shared expert per block) with every MoE block's routed experts fed "
            "the previous MoE block's post-attention representation and its shared expert the block's own "
            "(occult.models.shortcut); the first MoE block routes its own"),
        fixed_rule=SOFTMAX_UNGROUPED + (("routed_scaling_factor", 1.0),)),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeSparseMoeBlock", None,
                        fixed_rule=SOFTMAX_UNGROUPED + (("routed_scaling_factor", 1.0),)),
    "qwen3_5_moe": Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                          "Qwen3_5MoeSparseMoeBlock", _qwen_shared, fixed_rule=RENORMALISED),
    "mixtral": Family("mixtral", "MixtralConfig", "MixtralForCausalLM", "MixtralSparseMoeBlock", None,
                      fixed_rule=RENORMALISED),
    "gpt_oss": Family(
        "gpt_oss", "GptOssConfig", "GptOssForCausalLM", "GptOssMLP", None, fixed_rule=RENORMALISED,
        deviations=(
            "gpt-oss's router (a linear layer with a bias, top-k of the logits, softmax over those k: "
            "softmax scores renormalised over the top-k, GateRule(normalize=True)) and shapes are its own; "
            "its experts (interleaved gate/up projections with biases, a clamped GLU with alpha 1.702) are "
            "not the harness's SwiGLU experts, so the harness runs its shapes with SwiGLU experts"),
        whole_model_refusal=(
            "gpt-oss's experts are not the harness's SwiGLU experts (see its deviation note), so a whole "
            "gpt-oss model has no expert-parallel equivalent here; its router and shapes run in layer "
            "tasks (task=layer, task=bench)")),
}


def gate_rule(m):
    """The gate rule of a ``model`` config (a ModelConf, a DictConfig or a dict: the fields
    it lacks at their defaults, :class:`occult.schemas.ModelConf`):
    :class:`occult.ep.router.GateRule` from its router fields."""
    m = typed(ModelConf, m)
    return GateRule(scoring=m.scoring_func, normalize=bool(m.norm_topk_prob), scaling=float(m.routed_scaling_factor),
                    n_group=int(m.n_group), topk_group=int(m.topk_group))


def check_gate_rule(m) -> None:
    """Raises ``ValueError`` (one line naming the field) when the model's router fields
    are not a rule its family's router computes, or cannot route K of its E experts."""
    m = typed(ModelConf, m)
    rule = gate_rule(m)
    if m.family:
        for field, value in family_of(m.family).fixed_rule:
            have = getattr(m, field)
            if have != value:
                raise ValueError(f"model.{field}={have!r}: the {m.family} router computes only {value!r}; "
                                 f"allowed values are [{value!r}]")
    rule.check(m.num_experts, m.top_k)


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
