"""Rank functions for tests/test_models.py (importable by spawned ranks): the shortcut-
connected model (ScMoE) under its overlapped schedule (system=scmoe) and step by step
(system=naive), float64, on the same batch.

Shapes: B sequences per rank, S length, V vocabulary.
"""
import copy

import torch
import torch.nn.functional as nnf
from omegaconf import OmegaConf

from occult.ep import Recorder, system_config
from occult.ep.accounting import recording
from occult.models.build import hf_config, init_model, to_expert_parallel
from occult.models.families import family_of, gate_rule
from occult.models.runtime import sync_gradients

B, S, V = 2, 6, 48
SCHEDULES = {"step_by_step": {"name": "naive", "_target_": "baselines.naive.NaiveDispatcher"},
             "overlapped": {"name": "scmoe", "_target_": "baselines.scmoe.ScMoEDispatcher"}}


def shortcut_model(m: dict):
    """The shortcut-connected model of config ``m`` (seeded, float64) and the same weights
    without the shortcut (every block routing its own representation)."""
    fam = family_of("scmoe")
    model = init_model(fam, hf_config(OmegaConf.create(m), V), 3).double()
    plain = init_model(family_of("qwen2_moe"), hf_config(OmegaConf.create({**m, "family": "qwen2_moe"}), V), 3)
    return model, plain.double()


def schedule_world(ctx, m: dict) -> dict:
    """Forward and backward of one batch under each schedule: logits, synchronised
    gradients, the order of the collectives' layers and phases, the exposed_comm spans;
    and the largest logit difference to the same weights without the shortcut."""
    g = torch.Generator().manual_seed(20 + ctx.rank)
    x_BS = torch.randint(0, V, (B, S), generator=g)
    model, plain = shortcut_model(m)
    out = {}
    for label, system in SCHEDULES.items():
        ep = to_expert_parallel(copy.deepcopy(model), family_of("scmoe"),
                                lambda li: system_config(system).build(ctx.ep, li, m["num_experts"]), gate_rule(m))
        rec = Recorder(rank=ctx.rank)
        with recording(rec):
            logits = ep(input_ids=x_BS).logits
            nnf.cross_entropy(logits.flatten(0, 1), torch.roll(x_BS, -1, 1).flatten()).backward()
        sync_gradients(ctx, ep)
        out[label] = {"logits": logits.detach(),
                      "grads": {n: p.grad.clone() for n, p in ep.named_parameters() if p.grad is not None},
                      "order": [(ev.layer, ev.phase) for ev in rec.comm if ev.direction == "forward"],
                      "exposed": sorted({layer for layer, name, *_ in rec.spans if name == "exposed_comm"})}
    with torch.no_grad():      # float32: the transformers experts' grouped matmul takes no float64
        out["no_shortcut_diff"] = (model.float()(input_ids=x_BS).logits
                                   - plain.float()(input_ids=x_BS).logits).abs().max().item()
    return out
