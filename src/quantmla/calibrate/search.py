"""The optimisation loop shared by both paths: Adam on a straight-through surrogate, judged by the real one.

A straight-through estimator hides how a group's step size drives rounding error, so fitting through it can
raise the true objective. Every `eval_every` steps (and for each starting point) the candidate is scored with
real quantization on the selection sequences, and the best one seen is returned.

Calibration sequences are split three ways (`Splits`): the surrogate and every starting statistic see only
`fit`; `select` picks the winner; `report` is touched once, to report the winner and the identity, so the
reported numbers are not the ones the choice was made on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class SearchResult:
    params: dict  # name -> tensor, the best seen
    best: float  # true objective of the best params (selection sequences)
    start: dict  # start name -> true objective (selection sequences)
    history: list = field(default_factory=list)  # (step, surrogate loss on fit, true objective on select)
    report: dict = field(default_factory=dict)  # point name -> true objective (report sequences)
    format: object = None  # the QuantFormat chosen with params (`choose`)
    points: dict = field(default_factory=dict)  # "transform@format" -> true objective (selection sequences)


def _detached(p: dict) -> dict:
    return {k: v.detach().clone() for k, v in p.items()}


def search(
    starts: dict[str, dict[str, torch.Tensor]],
    true_objective: Callable[[dict], float],
    surrogate: Callable[[dict], torch.Tensor],
    current: Callable[[], dict],
    param_groups: list[dict],
    steps: int,
    eval_every: int = 10,
) -> SearchResult:
    """Score every start with the true objective, then run Adam on `param_groups` (whose values `current()`
    reads as a params dict, e.g. through a parametrization) and keep the best params seen."""
    scored = {name: true_objective(p) for name, p in starts.items()}
    best_name = min(scored, key=scored.get)
    best, best_params = scored[best_name], _detached(starts[best_name])
    opt = torch.optim.Adam(param_groups)
    history = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = surrogate(current())
        loss.backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            params = _detached(current())
            true = true_objective(params)
            history.append((step, loss.item(), true))
            if true < best:
                best, best_params = true, params
    return SearchResult(best_params, best, scored, history)


@dataclass(frozen=True)
class Splits:
    """Disjoint ranges of calibration sequences (dim 0): fit the surrogate and the starting statistics,
    select the best candidate, report."""

    fit: slice
    select: slice
    report: slice

    @classmethod
    def of(cls, n: int) -> Splits:
        """A quarter (at least one sequence) each to select and report, the rest to fit."""
        if n < 3:
            raise ValueError(f"need at least 3 calibration sequences (fit / select / report), got {n}")
        held = max(1, n // 4)
        return cls(slice(0, n - 2 * held), slice(n - 2 * held, n - held), slice(n - held, n))


def choose(transforms: dict[str, dict], formats: list, objective: Callable[[dict, object], float]
           ) -> tuple[str, object, dict[str, float]]:
    """Score every (transform, format) point with `objective(params, fmt)` (the true objective on the
    selection sequences) and return (transform name, format, all scores by "name@format"). Ties keep the
    earlier point (formats are listed cheapest-to-explain first: the requested one, unclipped)."""
    scores, best = {}, None
    for fmt in formats:
        for name, params in transforms.items():
            v = objective(params, fmt)
            scores[f"{name}@{fmt}"] = v
            if best is None or v < best[0]:
                best = (v, name, fmt)
    return best[1], best[2], scores
