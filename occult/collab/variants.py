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
  itself (:func:`ensure_similarity_file`); other tasks need a file. Not exact.

Both pruning systems also take ``placement_file`` (pruning on top of a placement).
Infeasible budgets (budget * E / P < K) fail at config time (:meth:`check_config`).

Artifacts and similarity matrices are read once per process (module-level caches
keyed by the file's path, size and modification time) rather than once per layer.

Shapes: N profiling tokens, E experts, P devices, e = E / P local experts, K top-k.
"""
from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..ep.placement import Placement
from ..placement import load_placements
from ..pruning import ScorePruning, SimilarityPruning, check_budget, expert_similarity
from .dispatcher import OccultDispatcher

# (resolved path, size, mtime_ns) -> ({layer: Placement}, meta)
_PLACEMENT_CACHE: dict = {}
# (resolved path, size, mtime_ns) -> {layer: logits [N, E] (numpy)}
_LOGITS_CACHE: dict = {}
# (resolved path, size, mtime_ns, layer) -> similarity [E, E]
_SIMILARITY_CACHE: dict = {}


def _file_key(path, field: str) -> tuple:
    """Cache key of a file; raises ``ValueError`` naming ``system.<field>`` if it is missing."""
    if path is None or str(path) == "":
        raise ValueError(f"system.{field} is not set: give the path of the file (see conf/system)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"system.{field}={str(path)!r}: no such file")
    st = p.stat()
    return (str(p.resolve()), st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------
# placement artifacts
# ---------------------------------------------------------------------------


def read_placement_artifact(path) -> tuple[dict, dict]:
    """``({layer: Placement}, meta)`` of a placement artifact, read once per process.

    Raises ``ValueError`` naming ``system.placement_file`` when it is missing or malformed.
    """
    key = _file_key(path, "placement_file")
    if key not in _PLACEMENT_CACHE:
        try:
            _PLACEMENT_CACHE[key] = load_placements(key[0])
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"system.placement_file={str(path)!r} is not a placement artifact "
                             f"(occult.placement.save_placements): {exc}") from exc
    return _PLACEMENT_CACHE[key]


def check_placement_artifact(path, num_experts: int, world_size: int) -> None:
    """Raises ``ValueError`` naming ``system.placement_file`` unless the artifact places
    ``num_experts`` experts on ``world_size`` devices."""
    placements, _ = read_placement_artifact(path)
    first = next(iter(placements.values()))
    if (first.num_experts, first.num_devices) != (num_experts, world_size):
        raise ValueError(
            f"system.placement_file={str(path)!r} places {first.num_experts} experts on "
            f"{first.num_devices} devices; this run has model.num_experts={num_experts} on "
            f"world size {world_size} (cluster). Make an artifact for this shape "
            f"(experiment=placement_study with this model and cluster)")


def artifact_layer_placement(path, layer: int, num_experts: int, world_size: int) -> Placement:
    """Layer ``layer``'s placement from the artifact at ``path`` (checked against E and P)."""
    check_placement_artifact(path, num_experts, world_size)
    placements, _ = read_placement_artifact(path)
    if layer not in placements:
        raise ValueError(f"system.placement_file={str(path)!r} has no placement for MoE layer {layer}; "
                         f"it has layers {sorted(placements)}")
    return placements[layer]


class PlacementFromArtifact:
    """Mixin for any dispatcher class (listed before it): ``layer_placement`` reads the
    ``placement_file`` option when it is set (contiguous otherwise, unless the class sets
    ``placement_required``)."""

    placement_required: bool = False

    @classmethod
    def layer_placement(cls, layer: int, num_experts: int, world_size: int, **options) -> Placement:
        path = options.get("placement_file")
        if path is None and not cls.placement_required:
            return Placement.contiguous(num_experts, world_size)
        return artifact_layer_placement(path, layer, num_experts, world_size)

    @classmethod
    def _check_placement_option(cls, num_experts: int, world_size: int, options: dict) -> None:
        path = options.get("placement_file")
        if path is None and not cls.placement_required:
            return
        if path is None:
            raise ValueError(f"system.placement_file is not set: system '{cls.name}' places experts from "
                             "a placement artifact (write one with experiment=placement_study, or "
                             "occult.placement.save_placements)")
        check_placement_artifact(path, num_experts, world_size)


class OccultPlacedDispatcher(PlacementFromArtifact, OccultDispatcher):
    """Occult, exact, with each layer's expert placement read from ``placement_file``."""

    name = "occult_placed"
    exact = True
    placement_required = True

    def __init__(self, ep, placement, kernels: str = "auto", placement_file: Optional[str] = None):
        super().__init__(ep, placement, kernels=kernels)
        self.placement_file = placement_file

    @classmethod
    def check_config(cls, *, num_experts: int, top_k: int, world_size: int, **options) -> None:
        super().check_config(num_experts=num_experts, top_k=top_k, world_size=world_size)
        cls._check_placement_option(num_experts, world_size, options)


# ---------------------------------------------------------------------------
# collaboration pruning
# ---------------------------------------------------------------------------


def read_router_logits(path) -> dict:
    """``{layer: logits [N, E] (float32 numpy)}`` of a router-logits ``.npz`` (keys
    ``layer_<i>``), read once per process; errors name ``system.similarity_file``."""
    key = _file_key(path, "similarity_file")
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
    key = _file_key(path, "similarity_file") + (layer,)
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


class _PruningDispatcher(PlacementFromArtifact, OccultDispatcher):
    """Occult with a collaboration-pruning routing transform (not exact)."""

    exact = False

    def __init__(self, ep, placement, kernels: str = "auto", budget: int = 2, weight_rule: str = "own",
                 placement_file: Optional[str] = None):
        super().__init__(ep, placement, kernels=kernels)
        check_budget(budget, None, None)
        self.budget = budget
        self.weight_rule = weight_rule
        self.placement_file = placement_file
        self._transforms: dict = {}          # layer -> transform (built once)

    @classmethod
    def is_exact(cls, **options) -> bool:
        return False

    @classmethod
    def check_config(cls, *, num_experts: int, top_k: int, world_size: int, **options) -> None:
        super().check_config(num_experts=num_experts, top_k=top_k, world_size=world_size)
        budget = options.get("budget", 2)
        check_budget(budget, top_k, num_experts // world_size)
        cls._check_placement_option(num_experts, world_size, options)
        cls._check_pruning_options(num_experts, options)

    @classmethod
    @abstractmethod
    def _check_pruning_options(cls, num_experts: int, options: dict) -> None:
        """Raises ``ValueError`` naming the field for a bad rule, score or file."""

    def routing_transform(self, layer: int):
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

    name = "occult_prune_score"

    def __init__(self, ep, placement, kernels: str = "auto", budget: int = 2, weight_rule: str = "own",
                 device_score: str = "sum", placement_file: Optional[str] = None):
        super().__init__(ep, placement, kernels=kernels, budget=budget, weight_rule=weight_rule,
                         placement_file=placement_file)
        self.device_score = device_score
        ScorePruning(budget, device_score, weight_rule)          # option checks, at construction

    @classmethod
    def _check_pruning_options(cls, num_experts: int, options: dict) -> None:
        ScorePruning(options.get("budget", 2), options.get("device_score", "sum"), options.get("weight_rule", "own"))

    def _make_transform(self, layer: int):
        return ScorePruning(self.budget, self.device_score, self.weight_rule)


class OccultSimilarityPruningDispatcher(_PruningDispatcher):
    """Occult + similarity-based pruning: keep the top-k, replace experts on disallowed
    devices by the most similar unselected experts on allowed ones; similarity from
    ``similarity_file`` (router logits [N, E] per layer). ``profile_tokens``: how many
    tokens ``task=finetune`` profiles when ``similarity_file`` is null."""

    name = "occult_prune_sim"

    def __init__(self, ep, placement, kernels: str = "auto", budget: int = 2, weight_rule: str = "replaced",
                 similarity_file: Optional[str] = None, profile_tokens: int = 8192,
                 placement_file: Optional[str] = None):
        super().__init__(ep, placement, kernels=kernels, budget=budget, weight_rule=weight_rule,
                         placement_file=placement_file)
        self.similarity_file = similarity_file
        self.profile_tokens = profile_tokens

    @classmethod
    def _check_pruning_options(cls, num_experts: int, options: dict) -> None:
        SimilarityPruning(options.get("budget", 2), torch.zeros(num_experts, num_experts),
                          options.get("weight_rule", "replaced"))
        tokens = options.get("profile_tokens", 8192)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"system.profile_tokens={tokens!r}: allowed values are integers >= 1")
        path = options.get("similarity_file")
        if path is not None:
            for layer, logits in read_router_logits(path).items():
                if logits.shape[1] != num_experts:
                    raise ValueError(f"system.similarity_file={str(path)!r}: layer_{layer} has "
                                     f"{logits.shape[1]} experts, model.num_experts={num_experts}")

    def _make_transform(self, layer: int):
        if self.similarity_file is None:
            raise ValueError(
                "system.similarity_file is null: give an .npz of profiling router logits (the "
                "router_logits.npz of a run with task.save_routing=true); task=finetune profiles "
                "the pre-trained router itself when it is null")
        sim_EE = layer_similarity(self.similarity_file, layer, self.placement.num_experts)
        return SimilarityPruning(self.budget, sim_EE, self.weight_rule)


# ---------------------------------------------------------------------------
# profiling the router for similarity pruning
# ---------------------------------------------------------------------------


def needs_profile(system: dict) -> bool:
    """Whether ``system`` is similarity pruning without a similarity file."""
    from ..validate import system_class
    return (issubclass(system_class(system), OccultSimilarityPruningDispatcher)
            and system.get("similarity_file") is None)


@torch.no_grad()
def profile_router_logits(model, family, ids_N: torch.Tensor, num_tokens: int, seq_len: int, seed: int,
                          batch_size: int = 8) -> dict:
    """Router logits of the single-device ``model`` on ``num_tokens`` tokens of random
    windows (seeded) of ``ids_N``: ``{layer: logits [N, E] (float32 numpy)}``."""
    from ..data.batches import batch_iterator
    from ..models.build import moe_blocks
    from ..tasks.pretrain import RouterTap

    layers = [i for i, _, _ in moe_blocks(model, family)]
    windows = max(1, -(-num_tokens // seq_len))
    tap = RouterTap(model, family)
    try:
        model.eval()
        for x_BS, _ in batch_iterator(ids_N, min(batch_size, windows), seq_len, seed,
                                      num_batches=-(-windows // min(batch_size, windows))):
            model(input_ids=x_BS)
    finally:
        tap.remove()
    per_layer: dict = {layer: [] for layer in layers}
    for j, (logits_TE, _) in enumerate(tap.calls):
        per_layer[layers[j % len(layers)]].append(logits_TE.float())
    return {layer: torch.cat(parts)[:num_tokens].numpy() for layer, parts in per_layer.items()}


def ensure_similarity_file(cfg_dict: dict) -> dict:
    """In the launching process (after the checkpoint is known): for similarity pruning
    with ``similarity_file: null``, profiles the pre-trained router on the task's
    training data (``task.corpus``, ``task.split``; ``system.profile_tokens`` tokens of
    seeded random windows), writes ``profile_router_logits.npz`` into the run folder and
    sets ``system.similarity_file`` to it. Other systems pass through unchanged."""
    system = cfg_dict["system"]
    if not needs_profile(system):
        return cfg_dict
    from omegaconf import OmegaConf

    from ..data.batches import token_ids
    from ..data.tokenizer import get_tokenizer
    from ..models.families import family_of
    from ..models.runtime import base_model

    cfg = OmegaConf.create(cfg_dict)
    t = cfg.task
    tok = get_tokenizer(t.tokenizer_vocab, corpus=cfg.pretrain.corpus)
    model = base_model(cfg, cfg.model.vocab_size or tok.vocab_size, cfg.get("checkpoint"))
    tokens = int(system.get("profile_tokens", 8192))
    print(f"profiling router logits for similarity pruning: {tokens} tokens of {t.corpus}/{t.split}",
          flush=True)
    logits = profile_router_logits(model, family_of(cfg.model.family), token_ids(t.corpus, t.split, tok),
                                   tokens, t.seq_len, seed=cfg.seed + 7)
    out = Path(cfg_dict.get("out_dir_resolved") or ".") / "profile_router_logits.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **{f"layer_{layer}": a for layer, a in sorted(logits.items())})
    cfg_dict["system"] = {**system, "similarity_file": str(out)}
    return cfg_dict
