"""Both folds are exact: random transforms leave logits unchanged, and the cache then holds c' and k'."""

import pytest
import torch

from quantmla.capture import capture
from quantmla.models import attention_module, describe
from quantmla.models.tiny import TINY_FAMILIES, tiny_model
from quantmla.transforms import ContentTransform, apply_content, apply_rope_transform, fold_content, fold_rope
from quantmla.transforms.rope import RopeTransform, random_rope_transform


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_transforms(model, layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        dc = layer.kv_lora_rank
        rot = torch.linalg.qr(torch.randn(dc, dc, generator=g, dtype=torch.float64))[0]
        out[layer.cache_idx] = (ContentTransform(rot, torch.rand(dc, generator=g) + 0.5),
                                random_rope_transform(layer.rope_dim, g))
    return out


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_folds_are_exact_and_cache_holds_transformed_vectors(family):
    model = tiny_model(family)
    layers = describe(model)
    ids = torch.randint(0, 128, (2, 12))
    logits = model(ids).logits
    before = capture(model, layers, ids)
    gammas = {l.cache_idx: attention_module(model, l).kv_a_layernorm.weight.detach().clone() for l in layers}
    ts = random_transforms(model, layers)
    for layer in layers:
        fold_content(attention_module(model, layer), layer, ts[layer.cache_idx][0])
        fold_rope(attention_module(model, layer), layer, ts[layer.cache_idx][1])
    assert rel(model(ids).logits, logits) <= 1e-5
    after = capture(model, layers, ids)
    for layer in layers:
        ct, rt = ts[layer.cache_idx]
        b, a = before[layer.cache_idx], after[layer.cache_idx]
        assert rel(apply_content(b.c, gammas[layer.cache_idx], ct), a.c) < 1e-5
        assert rel(apply_rope_transform(b.k_pe, layer, rt), a.k_pe) < 1e-5
        assert rel(a.c, b.c) > 0.1 and rel(a.k_pe, b.k_pe) > 0.1  # the cache really changed


def test_a_rope_map_that_does_not_commute_breaks_logits():
    """Mixing two different frequency pairs is not a complex scaling: logits must change (test can fail)."""
    model = tiny_model("deepseek_v3")
    layer = describe(model)[0]
    ids = torch.randint(0, 128, (1, 12))
    logits = model(ids).logits
    wrong = layer.__class__(**{**layer.__dict__, "rope_style": "half"})  # pairs of the wrong layout
    fold_rope(attention_module(model, layer), wrong, random_rope_transform(layer.rope_dim))
    assert rel(model(ids).logits, logits) > 1e-4


def test_identity_transforms_change_nothing():
    model = tiny_model("deepseek_v2")
    layer = describe(model)[0]
    attn = attention_module(model, layer)
    w = {n: p.detach().clone() for n, p in attn.named_parameters()}
    fold_content(attn, layer, ContentTransform.identity(layer.kv_lora_rank, attn.kv_a_layernorm.weight))
    fold_rope(attn, layer, RopeTransform.identity(layer.rope_dim))
    for n, p in attn.named_parameters():
        assert torch.allclose(p, w[n], atol=1e-6), n


def test_bad_transform_arguments():
    model = tiny_model("deepseek_v3")
    layer = describe(model)[0]
    attn = attention_module(model, layer)
    with pytest.raises(ValueError, match="expected R"):
        fold_content(attn, layer, ContentTransform(torch.eye(3), torch.ones(3)))
    with pytest.raises(ValueError, match="> 0"):
        fold_content(attn, layer, ContentTransform(torch.eye(layer.kv_lora_rank), -torch.ones(layer.kv_lora_rank)))
    with pytest.raises(ValueError, match="> 0"):
        fold_rope(attn, layer, RopeTransform(torch.zeros(layer.rope_dim // 2), torch.zeros(layer.rope_dim // 2)))
