"""ExFlow's inter-layer expert affinity and expert placement by integer programming.

Under ExFlow's context-coherent expert parallelism (:mod:`baselines.exflow`) a
token leaves MoE layer l on the device of its highest-weight expert and enters
layer l+1 there; every expert of layer l+1 that it chose on another device is
a cross-device hop. ExFlow measures how strongly a token's expert at layer l
predicts its experts at layer l+1, P(expert j at l+1 | expert i at l), and
places experts so that likely hops stay on one device.

* **Transitions** (:func:`transition_counts`): for each pair of consecutive MoE
  layers, ``counts_EE[i, j]`` = number of (token, source expert, expert) hops
  with source expert i at layer l and expert j in the token's top-k at layer
  l+1. The source expert is ``source="primary"`` (default: the highest-weight
  expert, the device the token sits on under :mod:`baselines.exflow`'s combine
  rule; for top-1 this is ExFlow's own definition) or ``source="all"`` (every
  top-k expert of layer l, K*K hops per token). Divided by each source's token
  count they are P(j in the top-k at l+1 | i at l) (:func:`conditional_probability`).
* **Cross-device fraction** (:func:`cross_device_fraction`): the share of hops
  whose two experts sit on different devices under per-layer placements.
* **Placement** (:func:`place_by_affinity`): minimise that share with binary
  x[layer, expert, device] and exactly E/P experts per device per layer, solved
  by recursive bisection (ExFlow's approach, which also maps onto node/GPU
  hierarchies): the devices are split into two halves, one integer program
  assigns every (layer, expert) to a half (``E_sub * P_half / P_sub`` experts of
  each layer on each side) minimising the hop weight cut between halves, and
  each half is split again until one device remains. Each program is

      min  sum_{hops (a, b)} w_ab * d_ab
      s.t. d_ab >= x_a - x_b,  d_ab >= x_b - x_a        (d_ab = 1 iff cut)
           sum_{experts of layer l} x = n_right       for every layer l
           x binary, 0 <= d <= 1

  solved with HiGHS (``highspy``) under a wall-clock budget shared by the
  P - 1 programs (each gets the remaining budget divided by the programs still
  to solve; HiGHS runs in a child process that is stopped at the limit, as
  HiGHS itself looks at its clock only between solver phases). A program
  starts from the contiguous split improved by block coordinate descent over
  the layers (with the other layers fixed, the best split of one layer is
  exact and cheap: hops only join different layers), so a program stopped by
  its time limit still returns a feasible split no worse than that start; each
  :class:`Bisection` reports the contiguous, start and final cuts, the solver's
  status and gap. The cut edges of a bisection are cross-device in the final
  placement and edges inside a half are decided below it, so the cuts over all
  programs add up to the cross-device hop weight.

Placements move expert weights only; they never change the model's function.
:func:`save_exflow_placements` writes them as a placement artifact
(:func:`occult.placement.save_placements`) that ``system.placement_file`` reads.

Shapes: T tokens, K top-k, S source experts per token (1 or K), E experts,
P devices, N nodes (layer, expert) of one program, W weighted hops (edges).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from occult.ep import Placement
from occult.placement.coactivation import usage_matrix

SOURCES = ("primary", "all")


# ---------------------------------------------------------------------------
# routing -> transitions
# ---------------------------------------------------------------------------


def trace_routing(df, layer: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A layer's top-k ids [T, K] and gate weights [T, K] (None when the trace has none)
    from a routing trace (:func:`occult.routing_traces.load_trace`), tokens in (rank, token)
    order, so that row t is the same token in every layer."""
    sel = df[df.layer == layer].sort_values(["rank", "token", "slot"])
    if sel.empty:
        raise ValueError(f"routing trace: no rows for layer {layer}; layers: {sorted(df.layer.unique())}")
    K = int(sel.slot.max()) + 1
    ids_TK = torch.tensor(sel.expert.to_numpy(), dtype=torch.long, device="cpu").view(-1, K)
    weights = sel.weight.to_numpy()
    weights_TK = None if np.isnan(weights).any() else torch.tensor(weights, dtype=torch.float64, device="cpu").view(-1, K)
    return ids_TK, weights_TK


def routing_from_trace(df) -> dict:
    """``{layer: (ids_TK, weights_TK or None)}`` for every MoE layer of a routing trace."""
    return {int(layer): trace_routing(df, int(layer)) for layer in sorted(df.layer.unique())}


def source_experts(ids_TK: torch.Tensor, weights_TK: Optional[torch.Tensor], source: str) -> torch.Tensor:
    """The experts a token hops *from* after a layer: [T, S]. ``primary``: the highest-weight
    expert (slot 0, the router's top choice, when no weights are given); ``all``: all K."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: allowed values are {list(SOURCES)}")
    if source == "all":
        return ids_TK
    if weights_TK is None:
        return ids_TK[:, :1]
    return ids_TK.gather(1, weights_TK.argmax(dim=1, keepdim=True))


def transition_counts(routing: dict, num_experts: int, source: str = "primary") -> dict:
    """Hop counts between consecutive MoE layers: ``{(l, l_next): counts_EE}`` (float64).

    ``routing``: ``{layer: (ids_TK, weights_TK or None)}`` for the same tokens in every
    layer (row t is one token). ``counts_EE[i, j]`` counts tokens that hop from source
    expert i at layer l (see :func:`source_experts`) to expert j in their top-k at l_next.
    """
    layers = sorted(routing)
    out = {}
    for here, nxt in zip(layers, layers[1:]):
        ids_TK, weights_TK = routing[here]
        next_TK = routing[nxt][0]
        if ids_TK.shape[0] != next_TK.shape[0]:
            raise ValueError(f"routing: layers {here} and {nxt} hold {ids_TK.shape[0]} and "
                             f"{next_TK.shape[0]} tokens; transitions need the same tokens in every layer")
        src_TE = usage_matrix(source_experts(ids_TK, weights_TK, source), num_experts)
        dst_TE = usage_matrix(next_TK, num_experts)
        out[(here, nxt)] = src_TE.t() @ dst_TE
    return out


def conditional_probability(counts_EE: torch.Tensor, top_k: int) -> torch.Tensor:
    """P(expert j in the top-k at l+1 | source expert i at l): [E, E], each used row sums
    to ``top_k`` (every source contributes one hop to each of the K experts at l+1;
    rows of experts that are never a source are zero)."""
    sources_E1 = counts_EE.sum(dim=1, keepdim=True) / top_k
    return counts_EE / sources_E1.clamp_min(1e-30)


# ---------------------------------------------------------------------------
# the objective
# ---------------------------------------------------------------------------


def cross_device_hops(counts_EE: torch.Tensor, here: Placement, nxt: Placement) -> tuple[float, float]:
    """(cross-device hop weight, total hop weight) of one layer pair under its placements."""
    cross_EE = here.device_E.unsqueeze(1) != nxt.device_E.unsqueeze(0)
    return float(counts_EE[cross_EE].sum()), float(counts_EE.sum())


def cross_device_fraction(transitions: dict, placements: dict) -> float:
    """Share of all hops (every layer pair together) whose experts sit on different devices."""
    cross = total = 0.0
    for (here, nxt), counts_EE in transitions.items():
        c, t = cross_device_hops(counts_EE, placements[here], placements[nxt])
        cross, total = cross + c, total + t
    return cross / total if total else float("nan")


# ---------------------------------------------------------------------------
# one bisection: an integer program
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bisection:
    """One program's outcome: which devices it split, how, and how the solver ended."""

    devices: tuple
    right_devices: tuple
    nodes: int
    edges: int
    status: str           # HiGHS model status ("Optimal", "Time limit reached", ...)
    mip_gap: float        # relative gap at the end (0 when proved optimal)
    cut: float            # hop weight cut by the chosen split
    start_cut: float      # ... by the solver's start (contiguous, improved by descent)
    contiguous_cut: float  # ... by the contiguous split
    time_limit_s: float
    seconds: float


@dataclass
class AffinityPlacement:
    """The result of :func:`place_by_affinity`."""

    placements: dict                  # {layer: Placement}
    seconds: float                    # wall time of all programs (model building included)
    time_limit_s: float
    bisections: list = field(default_factory=list)

    def summary(self) -> dict:
        return {"solver": "highs", "solver_version": _highs_version(), "seconds": self.seconds,
                "time_limit_s": self.time_limit_s, "programs": len(self.bisections),
                "proved_optimal": sum(b.status == "Optimal" for b in self.bisections),
                "bisections": [asdict(b) for b in self.bisections]}


def _highs_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("highspy")


def _edges(transitions: dict, members: dict, node_of: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weighted hops between this program's nodes: (a_W, b_W, weight_W)."""
    a, b, w = [], [], []
    for (here, nxt), counts_EE in transitions.items():
        if here not in members or nxt not in members:
            continue
        sub = counts_EE[members[here]][:, members[nxt]].numpy()
        i, j = np.nonzero(sub)
        a.append(node_of[here] + i)
        b.append(node_of[nxt] + j)
        w.append(sub[i, j])
    if not a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    return np.concatenate(a), np.concatenate(b), np.concatenate(w)


def _program(num_nodes: int, a_W, b_W, weight_W, layer_nodes: list, n_right: int, fix_node: Optional[int]):
    """The HiGHS model of one bisection: columns x (N binaries) then d (W in [0, 1])."""
    import highspy

    N, W = num_nodes, a_W.size
    lp = highspy.HighsLp()
    lp.num_col_ = N + W
    lp.col_cost_ = np.concatenate([np.zeros(N), weight_W]).astype(np.float64)
    lp.col_lower_ = np.zeros(N + W)
    upper = np.ones(N + W)
    if fix_node is not None:          # the two halves are interchangeable: break the symmetry
        upper[fix_node] = 0.0
    lp.col_upper_ = upper
    lp.integrality_ = [highspy.HighsVarType.kInteger] * N + [highspy.HighsVarType.kContinuous] * W
    # rows: d - x_a + x_b >= 0 and d + x_a - x_b >= 0 for every hop; sum_layer x = n_right
    d_W = N + np.arange(W)
    hop_index = np.concatenate([np.stack([d_W, a_W, b_W], 1), np.stack([d_W, a_W, b_W], 1)])
    hop_value = np.concatenate([np.tile([1.0, -1.0, 1.0], (W, 1)), np.tile([1.0, 1.0, -1.0], (W, 1))])
    index = np.concatenate([hop_index.reshape(-1)] + [np.asarray(nodes) for nodes in layer_nodes])
    value = np.concatenate([hop_value.reshape(-1)] + [np.ones(len(nodes)) for nodes in layer_nodes])
    lengths = [3] * (2 * W) + [len(nodes) for nodes in layer_nodes]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    num_rows = 2 * W + len(layer_nodes)
    lp.num_row_ = num_rows
    lp.row_lower_ = np.concatenate([np.zeros(2 * W), np.full(len(layer_nodes), float(n_right))])
    lp.row_upper_ = np.concatenate([np.full(2 * W, highspy.kHighsInf), np.full(len(layer_nodes), float(n_right))])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = N + W
    lp.a_matrix_.num_row_ = num_rows
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
    return lp


# the solver's last word (its final status) may arrive this long after its budget
SOLVER_GRACE_S = 0.25


def _highs_child(lp, start_x: np.ndarray, a_W, b_W, time_limit_s: float, seed: int, conn) -> None:
    """In a child process: HiGHS from ``start_x``; every improving solution, then the
    final (x, status, gap), goes to ``conn``."""
    import highspy

    N = start_x.size
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(float(time_limit_s), 1e-3))
    h.setOptionValue("random_seed", int(seed))
    # the start below is the incumbent; HiGHS's feasibility-jump heuristic, which runs
    # before the root node without looking at the clock, would only overrun the budget
    h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    h.passModel(lp)
    sol = highspy.HighsSolution()
    sol.col_value = np.concatenate([start_x, np.abs(start_x[a_W] - start_x[b_W])]).astype(np.float64).tolist()
    h.setSolution(sol)

    def improving(kind, message, data_out, data_in, user):
        conn.send(("incumbent", np.round(np.asarray(data_out.mip_solution)[:N]).astype(np.int64),
                   float(data_out.mip_gap)))

    h.setCallback(improving, None)
    h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution)
    h.run()
    info = h.getInfo()
    x = None
    if info.primal_solution_status == 2:      # a feasible point exists
        x = np.round(np.asarray(h.getSolution().col_value[:N])).astype(np.int64)
    conn.send(("done", x, h.modelStatusToString(h.getModelStatus()), float(info.mip_gap)))
    conn.close()


def _solve(lp, start_x: np.ndarray, a_W, b_W, time_limit_s: float, seed: int):
    """HiGHS from ``start_x`` under a hard wall-clock limit; returns (x [N] as 0/1, status, gap).

    HiGHS looks at its clock only between solver phases (its root cut separation can run
    well past the limit), so it runs in a forked child that streams its improving
    solutions; at the limit (plus :data:`SOLVER_GRACE_S`) the child is killed and the
    best solution received is kept (status ``"Stopped at the time limit"``)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")      # the model is inherited, not pickled
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_highs_child, args=(lp, start_x, a_W, b_W, time_limit_s, seed, send), daemon=True)
    deadline = time.perf_counter() + max(time_limit_s, 0.0) + SOLVER_GRACE_S
    child.start()
    send.close()
    x, status, gap = start_x, "Stopped at the time limit", float("inf")
    try:
        while receive.poll(max(deadline - time.perf_counter(), 0.0)):
            msg = receive.recv()
            if msg[0] == "incumbent":
                x, gap = msg[1], msg[2]
                continue
            x = msg[1] if msg[1] is not None else x
            status, gap = msg[2], msg[3]
            break
    except EOFError:                    # the child died without a last word
        status = f"Solver exited with code {child.exitcode}"
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    return x, status, gap


def _cut(x: np.ndarray, a_W, b_W, weight_W) -> float:
    return float(weight_W[x[a_W] != x[b_W]].sum())


def _descend(x: np.ndarray, a_W, b_W, weight_W, layer_nodes: list, n_right: int,
             fix_node: Optional[int], max_sweeps: int = 20) -> np.ndarray:
    """A better start than ``x`` by block coordinate descent over the layers: hops join
    different layers only, so with the other layers fixed, the best split of one layer is
    exact: its ``n_right`` nodes with the most hop weight to the right minus to the left.
    Each accepted step lowers the cut; sweeps alternate direction until none does."""
    x = x.copy()
    best = _cut(x, a_W, b_W, weight_W)
    for sweep in range(max_sweeps):
        changed = False
        for nodes in (layer_nodes if sweep % 2 == 0 else layer_nodes[::-1]):
            sign_N = 2.0 * x - 1.0
            pull_N = np.zeros(x.size)
            np.add.at(pull_N, a_W, weight_W * sign_N[b_W])
            np.add.at(pull_N, b_W, weight_W * sign_N[a_W])
            pull = pull_N[nodes]
            if fix_node is not None and fix_node in nodes:
                pull = np.where(nodes == fix_node, -np.inf, pull)
            trial = x.copy()
            trial[nodes] = 0
            trial[nodes[np.argsort(-pull, kind="stable")[:n_right]]] = 1
            cut = _cut(trial, a_W, b_W, weight_W)
            if cut < best - 1e-9:
                x, best, changed = trial, cut, True
        if not changed:
            break
    return x


def _bisect(transitions: dict, members: dict, devices: tuple, time_limit_s: float, seed: int
            ) -> tuple[dict, dict, Bisection]:
    """Splits ``members`` ({layer: expert ids [n], the same n for every layer}) over the
    two halves of ``devices``: contiguous split -> descent start -> integer program."""
    t0 = time.perf_counter()
    layers = sorted(members)
    n_sub = members[layers[0]].numel()
    left, right = devices[:len(devices) // 2], devices[len(devices) // 2:]
    n_right = n_sub * len(right) // len(devices)
    node_of = {layer: pos * n_sub for pos, layer in enumerate(layers)}
    layer_nodes = [np.arange(node_of[layer], node_of[layer] + n_sub) for layer in layers]
    a_W, b_W, weight_W = _edges(transitions, members, node_of)
    contiguous_x = np.zeros(n_sub * len(layers), dtype=np.int64)
    for nodes in layer_nodes:             # the highest expert ids go right
        contiguous_x[nodes[n_sub - n_right:]] = 1
    fix = 0 if len(left) == len(right) else None      # equal halves are interchangeable
    start_x = _descend(contiguous_x, a_W, b_W, weight_W, layer_nodes, n_right, fix)
    lp = _program(start_x.size, a_W, b_W, weight_W, layer_nodes, n_right, fix)
    x, status, gap = _solve(lp, start_x, a_W, b_W, time_limit_s - (time.perf_counter() - t0), seed)
    if _cut(x, a_W, b_W, weight_W) > _cut(start_x, a_W, b_W, weight_W):
        x = start_x                       # the solver's incumbent is never kept when worse
    halves = ({}, {})
    for layer, nodes in zip(layers, layer_nodes):
        side = torch.from_numpy(x[nodes])
        halves[0][layer] = members[layer][side == 0]
        halves[1][layer] = members[layer][side == 1]
    report = Bisection(tuple(devices), tuple(right), int(x.size), int(a_W.size), status, gap,
                       _cut(x, a_W, b_W, weight_W), _cut(start_x, a_W, b_W, weight_W),
                       _cut(contiguous_x, a_W, b_W, weight_W), float(time_limit_s),
                       time.perf_counter() - t0)
    return halves[0], halves[1], report


def place_by_affinity(transitions: dict, num_experts: int, num_devices: int, *, layers=None,
                      time_limit_s: float = 30.0, seed: int = 0) -> AffinityPlacement:
    """Per-layer placements with few cross-device hops (recursive bisection, HiGHS).

    ``transitions``: from :func:`transition_counts`; ``layers``: every MoE layer to place
    (default: the layers named in ``transitions``); ``time_limit_s``: wall-clock budget
    of all P - 1 programs together.
    """
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"num_experts={num_experts} does not split into {num_devices} equal device "
                         f"groups (cluster.world_size must divide model.num_experts)")
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s={time_limit_s}: must be > 0")
    layers = sorted(layers if layers is not None else {l for pair in transitions for l in pair})
    if not layers:
        raise ValueError("place_by_affinity: no MoE layers to place")
    t0 = time.perf_counter()
    device_of = {layer: torch.full((num_experts,), -1, dtype=torch.long, device="cpu") for layer in layers}
    queue = [({layer: torch.arange(num_experts, device="cpu") for layer in layers}, tuple(range(num_devices)))]
    reports = []
    programs_left = num_devices - 1
    while queue:
        members, devices = queue.pop(0)
        if len(devices) == 1:
            for layer in layers:
                device_of[layer][members[layer]] = devices[0]
            continue
        remaining = time_limit_s - (time.perf_counter() - t0)
        left_m, right_m, report = _bisect(transitions, members, devices, remaining / programs_left, seed)
        programs_left -= 1
        reports.append(report)
        half = len(devices) // 2
        queue += [(left_m, devices[:half]), (right_m, devices[half:])]
    placements = {}
    for layer in layers:
        slot_E = torch.zeros(num_experts, dtype=torch.long, device="cpu")
        for p in range(num_devices):
            ids = torch.nonzero(device_of[layer] == p).flatten()
            slot_E[ids] = torch.arange(ids.numel(), device="cpu")
        placements[layer] = Placement(device_of[layer], slot_E, num_devices)
    return AffinityPlacement(placements, time.perf_counter() - t0, time_limit_s, reports)


def contiguous_placements(layers, num_experts: int, num_devices: int) -> dict:
    """``{layer: contiguous Placement}``: the baseline placement."""
    return {layer: Placement.contiguous(num_experts, num_devices) for layer in layers}


def save_exflow_placements(path, result: AffinityPlacement, meta: dict) -> Path:
    """Writes the placements as a placement artifact (``system.placement_file``), with the
    solver's summary and ``meta`` (e.g. the cross-device fractions) in its meta."""
    from occult.placement import save_placements

    save_placements(path, result.placements, {"optimiser": "exflow_affinity_ip", **result.summary(), **meta})
    return Path(path)
