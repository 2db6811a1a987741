"""RoPE path calibration: per-pair rotation phi_j and tied scale alpha_j on positional QK reconstruction.

Objective (DESIGN.md §3), in cache coordinates with k' = M k and q' = M^-T q:
    E_(t, u<=t) ( q'(t) . (Q(k'(u)) - k'(u)) )^2  /  E ( q(t) . k(u) )^2
Only the positional part of the scores sees RoPE-cache error, so this bounds what reaches the output.
Starting points: identity, and alpha_j = 1 / (pair j's magnitude) — the optimum of the rounding-noise model
for one group per token, which equalises the pairs' ranges so no pair wastes the shared step size.
"""

from __future__ import annotations

import torch

from quantmla.calibrate.search import SearchResult, search, split
from quantmla.config import QuantFormat
from quantmla.quant.formats import fake_quantize, fake_quantize_ste
from quantmla.transforms.rope import RopeTransform


def _pair_index(pairs, device=None) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.long, device=device)


def transform_pairs(x: torch.Tensor, mats: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Apply mats [P, 2, 2] to the pairs idx [P, 2] of x [..., dr] (differentiable)."""
    xp = x[..., idx]  # [..., P, 2]
    y = torch.einsum("pij,...pj->...pi", mats, xp)
    out = torch.empty_like(x)
    out[..., idx] = y.to(x.dtype)
    return out


def _mats(log_scale: torch.Tensor, angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, M^-T) as float32 [P, 2, 2]; the scales' geometric mean is pinned to 1 (integer formats are
    invariant to a common scale, so it is not a free parameter)."""
    scale = torch.exp(log_scale - log_scale.mean())
    c, s = torch.cos(angle), torch.sin(angle)
    rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    return rot * scale[:, None, None], rot / scale[:, None, None]


def qk_error(q: torch.Tensor, k: torch.Tensor, pairs, params: dict, fmt: QuantFormat, quant) -> torch.Tensor:
    """Normalised positional score error. q [B, H, Tq, dr] at positions pos [Tq]; k [B, S, dr]."""
    idx = _pair_index(pairs, k.device)
    m, m_inv_t = _mats(params["log_scale"], params["angle"])
    kt, qt = transform_pairs(k, m, idx), transform_pairs(q, m_inv_t, idx)
    err = torch.einsum("bhtr,bsr->bhts", qt, quant(kt, fmt) - kt)
    ref = torch.einsum("bhtr,bsr->bhts", q, k)
    causal = params["_causal"]
    return (err.pow(2) * causal).sum() / (ref.pow(2) * causal).sum()


def calibrate_rope(q_pe, k_pe, q_pos, pairs, fmt: QuantFormat, steps: int = 100, seed: int = 0,
                   train_frac: float = 0.5) -> tuple[RopeTransform, SearchResult]:
    """q_pe [B, H, Tq, dr] post-RoPE queries at positions q_pos [Tq]; k_pe [B, S, dr] the cached keys.
    Sequences are split into a training half (surrogate) and a held-out half (true objective)."""
    q_pe, k_pe = q_pe.detach().float(), k_pe.detach().float()
    train_sl, held_sl = split(q_pe.shape[0], train_frac)
    causal = (torch.arange(k_pe.shape[1], device=k_pe.device)[None, :] <= q_pos.to(k_pe.device)[:, None]).float()
    mag = k_pe[..., _pair_index(pairs, k_pe.device)].pow(2).sum(-1).mean(dim=(0, 1)).sqrt()  # [P]
    starts = {
        "identity": {"log_scale": torch.zeros_like(mag), "angle": torch.zeros_like(mag)},
        "equalised": {"log_scale": -torch.log(mag.clamp_min(1e-6)), "angle": torch.zeros_like(mag)},
    }
    log_scale = starts["equalised"]["log_scale"].clone().requires_grad_(True)
    # A small random start for the angles: at exactly 0 the straight-through gradient is often degenerate.
    angle = 0.01 * torch.randn(mag.shape, generator=torch.Generator().manual_seed(seed))
    angle = angle.to(mag.device).requires_grad_(True)

    def error(p, sl, quant):
        return qk_error(q_pe[sl], k_pe[sl], pairs, {**p, "_causal": causal}, fmt, quant)

    res = search(
        starts,
        true_objective=lambda p: float(error(p, held_sl, fake_quantize).detach()),
        surrogate=lambda p: error(p, train_sl, fake_quantize_ste),
        current=lambda: {"log_scale": log_scale, "angle": angle},
        param_groups=[{"params": [log_scale], "lr": 0.02}, {"params": [angle], "lr": 0.02}],
        steps=steps,
    )
    p = res.params
    scale = torch.exp(p["log_scale"] - p["log_scale"].mean())
    return RopeTransform(p["angle"].cpu(), scale.cpu()), res


def rope_objective(q_pe, k_pe, q_pos, pairs, fmt: QuantFormat, t: RopeTransform) -> float:
    """The true objective of a given transform (real quantization), e.g. to compare with the identity."""
    causal = (torch.arange(k_pe.shape[1], device=k_pe.device)[None, :] <= q_pos.to(k_pe.device)[:, None]).float()
    params = {"log_scale": torch.log(t.scale.float()).to(k_pe.device), "angle": t.angle.float().to(k_pe.device),
              "_causal": causal}
    with torch.no_grad():
        return float(qk_error(q_pe.float(), k_pe.float(), pairs, params, fmt, fake_quantize))

