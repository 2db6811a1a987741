"""Perplexity and next-token KL to BF16, with the scored tokens attending to the cache under test.

A window of L tokens is split into a context (the first L - S) and a scored continuation (the last S).
The context is prefilled through the cache; its last logit scores the first continuation token, exactly as
a server would after prefill. The continuation is then fed in chunks of at most `chunk` tokens (default
16), each attending to what the cache really holds: sink + dequantized body + recent window.

Why chunks: QuantMLACache quantizes a token when it leaves the recent window, at the end of each call. A
query in the middle of a chunk therefore sees the window as it will be at the chunk's end, so up to
chunk - 1 of the oldest window tokens are already quantized (pessimistic by at most 15 of 128 with the
defaults). Token-by-token decoding would be exact and 16x slower; one forward over the whole window
would quantize everything but the last `recent` tokens for every query, which is far from serving.

The reference is one plain forward of the reference model (no cache at all), so a BF16 cache's own KL is
measured, not zero by construction. Only per-window reductions (mean NLL, mean KL) outlive a batch:
full-vocabulary log-probabilities exist for one batch of windows at a time (a 100 k vocabulary would need
tens of GB for a whole evaluation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantmla.cache.quant_cache import QuantMLACache
from quantmla.config import CacheConfig
from quantmla.models.adapters import cache_kwargs

CHUNK = 16


@torch.no_grad()
def score_window(model, ids: torch.Tensor, scored: int, config: CacheConfig, chunk: int = CHUNK) -> torch.Tensor:
    """Log-probabilities of the next token at the scored positions of windows ids [B, L].

    Returns float32 [B, scored, vocab] on the CPU: row j is the distribution over token L - scored + j, computed with
    the context ids[:, :L - scored] prefilled through a fresh QuantMLACache(config) and the continuation fed
    in chunks of <= `chunk` tokens.
    """
    length = ids.shape[1]
    if not 0 < scored < length:
        raise ValueError(f"scored tokens must be in [1, {length - 1}] for windows of {length}, got {scored}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    ids = ids.to(model.device)
    cache = QuantMLACache(config)
    kw = cache_kwargs(model, cache)
    start = length - scored
    logits = [model(ids[:, :start], use_cache=True, logits_to_keep=1, **kw).logits]
    # The last scored token's own logit predicts past the window, so feed only ids[start : L-1].
    for a in range(start, length - 1, chunk):
        logits.append(model(ids[:, a:min(a + chunk, length - 1)], use_cache=True, **kw).logits)
    return F.log_softmax(torch.cat(logits, dim=1).float(), dim=-1).cpu()


def nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token: logprobs [B, S, V], targets [B, S] -> [B, S]."""
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per token in nats: [B, S, V] x2 -> [B, S]."""
    ref = ref_logprobs.double()
    return (ref.exp() * (ref - logprobs.double())).sum(-1)


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, scored: int) -> torch.Tensor:
    """What score_window's rows mean, from one plain forward of windows ids [B, L] without a cache:
    float32 [B, scored, vocab] on the CPU."""
    logits = model(ids.to(model.device), logits_to_keep=scored + 1).logits[:, :-1]
    return F.log_softmax(logits.float(), dim=-1).cpu()


def window_stats(model, windows: torch.Tensor, scored: int, config: CacheConfig, reference_model=None,
                 chunk: int = CHUNK, batch: int = 1, desc: str = "ppl/kl", progress: bool = True
                 ) -> dict[str, torch.Tensor]:
    """Per window of windows [N, L], float64 [N] each: "nll" the mean NLL of its scored tokens under `model`
    with a cache `config` (score_window), "nll_ref" the same under a plain forward of `reference_model`
    (default: `model`), "kl" the mean KL(reference || model) over those tokens."""
    reference_model = model if reference_model is None else reference_model
    out = {"nll": [], "nll_ref": [], "kl": []}
    for i in tqdm(range(0, windows.shape[0], batch), desc=desc, disable=not progress, leave=False):
        ids = windows[i:i + batch]
        targets = ids[:, -scored:]
        logprobs = score_window(model, ids, scored, config, chunk)
        ref = reference_logprobs(reference_model, ids, scored)
        out["nll"].append(nll(logprobs, targets).double().mean(-1))
        out["nll_ref"].append(nll(ref, targets).double().mean(-1))
        out["kl"].append(kl(ref, logprobs).mean(-1))
    return {k: torch.cat(v) for k, v in out.items()}


def ppl_kl(stats: dict[str, torch.Tensor]) -> dict:
    """From window_stats (every window scores the same number of tokens): ppl = exp(mean NLL), ppl_bf16 the
    reference's, kl = mean KL(reference || method)."""
    return {"ppl": math.exp(stats["nll"].mean().item()), "ppl_bf16": math.exp(stats["nll_ref"].mean().item()),
            "kl": stats["kl"].mean().item()}
