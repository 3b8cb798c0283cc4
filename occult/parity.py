"""Parity of an expert-parallel system with the single-device reference.

Every rank builds the same global problem from a seed (router, all experts,
all tokens, an upstream gradient), keeps its own slice, runs the system, and
compares outputs and gradients (inputs, router, its experts) with the
reference computed on the full problem. Used by the tests and, before any
timing, by the benchmarks.

Shapes: T tokens, D hidden, E experts, K top-k, P ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as nnf

from .ep import GateRule, MoELayer, Placement, Recorder, ReferenceMoE, devices_per_token, init_expert_weights, system_config
from .ep.replicas import sum_replica_gradients
from .synthetic import expert_popularity, sample_topk

# routing patterns a parity case can ask for
CASE_ROUTINGS = ("router", "uniform", "one_device", "skip_last_device", "explicit")
# The parity tolerance on a float64 problem, by the precision of a system's own arithmetic
# (Dispatcher.precision), as (relative, absolute): a quantity passes when
# max|system - reference| <= relative * max|reference| + absolute. Float64 systems: to
# rounding, relative only. Float32 systems (a library that casts): float32's rounding,
# with an absolute floor at the problem's unit scale for quantities that vanish in exact
# arithmetic (the router gradient at K = 1 with renormalised weights, identically 1,
# where both sides are float32 rounding noise and their ratio means nothing).
TOLERANCE = {"float64": (1e-9, 0.0), "float32": (1e-5, 1e-5)}


def disagreements(result: dict, system) -> dict:
    """The quantities of a :func:`check_layer` result outside ``system``'s tolerance (its
    precision's): name -> relative error. Empty when the system agrees with the reference."""
    rel_tol, abs_tol = TOLERANCE[system_config(system).precision]
    scales = result["scales"]
    return {k: v for k, v in result["errors"].items() if not v <= rel_tol + abs_tol / scales[k]}


@dataclass(frozen=True)
class LayerCase:
    """One parity problem. ``tokens`` gives the token count of each rank."""

    num_experts: int
    top_k: int
    tokens: tuple
    hidden: int = 16
    ffn: int = 8
    routing: str = "uniform"
    renormalize: bool = False
    seed: int = 0
    dtype: str = "float64"
    explicit_ids: tuple = ()   # routing="explicit": every rank's tokens' top-k ids, concatenated
    rule: Optional[GateRule] = None   # the router's gate rule (None: softmax top-k, renormalize)
    bias: bool = False         # draw a correction bias for the rule's selection (DeepSeek-V3's)

    @property
    def gate_rule(self) -> GateRule:
        return self.rule if self.rule is not None else GateRule(normalize=self.renormalize)


@dataclass
class Problem:
    router_ED: torch.Tensor
    experts: dict
    x_TD: torch.Tensor         # all ranks' tokens
    grad_TD: torch.Tensor      # upstream gradient of the output
    ids_TK: Optional[torch.Tensor]
    bias_E: Optional[torch.Tensor] = None   # the router's correction bias (case.bias)


def make_problem(case: LayerCase, placement: Placement, device="cpu") -> Problem:
    """The global problem, identical on every rank (drawn on the host from the case's
    seed, then moved to ``device``)."""
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    E, K, D, T = case.num_experts, case.top_k, case.hidden, sum(case.tokens)
    router = (torch.randn(E, D, generator=g, device="cpu") / D ** 0.5).to(dtype)
    experts = init_expert_weights(E, D, case.ffn, g, dtype)
    x = torch.randn(T, D, generator=g, device="cpu").to(dtype)
    grad = torch.randn(T, D, generator=g, device="cpu").to(dtype)
    # a bias of the scores' own size, so that it moves the choice (drawn only when asked
    # for: a case without one draws what it always drew)
    bias = 0.1 * torch.randn(E, generator=g, device="cpu") if case.bias else None
    ids = None
    if case.routing == "explicit":
        ids = torch.tensor(case.explicit_ids, dtype=torch.long, device="cpu").view(T, K)
    elif case.routing != "router":
        allowed = None
        if case.routing == "one_device":
            allowed = placement.device_E.cpu() == 0
        elif case.routing == "skip_last_device":
            allowed = placement.device_E.cpu() != placement.num_devices - 1
        elif case.routing != "uniform":
            raise ValueError(f"routing={case.routing!r}: allowed {list(CASE_ROUTINGS)}")
        ids = sample_topk(T, K, expert_popularity("uniform", E), g, allowed)
    move = lambda t: None if t is None else t.to(device)
    return Problem(move(router), {k: move(w) for k, w in experts.items()}, move(x), move(grad), move(ids),
                   move(bias))


def _scale(b: torch.Tensor) -> float:
    """max |b|, the denominator of a relative error (at least 1e-30)."""
    return max(b.abs().max().item(), 1e-30) if b.numel() else 1e-30


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    if a.numel() == 0:
        return 0.0
    return (a - b).abs().max().item() / _scale(b)


@dataclass(frozen=True)
class Reference:
    """The single-device reference's output and gradients on a whole problem (detached)."""

    out_TD: torch.Tensor
    grad_x_TD: torch.Tensor
    grad_router_ED: torch.Tensor
    grad_w_gate: torch.Tensor
    grad_w_up: torch.Tensor
    grad_w_down: torch.Tensor


def reference_of(prob: Problem, case: LayerCase) -> Reference:
    """The reference MoE on every rank's tokens of ``prob``, forward and backward."""
    ref = ReferenceMoE(prob.router_ED, prob.experts, case.top_k, rule=case.gate_rule, bias_E=prob.bias_E)
    x_ref = prob.x_TD.clone().requires_grad_(True)
    out_ref = ref(x_ref, prob.ids_TK)
    (out_ref * prob.grad_TD).sum().backward()
    return Reference(out_ref.detach(), x_ref.grad, ref.router.weight.grad, ref.w_gate.grad, ref.w_up.grad,
                     ref.w_down.grad)


def check_layer(ctx, system, case: LayerCase, placement: Optional[Placement] = None,
                reference: Optional[Reference] = None) -> dict:
    """Runs one case on this rank for ``system`` (a system config or its dict); returns
    relative errors (and each quantity's scale, max |reference|) and the recorder's events.
    ``reference``: the case's reference (:func:`reference_of`), when already computed for
    this case and placement (a grid runs every system on the same cases).

    Must be called on every rank of ``ctx``'s world, with the same arguments.
    """
    P, rank = ctx.world_size, ctx.rank
    placement = (placement or Placement.contiguous(case.num_experts, P)).to(ctx.device)
    prob = make_problem(case, placement, ctx.device)
    lo = sum(case.tokens[:rank])
    hi = lo + case.tokens[rank]
    ref = reference if reference is not None else reference_of(prob, case)

    # a system with fixed buffers: sized for this problem's largest rank
    dispatcher = system_config(system).sized(max(case.tokens), force=True).build(ctx.ep, 0, case.num_experts,
                                                                                  placement)
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k, dispatcher, rule=case.gate_rule,
                                 bias_E=prob.bias_E)
    x = prob.x_TD[lo:hi].clone().requires_grad_(True)
    ids = None if prob.ids_TK is None else prob.ids_TK[lo:hi]
    rec = Recorder(rank=rank)
    out = layer(x, rec, ids)
    (out * prob.grad_TD[lo:hi]).sum().backward()
    sum_replica_gradients(layer.experts, placement, ctx.ep)    # training's step: copies summed

    w = layer.router.weight
    grad_router = torch.zeros_like(w) if w.grad is None else w.grad.clone()   # None: weights unused
    if P > 1:
        dist.all_reduce(grad_router, group=ctx.ep.group)
    local = dispatcher.local_expert_ids
    pairs = {   # quantity -> (this system's, the reference's)
        "out": (out.detach(), ref.out_TD[lo:hi]),
        "grad_x": (x.grad, ref.grad_x_TD[lo:hi]),
        "grad_router": (grad_router, ref.grad_router_ED),
        "grad_w_gate": (layer.experts.w_gate.grad, ref.grad_w_gate[local]),
        "grad_w_up": (layer.experts.w_up.grad, ref.grad_w_up[local]),
        "grad_w_down": (layer.experts.w_down.grad, ref.grad_w_down[local]),
    }
    errors = {k: _rel_err(a, b) for k, (a, b) in pairs.items()}
    scales = {k: _scale(b) for k, (_, b) in pairs.items()}
    sent = {}
    for ev in rec.comm:
        sent[(ev.phase, ev.direction)] = sent.get((ev.phase, ev.direction), 0) + sum(ev.rows_P)
    _, routed_ids, routed_weights, _ = rec.routing[0]
    return {"errors": errors, "scales": scales, "comm": rec.comm, "sent_rows": sent, "tokens": hi - lo,
            "distinct_devices": int(devices_per_token(routed_ids, dispatcher.placement,
                                                      torch.full((hi - lo,), rank, dtype=torch.long)).sum()),
            "routing": (routed_ids.cpu(), routed_weights.cpu())}


def run_grid(ctx, jobs: list) -> list:
    """Runs ``[(system dict, case, placement_groups, a placement or None[, devices_per_node]), ...]`` in one
    world (a job's ``devices_per_node``, when given, groups this world's ranks into nodes its
    own way: one world runs several node layouts).

    Starting a world costs seconds; tests and benchmarks run whole grids in one.
    """
    out, typed, references = [], {}, {}
    world_ctx = ctx
    for system, case, groups, *layout in jobs:
        ctx = replace(world_ctx, ep=replace(world_ctx.ep, devices_per_node=layout[0])) if layout else world_ctx
        # groups: a list of expert groups, or a placement itself (a slot placement: copies)
        placement = groups if hasattr(groups, "pair_local") else Placement.from_groups(groups) if groups else None
        key = repr(system)            # each system's typed config made once (3 ms a merge)
        if key not in typed:
            typed[key] = system_config(system)
        where = (case, repr(groups))  # each case's reference once, for every system on it
        if where not in references:
            pl = (placement or Placement.contiguous(case.num_experts, ctx.world_size)).to(ctx.device)
            references[where] = reference_of(make_problem(case, pl, ctx.device), case)
        out.append(check_layer(ctx, typed[key], case, placement, references[where]))
    return out


def lm_loss(logits_BSV: torch.Tensor, ids_BS: torch.Tensor) -> torch.Tensor:
    """The causal LM loss of ``logits`` on the sequences ``ids`` (each position predicting the
    next token; the mean over positions, as transformers' ``labels=ids``), float32 at least."""
    logits = logits_BSV[:, :-1].flatten(0, 1)
    return nnf.cross_entropy(logits.float() if logits.dtype.itemsize < 4 else logits, ids_BS[:, 1:].flatten())


def check_model(ctx, cfg_dict: dict, batch_per_rank: int, seq_len: int, vocab_size: int = 256,
                placements: Optional[dict] = None, system=None, wrap: Optional[Callable] = None,
                forward_tolerance: Optional[float] = None, backward: bool = True,
                inspect: Optional[Callable] = None) -> dict:
    """An expert-parallel model against the single-device model on the concatenation of
    all ranks' sequences: logits, loss, and the gradients of every weight (replicated
    weights after data-parallel averaging; experts against the reference's slice, a copied
    expert's after the sum over its copies).

    ``cfg_dict`` holds ``model`` (in its ``dtype``; float64 runs transformers' experts as
    batched matmuls, as their grouped matmul takes no float64), ``system`` (or the argument
    ``system``: a system config) and ``seed`` (and optionally ``task``: ``microbatches``
    co-executed, ``grad_sync``'s schedule); weights are random (seeded); ``placements``:
    ``{layer: placement}`` overriding the system's (e.g. EPLB's slots); ``wrap``: the rank
    model -> what runs it (a model called with ``input_ids`` whose output has ``logits``,
    e.g. sequence migration's), compared by the rank model's weights. ``forward_tolerance``:
    when some rank's logits or loss are off by more than it, the check ends before the
    backward (whose graph a wrong forward may have tangled), returning those two errors,
    ``backward`` False and ``forward_agrees`` False (on every rank); ``backward=False``: the
    forward alone, without autograd (an inference run's check), the same two errors.
    ``inspect(model, recorder)``: what else to read of the run (a dict, under ``inspected``),
    once it has ended.
    """
    import copy

    from omegaconf import OmegaConf

    from .ep.accounting import recording
    from .models.build import moe_blocks
    from .models.families import expert_weights_from_block, family_of
    from .models.grad_sync import GradSync
    from .models.runtime import base_model, forward_micro_batches, make_rank_model, micro_batches

    cfg = OmegaConf.create(cfg_dict)
    fam = family_of(cfg.model.family)
    P, rank = ctx.world_size, ctx.rank
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 99)
    ids_all = torch.randint(0, vocab_size, (batch_per_rank * P, seq_len), generator=g, device="cpu").to(ctx.device)
    ids = ids_all[rank * batch_per_rank:(rank + 1) * batch_per_rank]

    ref = base_model(cfg, vocab_size, device=ctx.device)
    if cfg.model.get("dtype") == "float64":
        ref.set_experts_implementation("batched_mm")
    model = make_rank_model(ctx, copy.deepcopy(ref), cfg, placements, system=system,
                            tokens_per_rank=batch_per_rank * seq_len)
    runs = wrap(model) if wrap is not None else model
    with torch.set_grad_enabled(backward):
        ref_logits = ref(input_ids=ids_all).logits
        ref_loss = lm_loss(ref_logits, ids_all)
    if backward:
        ref_loss.backward()
    rec = Recorder(rank=rank)
    # the schedules under test (none given: the batch at once, GradSync's own default sync)
    task = cfg_dict.get("task", {})
    sync = GradSync(ctx, model, **{("mode" if k == "grad_sync" else k): task[k]
                                   for k in ("grad_sync", "bucket_bytes", "partition_bytes") if k in task}) \
        if backward else None
    ids_m = micro_batches(ids, task["microbatches"]) if "microbatches" in task else [ids]
    with recording(rec), torch.set_grad_enabled(backward):
        outs = forward_micro_batches(runs, ctx.device, [{"input_ids": x} for x in ids_m])
    losses = [lm_loss(out.logits, x) * (x.shape[0] / ids.shape[0]) for out, x in zip(outs, ids_m)]
    logits = torch.cat([o.logits for o in outs])
    loss = sum(l.detach() for l in losses)
    if P > 1:
        dist.all_reduce(loss, group=ctx.ep.group)
        loss /= P
    errors = {"logits": _rel_err(logits.detach(),
                                 ref_logits.detach()[rank * batch_per_rank:(rank + 1) * batch_per_rank]),
              "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    agrees = True
    if forward_tolerance is not None:
        worst_forward = torch.tensor([max(errors.values())], dtype=torch.float64, device=ctx.device)
        if P > 1:
            dist.all_reduce(worst_forward, op=dist.ReduceOp.MAX, group=ctx.ep.group)
        agrees = worst_forward.item() <= forward_tolerance    # the same on every rank
    if not (agrees and backward):                             # every rank stops here together
        return {"errors": errors, "backward": False, "forward_agrees": agrees,
                **({"inspected": inspect(model, rec)} if inspect is not None else {})}
    synced = sync.backward(losses)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if name in ref_params and p.grad is not None:
            worst = max(worst, _rel_err(p.grad, ref_params[name].grad))
    errors["grad_replicated"] = worst
    worst = 0.0
    ref_blocks = {i: b for i, _, b in moe_blocks(ref, fam)}
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer.mlp, "moe", layer.mlp)          # inside a shortcut wrapper (ScMoE)
        if i not in ref_blocks or not hasattr(block, "dispatcher"):
            continue
        local = block.dispatcher.local_expert_ids
        ref_grads = expert_weights_from_block(_GradView(ref_blocks[i]))
        for key in ("w_gate", "w_up", "w_down"):
            worst = max(worst, _rel_err(getattr(block.experts, key).grad, ref_grads[key][local]))
    errors["grad_experts"] = worst
    sent = {}
    for ev in rec.comm:
        sent[(ev.phase, ev.direction)] = sent.get((ev.phase, ev.direction), 0) + sum(ev.rows_P)
    return {"errors": errors, "backward": True, "forward_agrees": agrees, "sent_rows": sent, "grad_sync": synced,
            "exposed_comm_spans": sum(name == "exposed_comm" for _, name, _, _ in rec.spans),
            "forward_collectives": sum(ev.direction == "forward" for ev in rec.comm),
            "routing": [(layer, ids_TK) for layer, ids_TK, *_ in rec.routing],
            **({"inspected": inspect(model, rec)} if inspect is not None else {})}


class _GradView:
    """Looks like an MoE block whose expert weights are the block's gradients."""

    def __init__(self, block):
        class _E:
            gate_up_proj = block.experts.gate_up_proj.grad
            down_proj = block.experts.down_proj.grad
        self.experts = _E()


def run_model_grid(ctx, jobs: list) -> list:
    """``[(cfg_dict, batch_per_rank, seq_len[, placements]), ...]`` in one world."""
    return [check_model(ctx, cfg, b, s, placements=more[0] if more else None) for cfg, b, s, *more in jobs]
