"""Rank functions for tests/test_models.py (importable by spawned ranks): the shortcut-
connected model (ScMoE) under its overlapped schedule (system=scmoe) and step by step
(system=naive), float64, on the same batch; the runs' whole-model parity gate.

Shapes: B sequences per rank, S length, V vocabulary.
"""
import contextlib
import copy

import torch
import torch.nn.functional as nnf
from omegaconf import OmegaConf

from occult.ep import Recorder, system_config
from occult.ep.accounting import recording
from occult.models.build import hf_config, init_model, to_expert_parallel
from occult.models.families import family_of, gate_rule
from occult.models.runtime import sync_gradients
from occult.models.shortcut import Shortcut, ShortcutMLP

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


class _SharedCarrier(Shortcut):
    """One Shortcut for every forward of a model, keeping its last representation: issue
    38's defect 2 (the strands shared one carrier per model), emulated without the crash a
    strand reading after the other's last block would meet."""

    @property
    def previous(self):
        return self._previous

    @previous.setter
    def previous(self, value):
        if value is not None or not hasattr(self, "_previous"):
            self._previous = value


@contextlib.contextmanager
def shared_carrier():
    """While open, every ShortcutMLP reads and writes its model's one :class:`_SharedCarrier`."""
    carriers, own = {}, ShortcutMLP._carrier
    ShortcutMLP._carrier = lambda self: carriers.setdefault(id(self._chain), _SharedCarrier(self._chain))
    try:
        yield
    finally:
        ShortcutMLP._carrier = own


def gate_world(ctx, scmoe: dict, olmoe: dict) -> dict:
    """The runs' whole-model gate (:func:`occult.tasks.common.model_parity_gate`): the
    shortcut-connected model ``scmoe`` on naive with two micro-batches, training (forward
    and backward) and prefill (forward), and prefill with the shared carrier (the layer
    gate run on that too); the OLMoE model ``olmoe`` training with sequence migration (the
    task's own wrapper). Each entry: the gate's rows, or the AssertionError's message."""
    import dataclasses
    from types import SimpleNamespace

    from occult.config import read_conf
    from occult.tasks.common import model_parity_gate, parity_gate
    from occult.tasks.model import model_runner

    def config(m: dict, task: dict):
        """A run's model, seed and typed task (the task's config with ``task``'s fields)."""
        typed = dataclasses.replace(read_conf("task", task.pop("name")), parity_tokens=16, check_parity=True, **task)
        return SimpleNamespace(model=OmegaConf.create(m), seed=1, task=typed)

    def gate(cfg):
        try:
            return model_parity_gate(ctx, cfg, SCHEDULES["step_by_step"], None, model_runner(ctx, cfg))
        except AssertionError as exc:
            return str(exc)

    co_executed = config(scmoe, {"name": "prefill", "microbatches": 2})
    out = {"shortcut": gate(config(scmoe, {"name": "train", "microbatches": 2})), "shortcut_prefill": gate(co_executed),
           "migration": gate(config(olmoe, {"name": "train", "migration": True}))}
    with shared_carrier():
        out["shared_carrier_layer"] = parity_gate(ctx, co_executed, SCHEDULES["step_by_step"], "router")
        out["shared_carrier"] = gate(co_executed)
    return out
