"""Content path: orthogonal rotation R and channel scale sigma, folded into kv_a_proj / kv_a_layernorm / kv_b_proj.

With c_raw = kv_a_proj(h)[:dc] and c_hat = c_raw / rms(c_raw), the model caches c = s * gamma * c_hat
(s: the family's latent scale, 1 except LongCat). Since rms(R x) = rms(x), rotating the rows of kv_a_proj
rotates c_hat; the layernorm weight becomes sigma, and gamma moves into kv_b_proj:
    kv_a_proj[:dc] <- R kv_a_proj[:dc]       kv_a_layernorm.weight <- sigma
    kv_b_proj      <- W_b diag(gamma) R^T diag(1/sigma)
so the cache holds c' = s * sigma * R c_hat and kv_b_proj(c') == kv_b_proj_old(c).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.models.adapters import MLALayer


@dataclass
class ContentTransform:
    rotation: torch.Tensor  # [dc, dc], orthogonal
    scale: torch.Tensor  # [dc], > 0

    @classmethod
    def identity(cls, dc: int, gamma: torch.Tensor | None = None) -> "ContentTransform":
        """The transform that leaves the cache unchanged (sigma = gamma keeps c' == c)."""
        scale = torch.ones(dc) if gamma is None else gamma.detach().float().clone()
        return cls(torch.eye(dc), scale)


def apply_content(c: torch.Tensor, gamma: torch.Tensor, t: ContentTransform) -> torch.Tensor:
    """What the cache holds after folding t, from what it held before: sigma * R (c / gamma). c [..., dc]."""
    c_hat = c.double() / gamma.double()
    return (c_hat @ t.rotation.double().T * t.scale.double()).to(c.dtype)


@torch.no_grad()
def fold_content(attn, layer: MLALayer, t: ContentTransform) -> None:
    """Fold t into the attention's weights in place (computed in float64, stored in the weights' dtype)."""
    dc = layer.kv_lora_rank
    if t.rotation.shape != (dc, dc) or t.scale.shape != (dc,):
        raise ValueError(f"content transform for {layer.module}: expected R [{dc},{dc}] and sigma [{dc}]")
    if (t.scale <= 0).any():
        raise ValueError(f"content transform for {layer.module}: channel scales must be > 0")
    kv_a, norm, kv_b = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj
    r, sigma = t.rotation.double().to(kv_a.weight.device), t.scale.double().to(kv_a.weight.device)
    gamma = norm.weight.double()
    kv_a.weight[:dc] = (r @ kv_a.weight[:dc].double()).to(kv_a.weight.dtype)
    if kv_a.bias is not None:
        kv_a.bias[:dc] = (r @ kv_a.bias[:dc].double()).to(kv_a.bias.dtype)
    norm.weight.copy_(sigma.to(norm.weight.dtype))
    kv_b.weight.copy_((kv_b.weight.double() * gamma @ r.T / sigma).to(kv_b.weight.dtype))
