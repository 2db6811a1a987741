"""Sampling parameters and the sampler: logits of a batch -> one next token per sequence.

Greedy (temperature 0) is an argmax. Otherwise the logits are divided by the temperature, cut to the top-k
and to the top-p nucleus, and a token is drawn with the exponential-race trick (argmax of p / E, E ~ Exp(1)),
which equals sampling from p. A request with a `seed` draws its noise from its own generator, so its output
does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


GREEDY_BELOW = 1e-5  # temperatures below this sample the argmax (vLLM's threshold too)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for.

    max_tokens: tokens to generate (>= 1); temperature: 0 = greedy (so is any below GREEDY_BELOW, where
    dividing fp32 logits by it overflows); top_p in (0, 1] (the most likely token always stays); top_k: 0 = off;
    seed: None = the engine's shared generator; stop_token_ids: extra ids that end the output (the model's
    eos always does, unless ignore_eos), kept as a frozenset: every new token of the request is looked up in it.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        # torch's generators take 64-bit seeds: a larger one would fail later, inside the engine's step
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer (in [-2**63, 2**64)) or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row of logits [V] -> probabilities [V] after temperature, top-k and top-p (fp32)."""
    logits = logits.float()
    # Shifted by the max before dividing: a tiny temperature then sends the other logits to -inf (greedy in
    # the limit) instead of overflowing every logit to inf, which made the probabilities NaN.
    logits = (logits - logits.max()) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        drop[0] = False  # the most likely token stays, also for a top_p that rounds to 0 in fp32
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           shared: torch.Generator | None = None) -> list[int]:
    """logits [B, V] (any float dtype, any device), one SamplingParams and generator (or None) per row ->
    B token ids. Greedy rows share one argmax; the others are drawn row by row."""
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = filter_logits(logits[i], p.temperature, p.top_k, p.top_p)
        gen = generators[i] or shared
        noise = torch.empty(probs.shape, device="cpu").exponential_(generator=gen).to(probs.device)
        tokens[i] = (probs / noise).argmax()
    return tokens.tolist()
