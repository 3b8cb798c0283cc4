"""Rank functions and test systems for tests/test_occult_variants.py (importable by spawned ranks)."""
import copy

import torch
from omegaconf import OmegaConf

from dataclasses import dataclass

from baselines.naive import NaiveDispatcher
from occult.placement.files import PlacementFileConfig
from occult.ep import Recorder
from occult.ep.accounting import recording
from occult.models.ep_block import EPMoEBlock
from occult.models.families import family_of
from occult.models.runtime import base_model, make_rank_model
from occult.ep.capabilities import Capabilities
from occult.ep.payload import PAYLOADS
from occult.ep.replica_rules import REPLICA_POLICIES


class PlacedNaiveDispatcher(NaiveDispatcher):
    """Naive EP with its placement from an artifact: placements must not depend on the system."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=REPLICA_POLICIES, payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(PlacementFileConfig, NaiveDispatcher.Config):
        placement_required = True


def _rank_model(ctx, cfg_dict: dict, vocab_size: int = 128):
    cfg = OmegaConf.create(cfg_dict)
    ref = base_model(cfg, vocab_size)
    return cfg, make_rank_model(ctx, copy.deepcopy(ref), cfg)


def placements_of(model) -> dict:
    """{layer: groups} of the model's expert-parallel blocks."""
    return {m.layer_idx: m.dispatcher.placement.groups() for m in model.modules() if isinstance(m, EPMoEBlock)}


def pruned_routing(ctx, jobs: list) -> list:
    """For each cfg_dict: one forward of a random batch on the rank model; the recorded
    routing [(layer, ids_TK)] and the blocks' placements."""
    out = []
    for cfg_dict in jobs:
        cfg, model = _rank_model(ctx, cfg_dict)
        g = torch.Generator().manual_seed(ctx.rank + 7)
        ids = torch.randint(0, 128, (3, 16), generator=g)
        rec = Recorder(rank=ctx.rank)
        with torch.no_grad(), recording(rec):
            model(input_ids=ids)
        out.append({"routing": [(layer, ids_TK) for layer, ids_TK, *_ in rec.routing],
                    "placements": placements_of(model)})
    return out


def finetune_changes(ctx, cfg_dict: dict, steps: int = 2) -> dict:
    """Runs ``steps`` fine-tuning steps; reports, per parameter name, whether it changed,
    whether it is trainable, and (replicated MoE weights) a checksum to compare across ranks."""
    from occult.data.batches import batch_iterator
    from occult.tasks.finetune import finetune

    cfg, model = _rank_model(ctx, cfg_dict)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids_N = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(3))
    batches = batch_iterator(ids_N, 2, 16, seed=ctx.rank + 1)
    losses = finetune(ctx, model, family_of(cfg.model.family), batches, steps, lr=1e-2)
    return {"changed": {n: not torch.equal(before[n], p.detach()) for n, p in model.named_parameters()},
            "trainable": {n: p.requires_grad for n, p in model.named_parameters()},
            "checksum": {n: float(p.detach().double().sum()) for n, p in model.named_parameters()
                         if ".experts." not in n},
            "losses": losses}
