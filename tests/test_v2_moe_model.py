"""The second trained model (models/quantmla-mla-v2-moe): DeepSeek-V2 layout, complex RoPE, MoE layers.

It sits outside the installed package; these tests read it from the checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "quantmla-mla-v2-moe"
HELDOUT = ROOT / "src" / "quantmla" / "data" / "heldout.txt"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    torch = pytest.importorskip("torch")
    from quantmla.data import tokenizer_for
    from quantmla.models import load_model

    torch.manual_seed(0)
    return load_model(MODEL_DIR, attn="sdpa"), tokenizer_for(MODEL_DIR)


def test_checkpoint_files():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64 and cfg["q_lora_rank"] is None
    assert 0 < cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]  # some layers are MoE
    assert cfg["n_routed_experts"] > cfg["num_experts_per_tok"] >= 2
    weights = list(MODEL_DIR.glob("*.safetensors"))
    assert weights and sum(p.stat().st_size for p in weights) < 20e6
    assert all(p.stat().st_size < 15 * 2**20 for p in weights)
    for p in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (MODEL_DIR / p).is_file(), p
    # outside the wheel: the package data globs only cover src/quantmla
    assert not MODEL_DIR.is_relative_to(ROOT / "src")


def test_adapter_sees_complex_rope_and_moe(model_and_tokenizer):
    from quantmla.models.adapters import describe

    model, tok = model_and_tokenizer
    layers = describe(model)
    assert [layer.rope_style for layer in layers] == ["complex"] * 4
    assert {layer.model_type for layer in layers} == {"deepseek_v2"}
    assert all(layer.kv_lora_rank == 512 and layer.rope_dim == 64 and layer.q_path == "q_proj" for layer in layers)
    assert sum("experts" in n for n, _ in model.named_parameters()) >= 3
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)


def test_every_expert_is_routed_to(model_and_tokenizer):
    """The routers spread held-out tokens over all experts (no collapse onto a few)."""
    import torch

    model, tok = model_and_tokenizer
    counts = {}

    def hook(name):
        def fn(module, inputs, out):
            idx = out[2].reshape(-1)  # DeepseekV2TopkRouter returns (logits, top-k weights, top-k indices)
            counts[name] = torch.bincount(idx, minlength=out[0].shape[-1])
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        ids = tok(HELDOUT.read_text()[:3000], return_tensors="pt").input_ids[:, :1024]
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    assert len(counts) == 3
    for name, c in counts.items():
        share = c.float() / c.sum()
        assert share.min() > 0.01 and share.max() < 0.5, (name, share.tolist())


def test_single_needle_beyond_stage_one_positions(model_and_tokenizer):
    """At 4608 tokens, past the 4096 positions of the stage-1 weights: the shipped model was continued to
    16 K. Scored as the evaluation scores needles (teacher-forced greedy, one forward per batch)."""
    from quantmla.config import CacheConfig
    from quantmla.eval import retrieval

    model, tok = model_and_tokenizer
    assert model.config.max_position_embeddings >= 16384
    samples = retrieval.samples_for("single", 4608, 6, seed=7, filler=HELDOUT.read_text())
    codec = retrieval.Codec(tok, model.config.vocab_size)
    correct = retrieval.outcomes(model, CacheConfig.bf16(), codec, samples, batch=6)
    assert sum(correct) >= 5, correct  # the card: 100 % at 2048 and 8192
