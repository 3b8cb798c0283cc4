"""The paper's models: EP versions equal the single-device model; checkpoints; KV-cache decode."""

import pytest
import torch
from omegaconf import OmegaConf

from occult.dist import launch
from occult.models.build import CheckpointError, hf_config, init_model, load_checkpoint, save_checkpoint
from occult.models.families import family_of
from occult.parity import run_model_grid

PROXIES = ["olmoe_proxy", "qwen_moe_proxy", "deepseek_moe_proxy"]
SYSTEMS = [("naive", "baselines.naive.NaiveDispatcher"), ("occult", "occult.collab.dispatcher.OccultDispatcher")]


def tiny(name: str) -> dict:
    """The proxy's config with every width shrunk (E, K, shared experts, dense layers kept)."""
    m = OmegaConf.to_container(OmegaConf.load(f"conf/model/{name}.yaml"))
    m.update(hidden_size=32, expert_ffn_size=16, num_layers=2, shared_expert_ffn_size=32, dense_ffn_size=64)
    return m


@pytest.mark.timeout(400)
@pytest.mark.parametrize("P", [2, 4])
def test_ep_models_match_single_device(P):
    jobs = [({"model": tiny(n), "system": {"name": s, "_target_": t}, "seed": 1}, 2, 8)
            for n in PROXIES for s, t in SYSTEMS]
    per_rank = launch(run_model_grid, P, (jobs,), timeout_s=360)
    for rank, results in enumerate(per_rank):
        for (cfg, _, _), res in zip(jobs, results):
            bad = {k: v for k, v in res["errors"].items() if not v < 2e-5}
            assert not bad, (P, rank, cfg["model"]["name"], cfg["system"]["name"], bad)
            moe_layers = {layer for layer, _ in res["routing"]}
            first_dense = cfg["model"].get("first_k_dense", 0)
            assert moe_layers == set(range(first_dense, cfg["model"]["num_layers"]))


def _model(name, seed=0):
    m = OmegaConf.create(tiny(name))
    return init_model(family_of(m.family), hf_config(m, 128), seed), family_of(m.family)


@pytest.mark.parametrize("name", PROXIES)
def test_checkpoint_round_trip(tmp_path, name):
    model, fam = _model(name)
    save_checkpoint(model, tmp_path / "ckpt", {"note": "test"})
    back = load_checkpoint(fam, tmp_path / "ckpt")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, back(input_ids=ids).logits)


def test_bad_checkpoints_are_clear_errors(tmp_path):
    model, fam = _model("olmoe_proxy")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(fam, tmp_path / "nowhere")
    save_checkpoint(model, tmp_path / "ckpt")
    other, _ = _model("qwen_moe_proxy")
    with pytest.raises(CheckpointError, match="does not fit|cannot load"):
        load_checkpoint(family_of("qwen2_moe"), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    (tmp_path / "ckpt" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(fam, tmp_path / "ckpt")


@pytest.mark.parametrize("name", PROXIES)
def test_kv_cache_decode_equals_recompute(name):
    model, _ = _model(name, seed=3)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(5):
            ids = torch.cat([ids, nxt], 1)
            step = model(input_ids=nxt, cache=cache, use_cache=True)
            full = model(input_ids=ids).logits[:, -1]
            assert torch.allclose(step.logits[:, -1], full, atol=1e-5)
            assert torch.equal(step.logits[:, -1].argmax(-1), full.argmax(-1))
            cache, nxt = step.cache, step.logits[:, -1].argmax(-1, keepdim=True)
