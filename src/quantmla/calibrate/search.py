"""The optimisation loop shared by both paths: Adam on a straight-through surrogate, judged by the real one.

A straight-through estimator hides how a group's step size drives rounding error, so fitting through it can
raise the true objective. Every `eval_every` steps (and for each starting point) the candidate is scored with
real quantization on held-out calibration tokens, and the best one seen is returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class SearchResult:
    params: dict  # name -> tensor, the best seen
    best: float  # true objective of the best params (held-out)
    start: dict  # start name -> true objective
    history: list = field(default_factory=list)  # (step, surrogate loss on train, true objective on held-out)


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


def split(n: int, train_frac: float = 0.5) -> tuple[slice, slice]:
    """Sequences [0, n_train) fit the surrogate, the rest judge the true objective (all of them if n == 1)."""
    if n < 2:
        return slice(None), slice(None)
    n_train = min(n - 1, max(1, int(n * train_frac)))
    return slice(0, n_train), slice(n_train, None)
