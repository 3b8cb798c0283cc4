"""Occult beyond the exact scheme: expert placement from an artifact, and collaboration
pruning with a device budget. Each is one dispatcher class (and one YAML file under
``conf/system``); all three run Occult's collaborative all-to-all unchanged.

* ``occult_placed`` (:class:`OccultPlacedDispatcher`): each MoE layer's experts sit
  where a placement artifact says (``system.placement_file``, the JSON written by
  :func:`occult.placement.save_placements`, e.g. by ``experiment=placement_study``).
  Placement moves expert weights, never the model's function: exact.
* ``occult_prune_score`` (:class:`OccultScorePruningDispatcher`): every token may use
  experts on at most ``system.budget`` devices (Occult's N_d'), chosen by router score
  (:class:`occult.pruning.ScorePruning`). Not exact.
* ``occult_prune_sim`` (:class:`OccultSimilarityPruningDispatcher`): the same budget,
  by swapping experts on disallowed devices for the most similar ones on allowed
  devices (:class:`occult.pruning.SimilarityPruning`); the similarity is the cosine
  of the experts' router logits over a profiling set, read per layer from
  ``system.similarity_file`` (an ``.npz`` with one ``layer_<i>`` array [N, E], the
  format of ``router_logits.npz`` written by a run with ``task.save_routing=true``).
  With ``similarity_file: null``, ``task=finetune`` profiles the pre-trained router
  itself (:func:`occult.tasks.profiling.ensure_similarity_file`); other tasks need a file.
  Not exact.

Both pruning systems also take ``placement_file`` (pruning on top of a placement).
Infeasible budgets (budget * E / P < K) and budgets above the world size fail at config
time (each ``Config.check``).

Artifacts and similarity matrices are read once per process (module-level caches
keyed by the file's path, size and modification time) rather than once per layer.

Shapes: N profiling tokens, E experts, P devices, e = E / P local experts, K top-k.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch

from ..columns import column
from ..placement.files import PlacementFileConfig, file_key
from ..pruning import ScorePruning, SimilarityPruning, check_budget, expert_similarity
from .dispatcher import OccultDispatcher, OccultOptions
from ..ep.capabilities import Capabilities
from ..ep.payload import PAYLOADS

# (resolved path, size, mtime_ns) -> {layer: logits [N, E] (numpy)}
_LOGITS_CACHE: dict = {}
# (resolved path, size, mtime_ns, layer) -> similarity [E, E]
_SIMILARITY_CACHE: dict = {}


class OccultPlacedDispatcher(OccultDispatcher):
    """Occult, exact, with each layer's expert placement read from ``placement_file``."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(PlacementFileConfig, OccultOptions):
        # required: path of the placement artifact (JSON)
        placement_required: ClassVar[bool] = True

        def other_exact_paths(self) -> list:
            return []    # occult's kernel paths, which the parity suite checks on occult itself


# ---------------------------------------------------------------------------
# collaboration pruning
# ---------------------------------------------------------------------------


def read_router_logits(path) -> dict:
    """``{layer: logits [N, E] (float32 numpy)}`` of a router-logits ``.npz`` (keys
    ``layer_<i>``), read once per process; errors name ``system.similarity_file``."""
    key = file_key(path, "similarity_file")
    if key not in _LOGITS_CACHE:
        try:
            with np.load(key[0], allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (ValueError, OSError) as exc:
            raise ValueError(f"system.similarity_file={str(path)!r} is not an .npz of router logits: "
                             f"{exc}") from exc
        bad = [k for k in arrays if not (k.startswith("layer_") and k[6:].isdigit())]
        if bad or not arrays:
            raise ValueError(f"system.similarity_file={str(path)!r}: expected arrays named layer_<i> "
                             f"(router_logits.npz of a run with task.save_routing=true), got {sorted(arrays)}")
        logits = {int(k[6:]): a for k, a in arrays.items()}
        for layer, a in logits.items():
            if a.ndim != 2 or a.shape[0] == 0:
                raise ValueError(f"system.similarity_file={str(path)!r}: layer_{layer} must be [N, E] with "
                                 f"N >= 1, got shape {a.shape}")
        _LOGITS_CACHE[key] = logits
    return _LOGITS_CACHE[key]


def layer_similarity(path, layer: int, num_experts: int) -> torch.Tensor:
    """Expert similarity [E, E] of MoE layer ``layer`` from the router logits at ``path``
    (computed once per process and layer)."""
    key = file_key(path, "similarity_file") + (layer,)
    if key not in _SIMILARITY_CACHE:
        logits = read_router_logits(path)
        if layer not in logits:
            raise ValueError(f"system.similarity_file={str(path)!r} has no router logits for MoE layer "
                             f"{layer}; it has layers {sorted(logits)}")
        if logits[layer].shape[1] != num_experts:
            raise ValueError(f"system.similarity_file={str(path)!r}: layer_{layer} has "
                             f"{logits[layer].shape[1]} experts, the model has {num_experts}")
        _SIMILARITY_CACHE[key] = expert_similarity(torch.from_numpy(np.asarray(logits[layer])))
    return _SIMILARITY_CACHE[key]


class _PruningDispatcher(OccultDispatcher):
    """Occult with a collaboration-pruning routing transform (not exact)."""

    exact = False

    @dataclass
    class Config(PlacementFileConfig, OccultOptions):
        # N_d', devices per token (the paper tries 1, 2, 4); a column of every row (-1: no such field)
        budget: int = column(2, absent=-1)
        weight_rule: str = "own"     # gate weight of a substitute: own | replaced | renormalize (open)
        # false: no pruning (the routing unchanged; Occult with this config's placement, kernels
        # and payload): the identity the parity suite and every run's gate check it with
        prune: bool = True

        def is_exact(self) -> bool:
            return not self.prune and not self.compressed()

        def lossless_options(self) -> dict:
            return {"prune": False, **self.payload_off()}

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            check_budget(self.budget, top_k, num_experts // world_size, world_size)

    def __init__(self, ep, placement, config):
        super().__init__(ep, placement, config)
        self._transforms: dict = {}          # layer -> transform (built once per layer)

    def routing_transform(self, layer: int):
        if not self.config.prune:
            return None
        if layer not in self._transforms:
            self._transforms[layer] = self._make_transform(layer)
        return self._transforms[layer]

    @abstractmethod
    def _make_transform(self, layer: int):
        """The routing transform of MoE layer ``layer``."""


class OccultScorePruningDispatcher(_PruningDispatcher):
    """Occult + routing-score-based pruning: per token the ``budget`` devices with the
    highest device score (``device_score``: ``sum`` | ``max`` of its router probabilities
    there), then its top-k among their experts. ``weight_rule``: ``own`` | ``replaced`` |
    ``renormalize`` (see :mod:`occult.pruning.transforms`)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=False, exact_backward=False,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(_PruningDispatcher.Config):
        device_score: str = "sum"    # sum | max of the token's router probabilities on a device (open)

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            ScorePruning(self.budget, self.device_score, self.weight_rule)      # option checks

    def _make_transform(self, layer: int):
        c = self.config
        return ScorePruning(c.budget, c.device_score, c.weight_rule)


class OccultSimilarityPruningDispatcher(_PruningDispatcher):
    """Occult + similarity-based pruning: keep the top-k, replace experts on disallowed
    devices by the most similar unselected experts on allowed ones; similarity from
    ``similarity_file`` (router logits [N, E] per layer). ``profile_tokens``: how many
    tokens ``task=finetune`` profiles when ``similarity_file`` is null."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=False, exact_backward=False,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(_PruningDispatcher.Config):
        weight_rule: str = "replaced"
        # .npz of per-layer router logits (layer_<i>: [N, E]), e.g. router_logits.npz of a run
        # with task.save_routing=true. null: task=finetune profiles the pre-trained router on
        # profile_tokens tokens of its training data (other tasks need a file).
        similarity_file: Optional[str] = None
        profile_tokens: int = 8192

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            SimilarityPruning(self.budget, torch.zeros(num_experts, num_experts, device="cpu"), self.weight_rule)
            if self.profile_tokens < 1:
                raise ValueError(f"system.profile_tokens={self.profile_tokens!r}: allowed values are "
                                 "integers >= 1")
            if self.similarity_file is not None:
                for layer, logits in read_router_logits(self.similarity_file).items():
                    if logits.shape[1] != num_experts:
                        raise ValueError(f"system.similarity_file={str(self.similarity_file)!r}: layer_{layer} "
                                         f"has {logits.shape[1]} experts, model.num_experts={num_experts}")

        def check_task(self, task: str) -> None:
            if self.similarity_file is None and task != "finetune":
                raise ValueError(f"system.similarity_file is null: task={task} needs a file (an .npz of router "
                                 "logits, e.g. router_logits.npz of a run with task.save_routing=true); only "
                                 "task=finetune profiles the router itself")

        @property
        def needs_router_profile(self) -> bool:
            """True when the similarity must be profiled first (no ``similarity_file``)."""
            return self.similarity_file is None

    def _make_transform(self, layer: int):
        c = self.config
        if c.similarity_file is None:
            raise ValueError(
                "system.similarity_file is null: give an .npz of profiling router logits (the "
                "router_logits.npz of a run with task.save_routing=true); task=finetune profiles "
                "the pre-trained router itself when it is null")
        sim_EE = layer_similarity(c.similarity_file, layer, self.placement.num_experts)
        return SimilarityPruning(c.budget, sim_EE, c.weight_rule)
