"""SmoothQuant's migration scales: the `smoothquant` baseline folds them, and calibration starts from them
(so that SmoothQuant is a point of quantmla's search space, scored on the same selection data)."""

from __future__ import annotations

import torch

SMOOTH_ALPHA = 0.5


def smooth_scales(act_max: torch.Tensor, query_max: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's migration: multiply channel j by max|x_j|^-alpha max|w_j|^alpha; geometric mean 1
    (integer formats ignore a common factor; this keeps magnitudes where they were)."""
    floor = lambda t: t.double().clamp_min(1e-6 * t.max().item() + 1e-30)  # noqa: E731 - dead channels
    log = alpha * (torch.log(floor(query_max)) - torch.log(floor(act_max)))
    return torch.exp(log - log.mean())
