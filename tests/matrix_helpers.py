"""The combination matrix's cases as composed configs (one compose per task, model and world,
then the case's fields set), and the checks each case runs in a world
(:func:`matrix_world`). Importable by the tests; nothing here starts ranks."""
import copy

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from occult.config import CONF_DIR, register
from occult.matrix import NO_RULE, world_of

_BASE: dict = {}


def base_cfg(task: str, shortcut: bool, P: int):
    """The composed config of a task, model and world (cached: a compose costs ~0.3 s)."""
    key = (task, shortcut, P)
    if key not in _BASE:
        register()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            _BASE[key] = compose("config", overrides=[f"task={task}", f"cluster=cpu{P}",
                                                      f"model={'scmoe_proxy' if shortcut else 'olmoe_proxy'}"])
    return _BASE[key]


def system_dict(case: dict) -> dict:
    """The case's system: its conf/system YAML with the case's options."""
    d = yaml.safe_load((CONF_DIR / "system" / f"{case['system']}.yaml").read_text())
    if case["dispatch_mode"] != "dynamic":
        d["dispatch_mode"] = case["dispatch_mode"]
    if case["replica_rule"] != NO_RULE:
        d["replica_policy"] = case["replica_rule"]
    if case["payload"] != "fp32":
        d["payload"] = case["payload"]
    return d


def case_cfg(case: dict):
    """The composed config of a case (as ``run.py`` with :func:`occult.matrix.overrides`
    composes it; the system's options set as a dict, so that an option a system lacks is
    refused by validation, as on the command line by composition)."""
    P, G = world_of(case)
    cfg = copy.deepcopy(base_cfg(case["task"], case["shortcut"], P))
    with open_dict(cfg):
        cfg.cluster.devices_per_node = G
        cfg.system = system_dict(case)
        cfg.task.microbatches = case["microbatches"]
        if case["grad_sync"] != "end":
            cfg.task.grad_sync = case["grad_sync"]
        if case["placement"] != "contiguous":
            cfg.task.placement = "eplb"
            cfg.task.num_redundant = 4
        cfg.task.migration = case["migration"]
    return cfg


# --- running a case in a world -------------------------------------------------------------

# the whole model of every case: the OLMoE or ScMoE proxy at toy widths (E = 8, K = 2, two
# MoE layers), float64, random weights; 2 sequences per rank (micro-batches: 2) of 8 tokens
# from a 16-token vocabulary, so the 32 or 64 tokens of a world hold repeats (pigeonhole)
SMALL = {"hidden_size": 32, "expert_ffn_size": 16, "num_layers": 2, "num_experts": 8, "top_k": 2,
         "first_k_dense": 0, "init": "random", "dtype": "float64"}
SEQ_LEN, VOCAB = 8, 16
# a compressed payload's whole-model tolerance (relative, logits and gradients: the rows
# cross rounded; the sampled cases measured at most bf16 6.1e-3, int8 1.1e-2, fp8 5.8e-2)
PAYLOAD_TOLERANCE = {"bf16": 2e-2, "int8": 5e-2, "fp8": 2.5e-1}


def expert_loads(case: dict) -> dict:
    """Seeded Zipf-like loads of the 8 experts of each MoE layer (EPLB's profiling input)."""
    import torch
    g = torch.Generator().manual_seed(39)
    pop = 1.0 / torch.arange(1, 9, dtype=torch.float64) ** 1.2
    return {layer: 1000 * pop[torch.randperm(8, generator=g)] for layer in range(SMALL["num_layers"])}


def case_placements(case: dict):
    """``{layer: SlotPlacement}`` of an EPLB case (4 redundant slots; on two nodes the world's
    node layout), None for a contiguous one."""
    from occult.placement.eplb import eplb_placements
    if case["placement"] == "contiguous":
        return None
    P, G = world_of(case)
    return eplb_placements(expert_loads(case), 4, P, G)


def eplb_balance(case: dict) -> tuple:
    """(two nodes, one node): the devices' max / mean load of EPLB's placement of the case's
    loads on P = 4 (2 x 2 and one node of 4), worst over layers."""
    from occult.placement.eplb import eplb_placements
    from test_load import _device_max_over_mean
    loads = expert_loads(case)
    many, one = eplb_placements(loads, 4, 4, 2), eplb_placements(loads, 4, 4, 0)
    return (max(_device_max_over_mean(many[l], loads[l]) for l in loads),
            max(_device_max_over_mean(one[l], loads[l]) for l in loads))


def run_config(case: dict):
    """The system config a case runs and its tolerance: an exact system as it is; a lossy
    one with its loss switched off (its lossless options) but for a compressed payload, which
    it keeps and is held to :data:`PAYLOAD_TOLERANCE`."""
    from occult.ep import system_config
    from occult.tasks.common import MODEL_TOLERANCE
    d = system_dict(case)
    config = system_config(d)
    if not config.is_exact():
        off = {k: v for k, v in config.lossless_options().items() if k not in ("payload", "combine_payload")}
        config = system_config({**d, **off})
    tol = MODEL_TOLERANCE[config.precision] if case["payload"] == "fp32" else PAYLOAD_TOLERANCE[case["payload"]]
    return config, tol


def _inspect(case: dict, config):
    """What the outputs cannot show, read from the rank model and its recorder after the run:
    valid rows <= wire rows; a non-yielding library collective's exposed time = its whole
    time (co-executed); the plan's traffic (every rank's routing gathered) = the logged one."""
    def inspect(model, rec):
        import torch.distributed as dist
        from occult.ep.plan import RowShape, plan_world, rank_events, traffic_of
        from occult.models.ep_block import EPMoEBlock
        import torch
        rec.settle()
        out = {"valid_over_wire": [(int(sum(ev.valid_P)), int(sum(ev.rows_P))) for ev in rec.comm
                                   if ev.valid_P is not None]}
        caps = config.capabilities()
        if case["microbatches"] > 1 and not caps.has("yields"):
            # the library's forward collectives ran inside strands: each one's exposed_comm span
            # is its whole time (the harness's own collectives beside them, e.g. Tutel's routing
            # all-reduces, phase counts, yield: theirs is less)
            spans: dict = {}
            for layer, name, direction, s in rec.spans:
                if name == "exposed_comm" and direction == "forward":
                    spans.setdefault(layer, []).append(s)
            unmatched = []
            for ev in rec.comm:
                if ev.direction != "forward" or ev.phase == "counts" or ev.layer < 0:   # layer -1: migration's
                    continue
                if ev.seconds in spans.get(ev.layer, []):
                    spans[ev.layer].remove(ev.seconds)
                else:
                    unmatched.append((ev.layer, ev.phase, ev.seconds))
            out["exposed_not_total"] = unmatched
            out["library_collectives"] = sum(ev.direction == "forward" and ev.phase != "counts" and ev.layer >= 0
                                             for ev in rec.comm)
        blocks = {m.layer_idx: m for m in model.modules() if isinstance(m, EPMoEBlock)}
        if case["dispatch_mode"] == "static":
            out["guard"] = guarded(blocks, model.config.hidden_size)
        if not caps.has("traffic_plan") or case["migration"]:
            return out
        P = dist.get_world_size()
        mine = {}
        for layer, ids_TK, w_TK, _ in rec.routing:
            mine.setdefault(layer, []).append((ids_TK.cpu(), w_TK.cpu()))
        every = [None] * P
        dist.all_gather_object(every, mine)
        m = model.config
        shape = RowShape(m.hidden_size, SMALL["expert_ffn_size"], torch.float64)
        training = case["task"] == "train"
        planned, rank = [], dist.get_rank()
        for layer, block in sorted(blocks.items()):
            for call in range(len(mine.get(layer, []))):
                world = plan_world(block.dispatcher, [every[r][layer][call] for r in range(P)], shape,
                                   training=training, backward=training)
                planned += rank_events(world, rank, layer)
        logged = {k: v for k, v in traffic_of(rec.comm).items() if k[0] in blocks}
        sim = traffic_of(planned)
        out["plan_disagrees"] = [f"{k}: plan {sim.get(k)} != logged {logged.get(k)}"
                                 for k in sorted(set(sim) | set(logged), key=repr) if sim.get(k) != logged.get(k)]
        return out
    return inspect


def guarded(blocks: dict, hidden: int) -> str:
    """Each of the rank model's static MoE blocks, forward and backward on 3 tokens, under
    :func:`occult.ep.host_sync.no_host_sync` with a recorder that times by marks: "" when
    nothing synchronised, else the guard's line."""
    import torch
    import torch.distributed as dist
    from occult.ep import Recorder
    from occult.ep.accounting import recording
    from occult.ep.host_sync import HostSync, no_host_sync
    g = torch.Generator().manual_seed(dist.get_rank())
    for layer, block in sorted(blocks.items()):
        x = torch.randn(1, 3, hidden, generator=g, dtype=torch.float64).requires_grad_(True)
        try:
            with no_host_sync(), recording(Recorder(rank=dist.get_rank(), marks=True)):
                y = block(x)
                (y * y).sum().backward()
        except HostSync as err:
            return f"layer {layer}: {str(err).splitlines()[0]}"
    return ""


def run_case(ctx, case: dict) -> dict:
    """One case on this rank: the whole model against the single-device model (forward, and
    backward for train), and :func:`_inspect`'s readings."""
    from occult.parity import check_model
    from occult.tasks.migration import MigratingModel
    from occult.tasks.model import _placements
    base = base_cfg(case["task"], case["shortcut"], world_of(case)[0])
    model = {**OmegaConf.to_container(base.model, resolve=True), **SMALL}
    config, tol = run_config(case)
    batch = 2
    task = {"microbatches": case["microbatches"], "grad_sync": case["grad_sync"]}
    cfg_dict = {"model": model, "seed": 39, "task": task}
    placements = case_placements(case)
    wrap = None
    if case["migration"]:
        cfg = OmegaConf.create({"model": model})
        wrap = lambda m: MigratingModel(ctx, m, _placements(cfg, ctx, m))    # noqa: E731
    res = check_model(ctx, cfg_dict, batch, SEQ_LEN, vocab_size=VOCAB, placements=placements, system=config,
                      wrap=wrap, forward_tolerance=tol, backward=case["task"] == "train",
                      inspect=_inspect(case, config))
    res["tolerance"] = tol
    res.pop("routing", None)
    res.pop("grad_sync", None)
    return res


def matrix_world(ctx, cases: list) -> list:
    """Every case of ``cases`` in this world: a result, or the error's line (one case's
    failure does not stop the others)."""
    out = []
    for case in cases:
        try:
            out.append(run_case(ctx, case))
        except Exception as exc:        # noqa: BLE001 - reported per case by the test
            out.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
    return out


def failures(case: dict, per_rank: list) -> list:
    """What is wrong with one case's results (every rank's): one line each."""
    from occult.matrix import label
    out = []
    for rank, res in enumerate(per_rank):
        where = f"{label(case)} rank={rank}"
        if "error" in res:
            out.append(f"{where}: {res['error']}")
            continue
        bad = {k: v for k, v in res["errors"].items() if not v <= res["tolerance"]}
        if bad or not res["forward_agrees"]:
            out.append(f"{where}: off the single-device model {res['errors']} (tolerance {res['tolerance']:g})")
        if case["task"] == "train" and not res["backward"]:
            out.append(f"{where}: the backward did not run")
        seen = res.get("inspected", {})
        over = [(v, w) for v, w in seen.get("valid_over_wire", []) if v > w]
        if over:
            out.append(f"{where}: valid rows above wire rows {over}")
        if seen.get("guard"):
            out.append(f"{where}: the static step synchronised the host: {seen['guard']}")
        if case["dispatch_mode"] == "static" and "guard" not in seen:
            out.append(f"{where}: the static step was not run under the guard")
        if seen.get("exposed_not_total"):
            out.append(f"{where}: non-yielding collectives whose exposed_comm is not their whole time "
                       f"{seen['exposed_not_total']}")
        if "library_collectives" in seen and not seen["library_collectives"]:
            out.append(f"{where}: no library collective to check")
        out += [f"{where}: {line}" for line in seen.get("plan_disagrees", [])]
    if case["placement"] == "eplb_two_nodes":
        many, one = eplb_balance(case)
        if not many <= 1.1 * one:
            out.append(f"{label(case)}: EPLB on two nodes balances {many:.3f} against one node's {one:.3f}")
    return out
