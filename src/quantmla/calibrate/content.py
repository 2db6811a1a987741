"""Content path calibration: orthogonal rotation R and channel scale sigma on attention-output reconstruction.

Objective: the error of the attention output when the content cache is quantized, judged
where it lands — after both the scores and the value aggregation:
    || Attn(q, Q~(c), k_pe) - Attn(q, c, k_pe) ||^2 / || Attn(q, c, k_pe) ||^2
where each query sees Q~(c) only at the keys the serving policy holds quantized for it (`policy`: sink and
recent window BF16), with Q~(c) = s*gamma * R^T ( Q(s*sigma * R c_hat) / (s*sigma) ), c_hat = c / (s*gamma):
quantize in the transformed space, map back, and compare in the original one (the fold makes the two spaces equivalent).
R is parametrised with torch's orthogonal parametrization (Cayley map: its backward is far cheaper than the
matrix exponential's at dc = 512), sigma by its logarithm.
Starting points: identity (RTN), SmoothQuant's migration, a randomized Hadamard rotation (spreads
outlier channels over the group) and the principal axes of c (`principal_axes`: energy sorted into the
leading groups, which a ranked format, e.g. int8r128, stores and the rest it drops); the fit starts from the
Hadamard one. The format (clipping ratio, group axis, rank) is then chosen among `space.SearchSpace`'s
points with the real objective.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

from quantmla.calibrate.search import SearchResult, Splits, choose, search
from quantmla.calibrate.smooth import smooth_scales
from quantmla.calibrate.space import SearchSpace
from quantmla.config import CacheConfig
from quantmla.policy import policy_attention, quantize_body, quantized_keys
from quantmla.quant.formats import fake_quantize, fake_quantize_ste
from quantmla.transforms.content import ContentTransform


def random_hadamard(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """H diag(random signs) / sqrt(n) for n a power of two (falls back to a random orthogonal matrix)."""
    if n & (n - 1):
        return torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))[0].float()
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    return h * signs / n**0.5


def principal_axes(x: torch.Tensor, group: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Orthogonal [d, d] for vectors x [..., d]: its rows are the eigenvectors of the second moment E[x x^T]
    (not the covariance: the mean is signal the cache must keep too), by decreasing energy, then each run of
    `group` rows mixed by its own random Hadamard so a group's channels share its energy evenly (one scale per
    group). x @ R.T puts the energy in the leading groups: a ranked format keeps those."""
    flat = x.detach().double().reshape(-1, x.shape[-1])
    _, vecs = torch.linalg.eigh(flat.T @ flat / max(flat.shape[0], 1))
    axes = vecs.flip(1).T.float()  # rows, by decreasing eigenvalue
    d = x.shape[-1]
    if group <= 1 or d % group:
        return axes
    mix = torch.block_diag(*[random_hadamard(group, generator) for _ in range(d // group)]).to(axes)
    return mix @ axes


def axes_start(c_hat: torch.Tensor, group: int, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotation [d, d], sigma [d]) of the principal-axes starting point for c_hat [..., d]: `principal_axes`,
    and one over each rotated channel's rms, where channels far below the strongest are scaled as if 1e-4 of
    it (a ranked format drops them anyway)."""
    axes = principal_axes(c_hat, group, generator).to(c_hat.device)
    rms = (c_hat @ axes.T).pow(2).reshape(-1, c_hat.shape[-1]).mean(0).sqrt()
    return axes, 1 / rms.clamp_min(rms.max() * 1e-4 + 1e-12)


def attention_heads(q_abs, q_pe, c, k_pe, w_uv, scale, q_pos, delta=None, quantized=None, delta_pe=None):
    """Per-head attention output in value space [B, H, Tq, dv] for queries at positions q_pos [Tq]; with
    delta / delta_pe (the content / RoPE cache's error) and quantized [Tq, S], as `policy.policy_attention`
    serves it."""
    quantized = torch.zeros(()) if quantized is None else quantized
    latent = policy_attention(q_abs, q_pe, c, k_pe, scale, q_pos, quantized, delta, delta_pe)
    return torch.einsum("bhtc,hvc->bhtv", latent, w_uv)


def content_error(batch, gamma, rotation, sigma, cfg: CacheConfig, quant) -> torch.Tensor:
    """Normalised attention-output error with the content cache quantized through (rotation, sigma) in
    cfg.content, where cfg's serving policy quantizes it."""
    q_abs, q_pe, c, k_pe, w_uv, scale, q_pos, ref = batch
    quantized = quantized_keys(q_pos.to(c.device), c.shape[1], cfg, cfg.content).float()
    c_t = ((c / gamma) @ rotation.T) * sigma
    c_q = ((quantize_body(c_t, cfg.content, cfg.sink, quant) / sigma) @ rotation) * gamma
    out = attention_heads(q_abs, q_pe, c, k_pe, w_uv, scale, q_pos, c_q - c, quantized)
    return (out - ref).pow(2).sum() / ref.pow(2).sum()


def _data(q_abs, q_pe, c, k_pe, w_uv, softmax_scale, q_pos, sl=slice(None)) -> tuple:
    """The batch content_error reads, for the sequences sl."""
    ref = attention_heads(q_abs[sl], q_pe[sl], c[sl], k_pe[sl], w_uv, softmax_scale, q_pos)
    return q_abs[sl], q_pe[sl], c[sl], k_pe[sl], w_uv, softmax_scale, q_pos, ref


def calibrate_content(q_abs, q_pe, c, k_pe, w_uv, gamma, softmax_scale, q_pos, cfg: CacheConfig,
                      steps: int = 100, seed: int = 0, splits: Splits | None = None,
                      space: SearchSpace | None = None) -> tuple[ContentTransform, SearchResult]:
    """q_abs [B, H, Tq, dc] absorbed queries and q_pe [B, H, Tq, dr] at positions q_pos [Tq]; c [B, S, dc] and
    k_pe [B, S, dr] the cache; w_uv [H, dv, dc]; gamma [dc] = latent scale * kv_a_layernorm weight (c = gamma *
    c_hat); cfg: the content format and the serving policy (which keys each query sees quantized). Sequences
    are split by `splits` (default Splits.of(B)). The transform is fitted for cfg.content; then every
    (transform, format) point of `space` (default: cfg.content only) is scored on the selection sequences
    (`space` module docstring) and the best kept: the result's `format` and `params`. Its `report` holds the
    true objective on the report sequences of "identity" (RTN at cfg.content), "smoothquant" and
    "calibrated" (the chosen point). Returns the transform to fold, with sigma expressed for the fold (the
    cache holds sigma * R c_hat times the latent scale)."""
    g = torch.Generator().manual_seed(seed)
    q_abs, q_pe, c, k_pe, w_uv, gamma = (t.detach().float() for t in (q_abs, q_pe, c, k_pe, w_uv, gamma))
    splits = splits or Splits.of(c.shape[0])
    fit, select, report = (_data(q_abs, q_pe, c, k_pe, w_uv, softmax_scale, q_pos, sl)
                           for sl in (splits.fit, splits.select, splits.report))
    dc = c.shape[-1]
    hadamard = random_hadamard(dc, g).to(c.device)
    c_rot_rms = ((c[splits.fit] / gamma) @ hadamard.T).pow(2).mean(dim=(0, 1)).sqrt()
    axes, axes_sigma = axes_start(c[splits.fit] / gamma, cfg.content.group, g)
    # SmoothQuant (eval.baselines.smoothquant) on the fit sequences: c' = c * m, the signs of gamma as a
    # diagonal rotation (sigma must be > 0).
    m = smooth_scales(c[splits.fit].abs().amax((0, 1)), q_abs[splits.fit].abs().amax((0, 1, 2))).float()
    starts = {
        # identity: the cache unchanged (sigma = gamma keeps c' = c)
        "identity": {"rotation": torch.eye(dc, device=c.device), "log_sigma": torch.log(gamma.abs().clamp_min(1e-6))},
        "smoothquant": {"rotation": torch.diag(torch.where(gamma < 0, -1.0, 1.0)),
                        "log_sigma": torch.log((gamma.abs() * m).clamp_min(1e-12))},
        "hadamard": {"rotation": hadamard, "log_sigma": -torch.log(c_rot_rms.clamp_min(1e-6))},
        "axes": {"rotation": axes, "log_sigma": torch.log(axes_sigma)},
    }
    if (gamma < 0).any():  # identity's sigma must be gamma itself: with negative entries use R = diag(sign)
        starts["identity"]["rotation"] = starts["smoothquant"]["rotation"].clone()
    # R is optimised through torch's orthogonal parametrization, starting at the Hadamard rotation.
    lin = orthogonal(nn.Linear(dc, dc, bias=False, device=c.device), orthogonal_map="cayley")
    with torch.no_grad():
        lin.weight = hadamard
    log_sigma = starts["hadamard"]["log_sigma"].clone().requires_grad_(True)

    def error(p, data, quant, fmt=cfg.content):
        return content_error(data, gamma, p["rotation"], torch.exp(p["log_sigma"]), replace(cfg, content=fmt),
                             quant)

    def true(p, data, fmt=cfg.content):
        with torch.no_grad():
            return float(error(p, data, fake_quantize, fmt))

    res = search(
        starts,
        true_objective=lambda p: true(p, select),
        surrogate=lambda p: error(p, fit, fake_quantize_ste),
        current=lambda: {"rotation": lin.weight, "log_sigma": log_sigma},
        param_groups=[{"params": list(lin.parameters()), "lr": 2e-3}, {"params": [log_sigma], "lr": 1e-2}],
        steps=steps,
    )
    points = {"identity": starts["identity"], "smoothquant": starts["smoothquant"], "calibrated": res.params,
              "axes": starts["axes"]}
    formats = (space or SearchSpace(clips=(), ranked=False)).formats(cfg.content, dc, int(q_pos.min()), cfg,
                                                                     ranked=True)
    objective = lambda p, fmt: true(p, select, fmt)  # noqa: E731
    # Ranked formats drop channels: only the principal axes are meant for them. (A budget may ask for a
    # ranked format itself, and then every format is ranked.)
    plain, ranked = [f for f in formats if not f.rank], [f for f in formats if f.rank]
    chosen = ([choose(points, plain, objective)] if plain else []) + (
        [choose({"axes": points["axes"]}, ranked, objective)] if ranked else [])
    res.points = {k: v for *_, scores in chosen for k, v in scores.items()}
    name, res.format = min(((n, f) for n, f, _ in chosen), key=lambda nf: res.points[f"{nf[0]}@{nf[1]}"])
    res.params, res.best = points[name], res.points[f"{name}@{res.format}"]
    res.report = {"identity": true(starts["identity"], report), "smoothquant": true(starts["smoothquant"], report),
                  "calibrated": true(res.params, report, res.format)}
    return ContentTransform(res.params["rotation"].double().cpu(), torch.exp(res.params["log_sigma"]).cpu()), res


def content_objective(q_abs, q_pe, c, k_pe, w_uv, gamma, softmax_scale, q_pos, cfg: CacheConfig,
                      t: ContentTransform) -> float:
    """The true objective of a given transform (real quantization in cfg.content, cfg's serving policy) on
    all the given sequences, e.g. to compare with the identity."""
    q_abs, q_pe, c, k_pe, w_uv, gamma = (x.detach().float() for x in (q_abs, q_pe, c, k_pe, w_uv, gamma))
    data = _data(q_abs, q_pe, c, k_pe, w_uv, softmax_scale, q_pos)
    with torch.no_grad():
        return float(content_error(data, gamma, t.rotation.float().to(c.device), t.scale.float().to(c.device),
                                   cfg, fake_quantize))
