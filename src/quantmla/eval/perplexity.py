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
    logits = [model(ids[:, :start], use_cache=True, **kw).logits[:, -1:]]
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


def score_windows(model, windows: torch.Tensor, scored: int, config: CacheConfig, chunk: int = CHUNK,
                  batch: int = 1, desc: str = "ppl/kl", progress: bool = True) -> torch.Tensor:
    """score_window over windows [N, L] in batches: float32 [N, scored, vocab]."""
    out = []
    for i in tqdm(range(0, windows.shape[0], batch), desc=desc, disable=not progress, leave=False):
        out.append(score_window(model, windows[i:i + batch], scored, config, chunk))
    return torch.cat(out)


def ppl_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, windows: torch.Tensor) -> dict:
    """ppl = exp(mean NLL) of the scored tokens; kl = mean KL(ref || method) over the same tokens."""
    targets = windows[:, windows.shape[1] - logprobs.shape[1]:]
    return {"ppl": math.exp(nll(logprobs, targets).double().mean().item()),
            "ppl_bf16": math.exp(nll(ref_logprobs, targets).double().mean().item()),
            "kl": kl(ref_logprobs, logprobs).mean().item()}
