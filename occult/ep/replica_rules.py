"""Replica rules: which copy of an expert serves each (token, expert) pair on a placement
with copies (:class:`occult.ep.placement.SlotPlacement`, EPLB's physical slots).

Every rule is exact (copies hold the same weights; training sums their gradients,
:mod:`occult.ep.replicas`) and decided by the sending rank alone, from its own pairs: no
extra collective, and any process can compute any rank's choice (plans, C_T). The rules:

* ``round_robin`` (vLLM / SGLang's static rule): the i-th pair of expert x a rank sends,
  in token-major order, goes to copy ``i mod copies(x)`` (copies in slot order).
* ``local_first``: the sending rank's own copy when it holds one, else ``round_robin``.
* ``grace`` (GRACE-MoE, arXiv 2509.25041, locality-aware routing with load prediction;
  the paper publishes no code, so the choices are ours): a pair takes the sending rank's
  copy when there is one; each remaining pair of a copied expert goes to a remote copy so
  that the devices' predicted loads even out. Predicted load (our choice): the pairs this
  rank already sends to each device (local copies and single-copy experts), the copied
  experts' pairs water-filled over their copies, most-requested expert first.
* ``collaborative`` (ours): per token, copies of its K experts that cover them with as few
  devices as possible (greedy set cover: at each step the device holding copies of most of
  its still-uncovered experts, ties to the token's own device, then to a device rotating
  with the token), under a per-device cap of (1 + ``slack``) x the mean load of this rank's
  pairs; the pairs past a device's cap (in token-major order) move to the least-loaded
  device holding a copy of their expert (water-filled per expert, most-requested first).

``round_robin`` counts every copy, two copies on one device included (each its own slot).
The other rules choose a device, and within it the pair goes to the expert's first slot
there (two copies on one device serve as one; EPLB rarely makes them). ``round_robin`` and
``local_first`` are decided on the device: they read the slot placement's tables, computed
when it was built, with no host read and no data-dependent shape (a static dispatch takes
them); ``grace`` and ``collaborative`` read counts on the host. Vectorised over tokens and
pairs; the loops are over the K greedy steps, the sending ranks and the copied experts.

Shapes: T tokens, K top-k, E experts, P devices, S slots, N pairs of one rank.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

REPLICA_POLICIES = ("round_robin", "local_first", "grace", "collaborative")
# the rules decided on the device alone (no host read: a static dispatch can take them)
DEVICE_POLICIES = ("round_robin", "local_first")


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``: itself where it is there (no copy, no call: a placement moved to
    the rank's device when its system was built), else a copy."""
    return t if t.device == torch.device(device) else t.to(device)


def first_slots(expert_S: torch.Tensor, device_S: torch.Tensor, num_experts: int, num_devices: int) -> torch.Tensor:
    """The first slot of expert x on device p, -1 where p holds no copy: [E, P] (from the slots
    ``expert_S``, ``device_S`` of a slot placement, which keeps it: ``first_slot_EP``)."""
    S, E, P = expert_S.numel(), num_experts, num_devices
    dev = expert_S.device
    out_EP = torch.full((E * P,), S, dtype=torch.long, device=dev)
    out_EP.scatter_reduce_(0, expert_S * P + device_S, torch.arange(S, device=dev), "amin")
    return torch.where(out_EP < S, out_EP, torch.full_like(out_EP, -1)).view(E, P)


def first_slot_EP(placement) -> torch.Tensor:
    """The first slot of expert x on device p, -1 where p holds no copy: [E, P] (the
    placement's table)."""
    return placement.first_slot_EP()


def round_robin_slots(placement, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slot of each pair by ``round_robin``: [T, K] (-1 for a dropped pair). ``home_T``:
    each token's sending rank (each rank counts its own pairs; default: one rank)."""
    T, K = topk_ids_TK.shape
    dev = topk_ids_TK.device
    ids_R = topk_ids_TK.flatten()
    keep_R = ids_R >= 0
    home_R = (torch.zeros(T, dtype=torch.long, device=dev) if home_T is None
              else on_device(home_T, dev)).repeat_interleave(K)
    key_R = torch.where(keep_R, home_R * placement.num_experts + ids_R.clamp_min(0), torch.full_like(ids_R, -1))
    order_R = torch.argsort(key_R, stable=True)
    sorted_key_R = key_R[order_R]
    pos_R = torch.arange(ids_R.numel(), device=dev)
    first_R = torch.searchsorted(sorted_key_R, sorted_key_R)       # first position of each key
    index_R = torch.empty_like(pos_R)
    index_R[order_R] = pos_R - first_R                              # i: the pair's index in its group
    # the placement's tables, computed when it was built (no host read here)
    table_EC = on_device(placement.copy_table_EC(), dev)
    copies_E = on_device(placement.copies_E(), dev)
    e_R = ids_R.clamp_min(0)
    slot_R = table_EC[e_R, index_R % copies_E[e_R]]
    return torch.where(keep_R, slot_R, torch.full_like(slot_R, -1)).view(T, K)


def water_fill(load_c: list, n: int) -> list:
    """Integer counts adding ``n`` items to bins of loads ``load_c`` so that the fullest bin
    is as low as it can be (ties to the earlier bin): a list like ``load_c``."""
    c = len(load_c)
    order = sorted(range(c), key=lambda i: (load_c[i], i))
    level, used, k = 0.0, 0, 0
    for k in range(1, c + 1):                       # the first k bins fill to a common level
        level = (n + sum(load_c[order[i]] for i in range(k))) / k
        if k == c or level <= load_c[order[k]]:
            break
    counts = [0] * c
    for i in order[:k]:
        counts[i] = max(0, int(math.floor(level)) - int(load_c[i]))
        used += counts[i]
    for i in order[:k]:                             # the remainder, one each, least-loaded first
        if used >= n:
            break
        counts[i] += 1
        used += 1
    return counts


def _spread(dev_N: torch.Tensor, ids_N: torch.Tensor, move_N: torch.Tensor, has_EP: torch.Tensor,
            load_P: torch.Tensor) -> torch.Tensor:
    """Moves the pairs flagged ``move_N`` (their current device not counted in ``load_P``)
    onto devices holding their expert, water-filled expert by expert (most pairs first,
    token-major blocks of pairs per device): the new devices [N]."""
    dev_N = dev_N.clone()
    load = load_P.tolist()
    experts, counts = torch.unique(ids_N[move_N], return_counts=True)
    for i in torch.argsort(counts, descending=True, stable=True).tolist():
        x = int(experts[i])
        where_n = torch.nonzero(move_N & (ids_N == x)).flatten()
        devices = torch.nonzero(has_EP[x]).flatten().tolist()
        take = water_fill([load[d] for d in devices], where_n.numel())
        dest_n = torch.repeat_interleave(torch.tensor(devices, dtype=torch.long, device=dev_N.device),
                                         torch.tensor(take, dtype=torch.long, device=dev_N.device))
        dev_N[where_n] = dest_n
        for d, k in zip(devices, take):
            load[d] += k
    return dev_N


def _grace_devices(ids_N: torch.Tensor, home: int, has_EP: torch.Tensor, copies_E: torch.Tensor,
                   only_E: torch.Tensor) -> torch.Tensor:
    """GRACE's device for each kept pair of one rank (its ids ``ids_N``): [N]."""
    P = has_EP.shape[1]
    local_N = has_EP[ids_N, home]
    fixed_N = local_N | (copies_E[ids_N] == 1)
    dev_N = torch.where(local_N, torch.full_like(ids_N, home), only_E[ids_N])
    load_P = torch.bincount(dev_N[fixed_N], minlength=P).double()
    return _spread(dev_N, ids_N, ~fixed_N, has_EP, load_P)


def _collaborative_devices(ids_TK: torch.Tensor, keep_TK: torch.Tensor, home: int, has_EP: torch.Tensor,
                           slack: float) -> torch.Tensor:
    """The collaborative rule's device for each pair of one rank: [T, K] (-1 for a dropped
    pair). Greedy set cover per token (vectorised over tokens, K steps), then the cap."""
    T, K = ids_TK.shape
    P = has_EP.shape[1]
    dev = ids_TK.device
    cover_TKP = has_EP[ids_TK.clamp_min(0)] & keep_TK.unsqueeze(2)
    # ties: the token's own device first, then a device order rotating with the token
    p_P = torch.arange(P, device=dev)
    tie_TP = (p_P.unsqueeze(0) - torch.arange(T, device=dev).unsqueeze(1) - home) % P
    tie_TP = torch.where(p_P.unsqueeze(0) == home, torch.full_like(tie_TP, -1), tie_TP)
    left_TK = keep_TK.clone()
    dev_TK = torch.full((T, K), -1, dtype=torch.long, device=dev)
    for _ in range(K):
        if not bool(left_TK.any()):
            break
        gain_TP = (cover_TKP & left_TK.unsqueeze(2)).sum(1)
        best_T = torch.argmax(gain_TP * (2 * P) - tie_TP, dim=1)
        take_TK = left_TK & cover_TKP.gather(2, best_T.view(T, 1, 1).expand(T, K, 1)).squeeze(2)
        dev_TK = torch.where(take_TK, best_T.unsqueeze(1).expand(T, K), dev_TK)
        left_TK = left_TK & ~take_TK
    keep_R = keep_TK.flatten()
    dev_N, ids_N = dev_TK.flatten()[keep_R], ids_TK.flatten()[keep_R]
    N = dev_N.numel()
    if not N:
        return dev_TK
    cap = math.floor((1.0 + slack) * N / P)
    # each pair's position among this rank's pairs to its device (token-major)
    order_N = torch.argsort(dev_N, stable=True)
    sorted_N = dev_N[order_N]
    pos_N = torch.empty_like(order_N)
    pos_N[order_N] = torch.arange(N, device=dev) - torch.searchsorted(sorted_N, sorted_N)
    over_N = (pos_N >= cap) & (has_EP[ids_N].sum(1) > 1)
    if bool(over_N.any()):
        load_P = torch.bincount(dev_N[~over_N], minlength=P).double()
        dev_N = _spread(dev_N, ids_N, over_N, has_EP, load_P)
    out_R = torch.full((T * K,), -1, dtype=torch.long, device=dev)
    out_R[keep_R] = dev_N
    return out_R.view(T, K)


def choose_slots(placement, topk_ids_TK: torch.Tensor, home_T: Optional[torch.Tensor] = None,
                 policy: str = "round_robin", slack: float = 0.1) -> torch.Tensor:
    """The slot that serves each (token, k) pair under ``policy``: [T, K] (-1 for a dropped
    pair). ``home_T``: each token's sending rank (default: all rank 0); every rank's pairs
    are decided on their own, as that rank decides them at run time."""
    if policy not in REPLICA_POLICIES:
        raise ValueError(f"replica_policy={policy!r}: allowed values are {list(REPLICA_POLICIES)}")
    if policy == "round_robin":
        return round_robin_slots(placement, topk_ids_TK, home_T)
    T, K = topk_ids_TK.shape
    dev = topk_ids_TK.device
    home_T = torch.zeros(T, dtype=torch.long, device=dev) if home_T is None else on_device(home_T, dev)
    slot_EP = on_device(placement.first_slot_EP(), dev)
    has_EP = slot_EP >= 0
    keep_TK = topk_ids_TK >= 0
    ids_TK = topk_ids_TK.clamp_min(0)
    if policy == "local_first":
        local_TK = slot_EP[ids_TK, home_T.unsqueeze(1).expand(T, K)]
        rr_TK = round_robin_slots(placement, topk_ids_TK, home_T)
        return torch.where(keep_TK & (local_TK >= 0), local_TK, rr_TK)
    dev_TK = torch.full((T, K), -1, dtype=torch.long, device=dev)
    copies_E = has_EP.sum(1)
    only_E = torch.argmax(has_EP.long(), dim=1)          # the device of a single-copy expert
    for home in torch.unique(home_T).tolist():
        mine_T = home_T == home
        if policy == "grace":
            keep_mK = keep_TK[mine_T]
            ids_N = ids_TK[mine_T][keep_mK]
            part_TK = torch.full_like(ids_TK[mine_T], -1)
            part_TK[keep_mK] = _grace_devices(ids_N, home, has_EP, copies_E, only_E)
        else:
            part_TK = _collaborative_devices(ids_TK[mine_T], keep_TK[mine_T], home, has_EP, slack)
        dev_TK[mine_T] = part_TK
    slot_TK = slot_EP[ids_TK, dev_TK.clamp_min(0)]
    return torch.where(keep_TK, slot_TK, torch.full_like(slot_TK, -1))
