"""Tiny random MLA models of every supported family, built from the real transformers config classes.

Tests and demos use them since no machine here reaches a model hub. Dims are small but keep every feature
of the family: the q path (q_proj vs q_a/q_b), the RoPE layout, LongCat's two attentions per layer and its
latent scales, MiniCPM3's rank/rope ratio, Mistral 4's position-dependent query factor (crossed at position 32).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantmla.models.adapters import register_causal_lms

# (family name, model_type, config overrides). Family names are what tests are parametrized over.
_COMMON = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=512,
    tie_word_embeddings=False,
)
_MOE_OFF = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=2, n_group=1, topk_group=1)

TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "deepseek_v2": ("deepseek_v2", dict(_COMMON, **_MOE_OFF, num_hidden_layers=3, first_k_dense_replace=1,
                                        q_lora_rank=None, topk_method="greedy")),
    "deepseek_v3": ("deepseek_v3", dict(_COMMON, **_MOE_OFF, num_hidden_layers=3, first_k_dense_replace=1,
                                        q_lora_rank=24, rope_interleave=True)),
    "deepseek_v3_halfsplit": ("deepseek_v3", dict(_COMMON, **_MOE_OFF, num_hidden_layers=2,
                                                  first_k_dense_replace=2, q_lora_rank=None,
                                                  rope_interleave=False)),
    "glm4_moe_lite": ("glm4_moe_lite", dict(_COMMON, **_MOE_OFF, num_hidden_layers=2, q_lora_rank=24,
                                            mlp_layer_types=["dense", "sparse"])),
    "longcat_flash": ("longcat_flash", dict(_COMMON, num_layers=2, q_lora_rank=24, ffn_hidden_size=96,
                                            expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2,
                                            moe_topk=2, head_dim=16)),
    "minicpm3": ("minicpm3", dict(_COMMON, num_hidden_layers=2, q_lora_rank=24, intermediate_size=96,
                                  kv_lora_rank=32, qk_rope_head_dim=8, scale_emb=2.0, scale_depth=1.4,
                                  dim_model_base=32)),
    "youtu": ("youtu", dict(_COMMON, num_hidden_layers=2, q_lora_rank=24, intermediate_size=96,
                            rope_interleave=True, bos_token_id=1, eos_token_id=2)),  # its defaults exceed 128
    "axk1": ("axk1", dict(_COMMON, **_MOE_OFF, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=24,
                          bos_token_id=1, eos_token_id=2)),
    # The query factor 1 + beta * log(1 + floor(pos / 32)) is 1 below position 32 and 1.35 from 32 to 63:
    # windows of a few dozen tokens cross it (the real model's is 1 up to 8192).
    "mistral4": ("mistral4", dict(_COMMON, **_MOE_OFF, num_hidden_layers=2, first_k_dense_replace=1,
                                  q_lora_rank=24, rope_parameters=dict(
                                      rope_type="yarn", rope_theta=10000.0, factor=16.0,
                                      original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                                      mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5))),
}


def tiny_config(family: str, **overrides):
    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny model for {family!r}; known: {', '.join(TINY_FAMILIES)}")
    model_type, kw = TINY_FAMILIES[family]
    kw = copy.deepcopy({**kw, **overrides})  # config classes may fill in nested dicts (Mistral 4's rope_parameters)
    if model_type == "longcat_flash" and "head_dim" not in overrides:
        # LongCat's rotary embedding takes its width from head_dim (its checkpoints set it to qk_rope_head_dim):
        # a fixed head_dim made every other qk_rope_head_dim fail in the forward with a shape error.
        kw["head_dim"] = kw["qk_rope_head_dim"]
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny model of `family`, in eval mode, eager attention (exact fp32 math)."""
    register_causal_lms()
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init leaves RMSNorm weights at 1; perturb them so tests see the norms' weights move correctly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def save_tiny_model(family: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny model as a local checkpoint directory (config.json + safetensors)."""
    path = Path(path)
    tiny_model(family, seed).save_pretrained(path)
    return path
