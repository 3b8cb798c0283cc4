"""Expert placement optimisers: partition E experts into P equal groups.

Occult's placement rescheduling puts experts that are often chosen by the same
token on the same device, so that a token's top-k touches fewer devices (lower
C_T, the mean number of distinct devices per token). Every optimiser here
takes one layer's profiling routing (top-k ids), the device count P, a load
cap and a seed, and returns a :class:`~occult.ep.placement.Placement` with
exactly e = E / P experts per device.

Optimisers (the registry :data:`OPTIMISERS`):

- ``contiguous``: expert i on device i // e, the original placement. A
  baseline: the load cap is not applied (its balance is reported).
- ``random``: a seeded random partition, then repaired to the load cap.
- ``greedy``: Occult's Algorithm 1 style agglomeration: from singletons,
  repeatedly join the pair of groups with the largest total co-activation whose
  merged size is <= e (and merged load within the cap); then pack the groups
  into P devices of exactly e (never-co-activated experts fill the gaps).
  The seed breaks ties between equal co-activation counts *(open: the paper's
  seed choice)*.
- ``swap_search``: local search that directly minimises C_T on the profiling
  ids: from the best of greedy and contiguous, apply the pairwise swap between
  devices that lowers C_T most (every swap's exact effect is evaluated at once,
  vectorised), until none helps; then perturb with a few random swaps and
  descend again (iterated local search), keeping the best, within a round and
  time budget. Never worse than its start, so never worse than greedy under
  the same cap when greedy meets the cap.

Load: a device's load is the number of (token, expert) pairs of the profiling
tokens that land on it; ``load_cap`` bounds max device load / mean device
load (``None``: no cap). Where the cap cannot be met, the optimisers return
the most balanced result they found rather than fail.

Per-layer placement artifacts (JSON) and the helpers that permute expert and
router weights into placement order are in :mod:`occult.placement.artifacts`.

Shapes: T profiling tokens (N in the spec), E experts, K top-k, P devices,
e = E / P local experts per device, D hidden.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch

from ..ep.accounting import ct_all, intra_ratio
from ..ep.placement import Placement
from .coactivation import coactivation, expert_load, usage_matrix

# ---------------------------------------------------------------------------
# checks and load accounting
# ---------------------------------------------------------------------------


def _one_thread(fn):
    """Runs ``fn`` with one intra-op thread, restoring the setting after.

    The optimisers do many small tensor operations; on a busy 2-core machine the
    OpenMP threads spin against each other and made them about 8x slower. The
    setting is process-wide while ``fn`` runs.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


def check_partition(num_experts: int, num_devices: int) -> int:
    """Returns e = E / P; raises ``ValueError`` if E experts do not split into P equal groups."""
    if num_devices < 1 or num_experts % num_devices:
        divisors = [p for p in range(1, num_experts + 1) if num_experts % p == 0]
        raise ValueError(f"placement: num_devices={num_devices} does not split num_experts={num_experts} "
                         f"into equal groups; allowed num_devices: {divisors}")
    return num_experts // num_devices


def check_load_cap(load_cap: Optional[float]) -> None:
    """Raises ``ValueError`` unless ``load_cap`` is None or a number >= 1."""
    if load_cap is not None and not (isinstance(load_cap, (int, float)) and load_cap >= 1.0):
        raise ValueError(f"placement.load_cap={load_cap!r}: allowed values are null (no cap) or a "
                         f"number >= 1.0 (max device load / mean device load)")


def _cap_abs(load_E: torch.Tensor, num_devices: int, load_cap: Optional[float]) -> float:
    """The cap as an absolute device load (inf without a cap)."""
    if load_cap is None:
        return float("inf")
    return load_cap * float(load_E.sum()) / num_devices + 1e-9


def _device_loads(device_E: torch.Tensor, load_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """Sum of expert loads per device: [E], [E] -> [P] (float64)."""
    return torch.zeros(num_devices, dtype=torch.float64, device=device_E.device).index_add_(0, device_E, load_E.double())


def device_load(topk_ids_TK: torch.Tensor, placement: Placement) -> torch.Tensor:
    """(token, expert) pairs landing on each device: shape [P] (long)."""
    return torch.bincount(placement.device_E[topk_ids_TK.reshape(-1).long()],
                          minlength=placement.num_devices)


def load_max_over_mean(topk_ids_TK: torch.Tensor, placement: Placement) -> float:
    """Max device load / mean device load (1.0 is perfect balance; nan without tokens)."""
    load_P = device_load(topk_ids_TK, placement).double()
    return float("nan") if load_P.sum() == 0 else float(load_P.max() / load_P.mean())


def placement_summary(topk_ids_TK: torch.Tensor, placement: Placement) -> dict:
    """The figures reported beside a placement: C_T, intra-collaboration ratio, load balance."""
    return {"ct_all": ct_all(topk_ids_TK, placement),
            "intra_ratio": intra_ratio(topk_ids_TK, placement),
            "load_max_over_mean": load_max_over_mean(topk_ids_TK, placement)}


def _placement_from_device(device_E: torch.Tensor, num_devices: int) -> Placement:
    """Placement with each device's experts in ascending id order."""
    return Placement.from_groups([torch.nonzero(device_E == p).flatten().tolist()
                                  for p in range(num_devices)])


def rebalance(device_E: torch.Tensor, load_E: torch.Tensor, num_devices: int, cap_abs: float) -> torch.Tensor:
    """Swaps experts out of the heaviest device until every device load is <= ``cap_abs``
    or no swap lowers the heaviest device's load: [E] -> [E] (device of each expert).

    Each step swaps an expert a of the heaviest device h with a lighter expert b
    of another device q, choosing the pair that makes max(load_h, load_q) smallest.
    """
    device_E = device_E.clone()
    load_E = load_E.double()
    loads_P = _device_loads(device_E, load_E, num_devices)
    E = device_E.numel()
    for _ in range(E * E):
        h = int(torch.argmax(loads_P))
        if loads_P[h] <= cap_abs:
            break
        in_h = device_E == h
        a_A, b_B = torch.nonzero(in_h).flatten(), torch.nonzero(~in_h).flatten()
        d_AB = load_E[a_A].unsqueeze(1) - load_E[b_B].unsqueeze(0)
        new_max_AB = torch.maximum(loads_P[h] - d_AB, loads_P[device_E[b_B]].unsqueeze(0) + d_AB)
        new_max_AB = new_max_AB.masked_fill(d_AB <= 0, float("inf"))
        best = int(torch.argmin(new_max_AB))
        if not new_max_AB.flatten()[best] < loads_P[h]:
            break
        a, b = int(a_A[best // b_B.numel()]), int(b_B[best % b_B.numel()])
        q, d = int(device_E[b]), float(load_E[a] - load_E[b])
        device_E[a], device_E[b] = q, h
        loads_P[h] -= d
        loads_P[q] += d
    return device_E


# ---------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------


def contiguous(topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, *,
               load_cap: Optional[float] = None, seed: int = 0,
               time_limit_s: Optional[float] = None) -> Placement:
    """Expert i on device i // e: the original placement (cap not applied; a baseline)."""
    check_partition(num_experts, num_devices)
    check_load_cap(load_cap)
    return Placement.contiguous(num_experts, num_devices)


@_one_thread
def random(topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, *,
           load_cap: Optional[float] = None, seed: int = 0,
           time_limit_s: Optional[float] = None) -> Placement:
    """A seeded random equal partition, repaired by :func:`rebalance` if above the cap."""
    e = check_partition(num_experts, num_devices)
    check_load_cap(load_cap)
    perm_E = torch.randperm(num_experts, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu")
    device_E = torch.empty(num_experts, dtype=torch.long, device="cpu")
    device_E[perm_E] = torch.arange(num_experts, device="cpu") // e
    load_E = expert_load(topk_ids_TK, num_experts)
    device_E = rebalance(device_E, load_E, num_devices, _cap_abs(load_E, num_devices, load_cap))
    return _placement_from_device(device_E, num_devices)


# ---------------------------------------------------------------------------
# greedy agglomeration (Occult Algorithm 1 style)
# ---------------------------------------------------------------------------


def _agglomerate(counts_EE: torch.Tensor, e: int, cap_abs: float, seed: int) -> list[list[int]]:
    """Joins groups by largest total co-activation while the merged group has <= e experts
    and load <= ``cap_abs``; stops when no positive-affinity pair may merge.

    Returns the groups (lists of expert ids); never-co-activated experts stay singletons.
    Group-to-group affinity is kept in an [E, E] matrix indexed by each group's first member.
    """
    E = counts_EE.shape[0]
    affinity_EE = counts_EE.double().clone()
    affinity_EE.fill_diagonal_(0)
    # seeded tie-break: counts are integers, so a jitter in [0, 0.5) only orders equal counts
    jitter_EE = torch.rand(E, E, generator=torch.Generator(device="cpu").manual_seed(seed), dtype=torch.float64,
                           device="cpu").to(counts_EE.device) * 0.5
    upper_EE = torch.ones(E, E, dtype=torch.bool, device=counts_EE.device).triu(1)
    members = [[i] for i in range(E)]
    alive_E = torch.ones(E, dtype=torch.bool, device=counts_EE.device)
    size_E = torch.ones(E, dtype=torch.float64, device=counts_EE.device)
    load_E = torch.diagonal(counts_EE).double().clone()
    while True:
        ok_EE = (upper_EE & alive_E.unsqueeze(0) & alive_E.unsqueeze(1) & (affinity_EE > 0)
                 & (size_E.unsqueeze(0) + size_E.unsqueeze(1) <= e)
                 & (load_E.unsqueeze(0) + load_E.unsqueeze(1) <= cap_abs))
        if not bool(ok_EE.any()):
            break
        best = int(torch.argmax(torch.where(ok_EE, affinity_EE + jitter_EE, -torch.inf)))
        i, j = best // E, best % E
        members[i] += members[j]
        size_E[i] += size_E[j]
        load_E[i] += load_E[j]
        affinity_EE[i] += affinity_EE[j]
        affinity_EE[:, i] += affinity_EE[:, j]
        affinity_EE[i, i] = 0
        affinity_EE[j] = 0
        affinity_EE[:, j] = 0
        alive_E[j] = False
    return [members[i] for i in range(E) if alive_E[i]]


def _pack(groups: list[list[int]], counts_EE: torch.Tensor, num_devices: int, cap_abs: float) -> torch.Tensor:
    """Packs groups (sizes <= e) into P devices of exactly e experts: returns device_E [E].

    Largest groups first; each goes to the device it collaborates with most among those
    with room (and load within the cap when any such device exists), ties to the lighter
    device. A group that fits nowhere is split: the device with most room takes the
    group's experts that collaborate most with it.
    """
    E = counts_EE.shape[0]
    e = E // num_devices
    counts_EE = counts_EE.double()
    load_E = torch.diagonal(counts_EE)
    order = sorted(range(len(groups)), key=lambda g: (-len(groups[g]), -float(load_E[groups[g]].sum()), g))
    bins: list[list[int]] = [[] for _ in range(num_devices)]
    bin_load_P = torch.zeros(num_devices, dtype=torch.float64, device=counts_EE.device)
    for g in order:
        items = list(groups[g])
        while items:
            room_P = torch.tensor([e - len(b) for b in bins], device=counts_EE.device)
            affinity_P = torch.tensor([float(counts_EE[items][:, b].sum()) if b else 0.0 for b in bins],
                                      device=counts_EE.device)
            fits_P = room_P >= len(items)
            if bool(fits_P.any()):
                within_P = fits_P & (bin_load_P + load_E[items].sum() <= cap_abs)
                ok_P = within_P if bool(within_P.any()) else fits_P
                key_P = torch.where(ok_P, affinity_P - 1e-12 * bin_load_P, -torch.inf)
                p, take = int(torch.argmax(key_P)), items
            else:
                p = int(torch.argmax(room_P.double() - 1e-12 * bin_load_P))
                to_bin = counts_EE[items][:, bins[p]].sum(1) if bins[p] else torch.zeros(len(items), device=counts_EE.device)
                keep = torch.argsort(to_bin, descending=True, stable=True)[: int(room_P[p])]
                take = [items[i] for i in keep.tolist()]
            bins[p] += take
            bin_load_P[p] += load_E[take].sum()
            items = [x for x in items if x not in set(take)]
    device_E = torch.empty(E, dtype=torch.long, device=counts_EE.device)
    for p, b in enumerate(bins):
        device_E[torch.tensor(b, dtype=torch.long, device=counts_EE.device)] = p
    return device_E


def _intra_coactivation(device_E: torch.Tensor, counts_EE: torch.Tensor) -> float:
    """Co-activation count between experts on the same device (off-diagonal, both orders)."""
    same_EE = device_E.unsqueeze(0) == device_E.unsqueeze(1)
    return float((counts_EE.double() * same_EE).sum() - torch.diagonal(counts_EE).double().sum())


@_one_thread
def greedy_from_counts(counts_EE: torch.Tensor, num_devices: int, *, load_cap: Optional[float] = None,
                       seed: int = 0) -> Placement:
    """Greedy grouping from a co-activation matrix (diagonal = expert load): see :func:`greedy`."""
    E = counts_EE.shape[0]
    e = check_partition(E, num_devices)
    check_load_cap(load_cap)
    load_E = torch.diagonal(counts_EE)
    cap_abs = _cap_abs(load_E, num_devices, load_cap)
    variants = []
    for merge_cap in ((cap_abs, float("inf")) if load_cap is not None else (cap_abs,)):
        groups = _agglomerate(counts_EE, e, merge_cap, seed)
        device_E = rebalance(_pack(groups, counts_EE, num_devices, merge_cap), load_E, num_devices, cap_abs)
        over_cap = float(_device_loads(device_E, load_E, num_devices).max()) > cap_abs
        variants.append((over_cap, -_intra_coactivation(device_E, counts_EE), len(variants), device_E))
    return _placement_from_device(min(variants)[3], num_devices)


def greedy(topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, *,
           load_cap: Optional[float] = None, seed: int = 0,
           time_limit_s: Optional[float] = None) -> Placement:
    """Occult Algorithm 1 style: agglomerate the most-collaborating groups, then pack
    into P devices of e experts.

    With a load cap, two variants run: the cap enforced during merging (merged loads
    <= cap), and merging without it; each is then repaired by :func:`rebalance`, and the
    one within the cap with more intra-device co-activation is returned (on clustered
    routing the second often wins: cap-aware merging fragments the groups).
    """
    return greedy_from_counts(coactivation(topk_ids_TK, num_experts), num_devices,
                              load_cap=load_cap, seed=seed)


# ---------------------------------------------------------------------------
# swap search: direct minimisation of C_T
# ---------------------------------------------------------------------------


class _SwapState:
    """The profiling tokens' device counts under one assignment, and every swap's exact
    effect on the number of distinct (token, device) hits.

    Swapping a (device p) with b (device q) changes only tokens that use exactly one of
    them; its change in hits is ``move_EP[a, q] + move_EP[b, p] + both_EE[a, b]`` where
    ``move_EP[a, q]`` is the change if a alone moved to q, and ``both_EE`` corrects the
    tokens that use both (for them the swap changes nothing). The pair counts come from
    the [T, K] ids (bincount over the token's slot pairs); the only dense product is the
    [E, T] usage times the [T, P] empty-device mask.
    """

    def __init__(self, topk_ids_TK: torch.Tensor, device_E: torch.Tensor, num_devices: int):
        T, K = topk_ids_TK.shape
        E = device_E.numel()
        self.ids_TK = topk_ids_TK.long()
        self.num_devices = num_devices
        off_KK = ~torch.eye(K, dtype=torch.bool, device=topk_ids_TK.device)
        # key a * E + b of every ordered pair (a, b) of distinct slots of one token: [T, K, K-1]
        self.pair_key_TKJ = (self.ids_TK.unsqueeze(2) * E + self.ids_TK.unsqueeze(1))[:, off_KK].view(T, K, K - 1)
        self.tokens_of = [torch.nonzero((self.ids_TK == x).any(1)).flatten() for x in range(E)]
        # [E, T] usage as float32 (exact below 2**24 tokens): the one dense matmul is [E, T] @ [T, P]
        used_dtype = torch.float32 if T < 2 ** 24 else torch.float64
        self.used_ET = usage_matrix(self.ids_TK, E, used_dtype).t().contiguous()
        self.set_assignment(device_E)

    def set_assignment(self, device_E: torch.Tensor) -> None:
        self.device_E = device_E.clone()
        T = self.ids_TK.shape[0]
        dev = self.ids_TK.device
        self.count_TP = torch.zeros(T, self.num_devices, dtype=torch.float64, device=dev)
        self.count_TP.scatter_add_(1, self.device_E[self.ids_TK],
                                   torch.ones(self.ids_TK.shape, dtype=torch.float64, device=dev))

    def hits(self) -> int:
        """Total distinct (token, device) pairs: C_T times T."""
        return int((self.count_TP > 0.5).sum())

    def deltas(self) -> torch.Tensor:
        """Change in hits for swapping experts a and b: shape [E, E] (inf where same device)."""
        E = self.device_E.numel()
        dev_E = self.device_E
        empty_TP = (self.count_TP < 0.5).to(self.used_ET.dtype)
        # the token uses the expert and no other on its device: moving it away loses a hit
        alone_TK = self.count_TP.gather(1, dev_E[self.ids_TK]) < 1.5
        left_E = torch.bincount(self.ids_TK[alone_TK], minlength=E).double()
        move_EP = (self.used_ET @ empty_TP).double() - left_E.unsqueeze(1)
        # both_EE[a, b]: tokens using a and b with a alone on its device
        both_EE = torch.bincount(self.pair_key_TKJ[alone_TK].reshape(-1), minlength=E * E).view(E, E).double()
        delta_EE = move_EP[:, dev_E] + move_EP[:, dev_E].t() + both_EE + both_EE.t()
        return delta_EE.masked_fill(dev_E.unsqueeze(0) == dev_E.unsqueeze(1), torch.inf)

    def swap(self, a: int, b: int) -> None:
        """Exchanges the devices of experts a and b, updating only the tokens that use them."""
        p, q = int(self.device_E[a]), int(self.device_E[b])
        self.device_E[a], self.device_E[b] = q, p
        for x, src, dst in ((a, p, q), (b, q, p)):
            tok = self.tokens_of[x]
            self.count_TP[tok, src] -= 1
            self.count_TP[tok, dst] += 1


def _swap_ok(state: _SwapState, load_E: torch.Tensor, loads_P: torch.Tensor, limit: float) -> torch.Tensor:
    """Which swaps keep both devices' loads <= ``limit``: shape [E, E] (bool)."""
    dev_E = state.device_E
    d_EE = load_E.unsqueeze(1) - load_E.unsqueeze(0)                  # load moved from p to q
    new_p_EE = loads_P[dev_E].unsqueeze(1) - d_EE
    new_q_EE = loads_P[dev_E].unsqueeze(0) + d_EE
    return (new_p_EE <= limit) & (new_q_EE <= limit)


def _descend(state: _SwapState, load_E: torch.Tensor, cap_abs: float, deadline: float) -> None:
    """Best-improvement swaps until none lowers the hits (or the deadline passes).

    A swap must keep both devices within the cap, or, where the assignment is already
    above the cap, within the current max load (so balance never worsens).
    """
    loads_P = _device_loads(state.device_E, load_E, state.num_devices)
    while time.perf_counter() < deadline:
        limit = max(cap_abs, float(loads_P.max()) + 1e-9)
        delta_EE = state.deltas().masked_fill(~_swap_ok(state, load_E, loads_P, limit), torch.inf)
        best = int(torch.argmin(delta_EE))
        if not float(delta_EE.flatten()[best]) < -0.5:
            return
        a, b = best // delta_EE.shape[0], best % delta_EE.shape[0]
        p, q = int(state.device_E[a]), int(state.device_E[b])
        loads_P[p] += load_E[b] - load_E[a]
        loads_P[q] += load_E[a] - load_E[b]
        state.swap(a, b)


def _kick(state: _SwapState, load_E: torch.Tensor, cap_abs: float, num_swaps: int,
          generator: torch.Generator) -> None:
    """Random swaps between devices (each within the load limit): the perturbation of the
    iterated local search."""
    E = state.device_E.numel()
    loads_P = _device_loads(state.device_E, load_E, state.num_devices)
    limit = max(cap_abs, float(loads_P.max()) + 1e-9)
    for _ in range(num_swaps):
        ok_EE = _swap_ok(state, load_E, loads_P, limit) & (state.device_E.unsqueeze(0) != state.device_E.unsqueeze(1))
        cand = torch.nonzero(ok_EE.flatten()).flatten()
        if cand.numel() == 0:
            return
        pick = int(cand[torch.randint(cand.numel(), (1,), generator=generator, device=generator.device)])
        a, b = pick // E, pick % E
        p, q = int(state.device_E[a]), int(state.device_E[b])
        loads_P[p] += load_E[b] - load_E[a]
        loads_P[q] += load_E[a] - load_E[b]
        state.swap(a, b)


def _start_points(topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, load_cap: Optional[float],
                  seed: int, restarts: int, load_E: torch.Tensor) -> list[torch.Tensor]:
    """device_E of each start: greedy, contiguous (rebalanced to the cap) and ``restarts``
    seeded random partitions (rebalanced)."""
    cap_abs = _cap_abs(load_E, num_devices, load_cap)
    base_E = Placement.contiguous(num_experts, num_devices).device_E
    starts = [greedy(topk_ids_TK, num_experts, num_devices, load_cap=load_cap, seed=seed).device_E,
              rebalance(base_E, load_E, num_devices, cap_abs)]
    starts += [random(topk_ids_TK, num_experts, num_devices, load_cap=load_cap, seed=seed * 1000 + i + 1).device_E
               for i in range(restarts)]
    return starts


@_one_thread
def swap_search(topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, *,
                load_cap: Optional[float] = None, seed: int = 0, time_limit_s: Optional[float] = 10.0,
                restarts: int = 6, rounds: int = 10, start: Optional[Placement] = None) -> Placement:
    """Minimises C_T on the profiling ids by pairwise swaps between devices.

    Steepest descent from each start (greedy, contiguous and ``restarts`` random
    partitions, all within the cap where possible, plus ``start`` if given); from the
    best, ``rounds`` of iterated local search (a few random swaps, descend again, keep
    the best). Every swap keeps the cap (or, above it, the current max load). Stops
    early after ``time_limit_s`` seconds (None: no limit); deterministic for a seed when
    the limit is not reached. Ranking: within the cap first, then C_T, then max load.
    """
    e = check_partition(num_experts, num_devices)
    check_load_cap(load_cap)
    deadline = float("inf") if time_limit_s is None else time.perf_counter() + time_limit_s
    load_E = expert_load(topk_ids_TK, num_experts).double()
    cap_abs = _cap_abs(load_E, num_devices, load_cap)
    starts = _start_points(topk_ids_TK, num_experts, num_devices, load_cap, seed, restarts, load_E)
    if start is not None:
        starts.insert(0, start.device_E)
    state = _SwapState(topk_ids_TK, starts[0], num_devices)

    def rank(device_E: torch.Tensor, hits: int) -> tuple:
        max_load = float(_device_loads(device_E, load_E, num_devices).max())
        return (max_load > cap_abs, hits, max_load)

    best = None
    for start_E in starts:
        state.set_assignment(start_E)
        _descend(state, load_E, cap_abs, deadline)
        key = rank(state.device_E, state.hits())
        if best is None or key < best[0]:
            best = (key, state.device_E.clone())
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state.set_assignment(best[1])
    for _ in range(rounds if num_devices > 1 else 0):
        if time.perf_counter() >= deadline:
            break
        num_swaps = int(torch.randint(2, max(3, e // 2 + 1), (1,), generator=generator, device=generator.device))
        _kick(state, load_E, cap_abs, num_swaps, generator)
        _descend(state, load_E, cap_abs, deadline)
        key = rank(state.device_E, state.hits())
        if key < best[0]:
            best = (key, state.device_E.clone())
        else:
            state.set_assignment(best[1])
    return _placement_from_device(best[1], num_devices)


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------

Optimiser = Callable[..., Placement]

OPTIMISERS: dict[str, Optimiser] = {
    "contiguous": contiguous,
    "random": random,
    "greedy": greedy,
    "swap_search": swap_search,
}


def optimise(name: str, topk_ids_TK: torch.Tensor, num_experts: int, num_devices: int, *,
             load_cap: Optional[float] = None, seed: int = 0,
             time_limit_s: Optional[float] = 10.0) -> Placement:
    """Runs optimiser ``name`` of :data:`OPTIMISERS` on one layer's profiling ids [T, K]."""
    if name not in OPTIMISERS:
        raise ValueError(f"placement.optimiser={name!r}: allowed values are {sorted(OPTIMISERS)}")
    return OPTIMISERS[name](topk_ids_TK, num_experts, num_devices, load_cap=load_cap, seed=seed,
                            time_limit_s=time_limit_s)
