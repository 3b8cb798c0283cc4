"""Rank functions of the static-dispatch tests (importable by the ranks): a step run with
what would synchronise a GPU refused (:func:`occult.ep.host_sync.no_host_sync`)."""
import torch

NAIVE, OCCULT = "baselines.naive.NaiveDispatcher", "occult.collab.dispatcher.OccultDispatcher"
STATIC_PROXIES = ("olmoe_proxy", "qwen_moe_proxy", "deepseek_moe_proxy")


def check_static_decode(rows: list, rank: int, label: str, static: bool = True) -> None:
    """A decode task's rows on ``rank`` (``static``: system.dispatch_mode=static): the prompt
    ran dynamic (its counts collectives), the steps in fixed buffers: per step, valid bytes
    at most the wire bytes, the difference padding rows, some of them padding for naive
    (min(K, e) slots per token and device); a dynamic system's steps have none."""
    value = lambda metric: [r["value"] for r in rows if r["metric"] == metric and r["rank"] == rank]
    wire, valid, padding = value("step_wire_bytes"), value("step_valid_bytes"), value("step_padding_rows")
    assert wire and valid and padding, label
    assert any(r["metric"] == "rows" and r["phase"] == "counts" for r in rows), label       # the prompt's
    if not static:
        assert wire == valid and padding == [0.0] and not value("valid_bytes"), label
        return
    assert 0 < valid[0] <= wire[0] and value("valid_bytes") and value("padding_wire_rows"), (label, wire, valid)
    assert (valid[0] < wire[0]) == (padding[0] > 0), (label, wire, valid, padding)
    if "naive" in label:
        assert padding[0] > 0, (label, padding)


# what the tests put back into a static step (at the start of a function of its path): each
# something that synchronises a GPU, which the guard must name (occult.ep.host_sync)
INJECTIONS = {
    "item": (lambda t: t.max().item(), "Tensor.item reads"),
    "to cpu": (lambda t: t.to("cpu"), "Tensor.to names a device"),
    "equal": (lambda t: torch.equal(t, t), "torch.equal answers on the host"),
    "allclose": (lambda t: torch.allclose(t.double(), t.double()), "torch.allclose answers on the host"),
    "nonzero": (lambda t: t.nonzero(), "torch.nonzero makes an output whose shape"),
    "mask": (lambda t: t[t > 0], "Tensor.__getitem__ with a boolean mask"),
    "unique": (lambda t: torch.unique(t), "torch.unique makes"),
    "bincount": (lambda t: torch.bincount(t.flatten().clamp_min(0)), "torch.bincount makes"),
    "repeat_interleave": (lambda t: torch.repeat_interleave(t.flatten().clamp_min(0)), "torch.repeat_interleave"),
}


def slot_placement(E: int, P: int):
    """EPLB's slots for E experts on P devices (the real library, a skewed seeded load, E / 4
    redundant: copies, some on one device), on the host."""
    from occult.placement.eplb import eplb_placements
    load_E = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
    return eplb_placements({0: load_E}, E // 4, P)[0]


def _layer(ctx, system: dict, case, slots: bool):
    from occult.ep import MoELayer, Placement, system_config
    from occult.parity import make_problem

    placement = (slot_placement(case.num_experts, ctx.world_size) if slots
                 else Placement.contiguous(case.num_experts, ctx.world_size)).to(ctx.device)
    prob = make_problem(case, placement, ctx.device)
    config = system_config(system).sized(max(case.tokens), force=True)
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k,
                                 config.build(ctx.ep, 0, case.num_experts, placement))
    lo = sum(case.tokens[:ctx.rank])
    return layer, prob.x_TD[lo:lo + case.tokens[ctx.rank]].clone().requires_grad_(True)


def _block(ctx, system: dict, slots: bool, tokens: int = 3):
    """A tiny OLMoE proxy's first MoE block as an expert-parallel block of ``system`` (E = 8,
    K = 2, float64, fixed buffers of ``tokens`` + 1 tokens), and this rank's hidden states."""
    from omegaconf import OmegaConf
    from occult.ep import system_config
    from occult.models.build import hf_config, init_model, moe_blocks
    from occult.models.ep_block import EPMoEBlock
    from occult.models.families import family_of, gate_rule

    m = OmegaConf.create({"family": "olmoe", "num_experts": 8, "top_k": 2, "hidden_size": 16,
                          "expert_ffn_size": 8, "num_layers": 1, "num_heads": 2, "init": "random"})
    fam = family_of("olmoe")
    model = init_model(fam, hf_config(m, 32), 0).double()
    placement = slot_placement(8, ctx.world_size).to(ctx.device) if slots else None
    config = system_config(system).sized(tokens + 1, force=True)      # padding travels too
    _, _, hf_block = moe_blocks(model, fam)[0]
    block = EPMoEBlock(hf_block, fam, config.build(ctx.ep, 0, 8, placement), 0, gate_rule(m)).to(ctx.device)
    g = torch.Generator(device="cpu").manual_seed(ctx.rank)
    return block, torch.randn(1, tokens, 16, generator=g, dtype=torch.float64).to(ctx.device).requires_grad_(True)


def _where(err: Exception) -> str:
    """The harness's innermost frame in ``err``'s traceback (file:line function)."""
    import traceback
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if ("/occult/" in f.filename or "/baselines/" in f.filename) and "host_sync" not in f.filename]
    f = frames[-1] if frames else None
    return f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno} {f.name}" if f else ""


def guarded_steps(ctx, jobs: list) -> dict:
    """Each ``(label, system dict, case, where)``: one forward and backward of the system's
    layer under :func:`occult.ep.host_sync.no_host_sync`, its recorder timing by marks.
    ``where``: ``layer`` / ``slots`` (an MoELayer on the contiguous placement / on EPLB's
    slots), ``block`` / ``block slots`` (a model's EPMoEBlock, ``case`` unused), ``clock`` (the
    layer with a recorder on the synchronised clock), or ``inject:<name>:<dotted function>``
    (the layer with :data:`INJECTIONS` [name] run first in that function of the step's path).
    Returns {label: ("ok", the valid / wire rows the step logged) or (the error, where raised)}."""
    from occult.ep import Recorder, import_object
    from occult.ep.accounting import recording
    from occult.ep.host_sync import HostSync, no_host_sync
    from occult.tasks.common import comm_rows

    out = {}
    for label, system, case, where in jobs:
        kind, _, inject = where.partition(":")
        if kind.startswith("block"):
            layer, x = _block(ctx, system, kind == "block slots")
        else:
            layer, x = _layer(ctx, system, case, kind == "slots")
        rec = Recorder(rank=ctx.rank, marks=kind != "clock")
        name, _, target = inject.partition(":")
        module, _, attr = target.rpartition(".")
        real = import_object(target) if inject else None
        if inject:
            def with_sync(*args, _real=real, _fn=INJECTIONS[name][0], **kwargs):
                _fn(args[0])                    # the synchronisation put back
                return _real(*args, **kwargs)
            setattr(import_object(module), attr, with_sync)
        try:
            with no_host_sync(), recording(rec):
                out_TD = layer(x) if kind.startswith("block") else layer(x, rec)
                (out_TD * out_TD).sum().backward()
            rows = comm_rows(rec)
            out[label] = ("ok", {m: sum(r["value"] for r in rows if r["metric"] == m)
                                 for m in ("rows", "valid_rows", "padding_wire_rows")})
        except HostSync as err:
            out[label] = (str(err), {"raised at": _where(err)})
        finally:
            if inject:
                setattr(import_object(module), attr, real)
    return out
