"""RoPE path: per-pair rotation phi_j and tied scale alpha_j, folded into kv_a_proj and the query projection.

RoPE rotates pair j by t*theta_j. The linear maps of a pair that commute with every rotation are the
"complex scalings" M_j = alpha_j Rot(phi_j). Keys get M_j, queries M_j^{-T} = Rot(phi_j) / alpha_j, so
q_pe(t) . k_pe(u) is unchanged, and the cache holds k' = M_j k on the cache coordinates of pair j.
Which rows form a pair (weights) and which cache coordinates do comes from MLALayer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantmla.models.adapters import MLALayer, query_weight


@dataclass
class RopeTransform:
    angle: torch.Tensor  # [dr/2] phi_j, radians
    scale: torch.Tensor  # [dr/2] alpha_j > 0

    @classmethod
    def identity(cls, dr: int) -> "RopeTransform":
        return cls(torch.zeros(dr // 2), torch.ones(dr // 2))


def pair_matrices(t: RopeTransform) -> torch.Tensor:
    """M_j = alpha_j [[cos phi, -sin phi], [sin phi, cos phi]] as [P, 2, 2] float64."""
    c, s = torch.cos(t.angle.double()), torch.sin(t.angle.double())
    rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    return rot * t.scale.double()[:, None, None]


def _apply_pairs(x: torch.Tensor, mats: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Apply mats[j] to the pair pairs[j] along x's last dim."""
    idx = torch.tensor(pairs, device=x.device)
    out = x.double().clone()
    xp = out[..., idx]  # [..., P, 2]
    out[..., idx] = torch.einsum("pij,...pj->...pi", mats.to(x.device), xp)
    return out.to(x.dtype)


def apply_rope_transform(k_pe: torch.Tensor, layer: MLALayer, t: RopeTransform) -> torch.Tensor:
    """What the cache holds after folding t: M_j applied to each cache pair of k_pe [..., dr]."""
    return _apply_pairs(k_pe, pair_matrices(t), layer.cache_pairs)


def _apply_pairs_to_rows(w: torch.Tensor, offset: int, mats: torch.Tensor, pairs) -> None:
    """In place: rows (offset+i, offset+k) of w <- M_j @ those rows, for every pair j."""
    rows = torch.tensor([[offset + i, offset + k] for i, k in pairs], device=w.device)
    w[rows] = torch.einsum("pij,pj...->pi...", mats.to(w.device), w[rows].double()).to(w.dtype)


@torch.no_grad()
def fold_rope(attn, layer: MLALayer, t: RopeTransform) -> None:
    """Fold t into kv_a_proj's rope rows (M_j) and every head's rope rows of the query projection (M_j^-T)."""
    half = layer.rope_dim // 2
    if t.angle.shape != (half,) or t.scale.shape != (half,):
        raise ValueError(f"rope transform for {layer.module}: expected {half} angles and {half} scales")
    if (t.scale <= 0).any() or not torch.isfinite(t.scale).all():
        raise ValueError(f"rope transform for {layer.module}: pair scales must be finite and > 0")
    mats = pair_matrices(t)
    inv_t = pair_matrices(RopeTransform(t.angle, 1.0 / t.scale))  # M^-T = Rot(phi) / alpha
    kv_a = attn.kv_a_proj_with_mqa
    _apply_pairs_to_rows(kv_a.weight, layer.kv_lora_rank, mats, layer.weight_pairs)
    if kv_a.bias is not None:
        _apply_pairs_to_rows(kv_a.bias, layer.kv_lora_rank, mats, layer.weight_pairs)
    q = query_weight(attn, layer)
    for h in range(layer.num_heads):
        offset = h * layer.qk_head_dim + layer.nope_dim
        _apply_pairs_to_rows(q.weight, offset, inv_t, layer.weight_pairs)
        if q.bias is not None:
            _apply_pairs_to_rows(q.bias, offset, inv_t, layer.weight_pairs)


def random_rope_transform(dr: int, generator: torch.Generator | None = None) -> RopeTransform:
    """A random transform (angles in [-pi, pi), scales in [0.5, 2]) for exactness tests and demos."""
    angle = (torch.rand(dr // 2, generator=generator) * 2 - 1) * math.pi
    scale = 2 ** (torch.rand(dr // 2, generator=generator) * 2 - 1)
    return RopeTransform(angle, scale)
