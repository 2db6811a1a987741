"""Perplexity and next-token KL to BF16, with every token scored as a server would score it.

A window of L tokens is split into a context (the first L - S) and a scored continuation (the last S). One
forward of the whole window through `serving.serving_logits` computes every layer's attention with serving
semantics: each query sees the sink and its own last `recent` keys in BF16 and every other key as the cache
stores it (quantized then dequantized; token-axis formats by whole blocks). So the context's hidden states,
and the cached latents deeper layers compute from them, are those a server's prefill produces, and scored
token j attends exactly as its decode step would. Row j of the result is the distribution over token
L - S + j, from position L - S - 1 + j.

The reference is one plain forward of the reference model (no cache at all), so a BF16 cache's own KL is
measured, not zero by construction. Only per-window reductions (mean NLL, mean KL) outlive a batch:
full-vocabulary log-probabilities exist for the scored positions of one batch of windows at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantmla.config import CacheConfig
from quantmla.eval.serving import QUERY_BLOCK, serving_logits


@torch.no_grad()
def score_window(model, ids: torch.Tensor, scored: int, config: CacheConfig, query_block: int = QUERY_BLOCK
                 ) -> torch.Tensor:
    """Log-probabilities of the next token at the scored positions of windows ids [B, L] under serving
    semantics for `config`: float32 [B, scored, vocab] on the CPU, row j the distribution over token
    L - scored + j (from positions L - scored - 1 .. L - 2)."""
    length = ids.shape[1]
    if not 0 < scored < length:
        raise ValueError(f"scored tokens must be in [1, {length - 1}] for windows of {length}, got {scored}")
    rows = torch.arange(length - scored - 1, length - 1, device=model.device)
    logits = serving_logits(model, ids, config, rows, query_block)
    return F.log_softmax(logits.float(), dim=-1).cpu()


def nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token: logprobs [B, S, V], targets [B, S] -> [B, S]."""
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per token in nats: [B, S, V] x2 -> [B, S]. Clamped at 0: two nearly equal distributions
    (a BF16 cache against the plain forward) can otherwise sum to -1e-10 through rounding."""
    ref = ref_logprobs.double()
    return (ref.exp() * (ref - logprobs.double())).sum(-1).clamp_min(0.0)


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, scored: int) -> torch.Tensor:
    """What score_window's rows mean, from one plain forward of windows ids [B, L] without a cache:
    float32 [B, scored, vocab] on the CPU."""
    logits = model(ids.to(model.device), logits_to_keep=scored + 1).logits[:, :-1]
    return F.log_softmax(logits.float(), dim=-1).cpu()


def window_stats(model, windows: torch.Tensor, scored: int, config: CacheConfig, reference_model=None,
                 batch: int = 1, desc: str = "ppl/kl", progress: bool = True) -> dict[str, torch.Tensor]:
    """Per window of windows [N, L], float64 [N] each: "nll" the mean NLL of its scored tokens under `model`
    with a cache `config` (score_window), "nll_ref" the same under a plain forward of `reference_model`
    (default: `model`), "kl" the mean KL(reference || model) over those tokens."""
    reference_model = model if reference_model is None else reference_model
    out = {"nll": [], "nll_ref": [], "kl": []}
    for i in tqdm(range(0, windows.shape[0], batch), desc=desc, disable=not progress, leave=False):
        ids = windows[i:i + batch]
        targets = ids[:, -scored:]
        logprobs = score_window(model, ids, scored, config)
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
