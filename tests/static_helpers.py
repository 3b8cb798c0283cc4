"""Rank functions of the static-dispatch tests (importable by the ranks): a step run with
every host read of a tensor refused (:func:`no_host_reads`)."""
from contextlib import contextmanager

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


class HostRead(RuntimeError):
    """A tensor was read on the host inside :func:`no_host_reads`."""


# what reads a tensor's values on the host: a scalar or list out of it, a NumPy view, a
# Python number or truth value of it, and a copy to the host
READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "cpu")


@contextmanager
def no_host_reads():
    """Inside, every host read of a tensor (:data:`READS`, and ``.to`` the host from another
    device) raises :class:`HostRead` naming it; restored after."""
    saved = {name: getattr(torch.Tensor, name) for name in READS + ("to",)}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} read a tensor on the host inside a static step")
        return read

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" \
                and self.device.type != "cpu":
            raise HostRead("Tensor.to copied a device tensor to the host inside a static step")
        return saved["to"](self, *args, **kwargs)
    try:
        for name in READS:
            setattr(torch.Tensor, name, refuse(name))
        torch.Tensor.to = to
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _layer(ctx, system: dict, case):
    from occult.ep import MoELayer, Placement, system_config
    from occult.parity import make_problem

    placement = Placement.contiguous(case.num_experts, ctx.world_size).to(ctx.device)
    prob = make_problem(case, placement, ctx.device)
    config = system_config(system).sized(max(case.tokens), force=True)
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k,
                                 config.build(ctx.ep, 0, case.num_experts, placement))
    lo = sum(case.tokens[:ctx.rank])
    return layer, prob.x_TD[lo:lo + case.tokens[ctx.rank]].clone().requires_grad_(True)


def guarded_steps(ctx, jobs: list) -> dict:
    """Each ``(label, system dict, case, inject)``: one forward and backward of the system's
    layer with host reads refused; ``inject``: a dotted function of the step's path wrapped
    to call ``.item()`` first (a host read put back). Returns {label: "ok" or the error}
    and, for the steps that ran, the valid / wire rows they logged."""
    from occult.ep import Recorder, import_object
    from occult.tasks.common import comm_rows

    out = {}
    for label, system, case, inject in jobs:
        layer, x = _layer(ctx, system, case)
        rec = Recorder(rank=ctx.rank)
        module, _, name = inject.rpartition(".")
        real = import_object(inject) if inject else None
        if inject:
            def with_item(*args, _real=real, **kwargs):
                args[0].max().item()            # the host read put back
                return _real(*args, **kwargs)
            setattr(import_object(module), name, with_item)
        try:
            with no_host_reads():
                out_TD = layer(x, rec)
                (out_TD * out_TD).sum().backward()
            rows = comm_rows(rec)
            out[label] = ("ok", {m: sum(r["value"] for r in rows if r["metric"] == m)
                                 for m in ("rows", "valid_rows", "padding_wire_rows")})
        except HostRead as err:
            out[label] = (str(err), {})
        finally:
            if inject:
                setattr(import_object(module), name, real)
    return out
