"""The amplification experiment (README: "why the RoPE path needs its own method").

Per layer, noise of exactly the given NMSE is put into one cache path (content c or RoPE k_pe) of that layer
alone, on the tokens the serving policy (`CacheConfig.sink` / `recent`) would ever hold quantized, and the
attention output's NMSE is measured before and after o_proj over every query of the sequences. Each query
sees the noise only at the keys its own position leaves quantized (`policy.quantized_keys`), so one captured
forward pass serves every layer. End to end, the same noise goes into every layer at once (a Cache that
hands the model perturbed history: a token gets its noise when it leaves the recent window; the sequences
are fed in chunks as the evaluation does) and the next-token KL to the clean model and the perplexity
change are reported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from quantmla.capture import capture
from quantmla.config import CacheConfig
from quantmla.mla import absorb_queries, project_queries, split_kv_b
from quantmla.models.adapters import MLALayer, attention_module, cache_kwargs
from quantmla.policy import policy_attention, query_positions, quantized_keys

CHUNK = 16  # tokens per forward in end_to_end

PATHS = ("content", "rope")


def add_noise(x: torch.Tensor, nmse: float, generator: torch.Generator) -> torch.Tensor:
    """x + Gaussian noise scaled so that ||noise||^2 / ||x||^2 == nmse exactly."""
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.device)
    noise *= math.sqrt(nmse * x.double().pow(2).sum().item() / noise.pow(2).sum().item())
    return (x.double() + noise).to(x.dtype)


def nmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).pow(2).sum() / ref.double().pow(2).sum()).item()


class PerturbedCache(DynamicCache):
    """A DynamicCache that stores clean history and returns it, for the listed layers, with noise on one path
    where the serving policy would hold it quantized: a token past the first `sink` gets its noise once, when
    it leaves the `recent` newest tokens at the end of an update (NMSE exactly `nmse` over the tokens leaving
    together), and keeps it. sink = recent = 0: every token, from the call that brings it."""

    def __init__(self, config, path: str, nmse: float, layers: set[int], seed: int = 0, sink: int = 0,
                 recent: int = 0):
        super().__init__(config=config)
        self.path, self.nmse, self.noisy_layers, self.sink, self.recent = path, nmse, layers, sink, recent
        self.generator = torch.Generator().manual_seed(seed)
        self.noisy: dict[int, torch.Tensor] = {}  # layer -> the noisy tokens [sink, sink + n)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        c, k_pe = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx not in self.noisy_layers:
            return c, k_pe
        x = c if self.path == "content" else k_pe
        body = self.noisy.get(layer_idx, x[..., :0, :])
        start, end = self.sink + body.shape[-2], x.shape[-2] - self.recent
        if end > start:
            body = torch.cat([body, add_noise(x[..., start:end, :], self.nmse, self.generator)], dim=-2)
            self.noisy[layer_idx] = body
        x = torch.cat([x[..., :self.sink, :], body, x[..., self.sink + body.shape[-2]:, :]], dim=-2)
        return (x, k_pe) if self.path == "content" else (c, x)


@dataclass
class LayerAmplification:
    layer: int
    module: str
    content_heads_nmse: float  # attention output before o_proj
    rope_heads_nmse: float
    content_out_nmse: float  # after o_proj
    rope_out_nmse: float

    @property
    def ratio(self) -> float:
        return self.rope_out_nmse / self.content_out_nmse

    @property
    def ratio_heads(self) -> float:
        return self.rope_heads_nmse / self.content_heads_nmse


@dataclass
class AmplificationResult:
    nmse: float
    tokens: int
    layers: list[LayerAmplification]
    end_to_end: dict = field(default_factory=dict)  # path -> {kl, ppl, ppl_clean}
    sink: int = 0  # the serving policy the noise followed
    recent: int = 0

    @property
    def mean_ratio(self) -> float:
        return sum(layer.ratio for layer in self.layers) / len(self.layers)

    def to_dict(self) -> dict:
        return {
            "nmse": self.nmse,
            "tokens": self.tokens,
            "sink": self.sink,
            "recent": self.recent,
            "layers": [{**asdict(layer), "ratio": layer.ratio, "ratio_heads": layer.ratio_heads}
                       for layer in self.layers],
            "mean_ratio": self.mean_ratio,
            "mean_ratio_heads": sum(layer.ratio_heads for layer in self.layers) / len(self.layers),
            "end_to_end": self.end_to_end,
        }


def policy_output(attn, layer: MLALayer, k, quantized: torch.Tensor, delta_c=None, delta_pe=None):
    """(output after o_proj, heads before it) of the captured attention k over its own cache, each query
    seeing the deltas at the keys `quantized` [T, T] marks (`policy.policy_attention`)."""
    q_nope, q_pe = project_queries(attn, layer, k.hidden, k.position_embeddings, k.positions)
    w_uk, w_uv = split_kv_b(attn, layer)
    pos = torch.arange(k.c.shape[1], device=k.c.device)
    latent = policy_attention(absorb_queries(q_nope.float(), w_uk.float()), q_pe.float(), k.c.float(),
                              k.k_pe.float(), layer.softmax_scale, pos, quantized, delta_c, delta_pe)
    heads = torch.einsum("bhtc,hvc->bthv", latent, w_uv.float()).flatten(2).to(k.hidden.dtype)
    return attn.o_proj(heads), heads


@torch.no_grad()
def layer_amplification(model, layers: list[MLALayer], input_ids: torch.Tensor, nmse_target: float = 0.01,
                        seed: int = 0, draws: int = 3, progress: bool = True,
                        policy: CacheConfig = CacheConfig()) -> list[LayerAmplification]:
    """Per-layer output NMSE with noise on content only vs RoPE only (mean over `draws` noise draws), on the
    tokens `policy` quantizes ([sink, T - recent)), each query seeing it only where `policy` would."""
    length = input_ids.shape[1]
    query_positions(length, policy, 1)  # raises when no query would see a quantized key
    cap = capture(model, layers, input_ids)
    gen = torch.Generator().manual_seed(seed)
    quantized = quantized_keys(torch.arange(length), length, policy, policy.content).float()
    body = slice(policy.sink, length - policy.recent)
    results = []
    for layer in tqdm(layers, desc="layers", disable=not progress):
        k = cap[layer.cache_idx]
        attn = attention_module(model, layer)
        quantized = quantized.to(k.c.device)
        clean_out, clean_heads = policy_output(attn, layer, k, quantized)
        acc = {p: [0.0, 0.0] for p in PATHS}
        for _ in range(draws):
            for path in PATHS:
                x = (k.c if path == "content" else k.k_pe).float()
                delta = torch.zeros_like(x)
                delta[:, body] = add_noise(x[:, body], nmse_target, gen) - x[:, body]
                deltas = (delta, None) if path == "content" else (None, delta)
                out, heads = policy_output(attn, layer, k, quantized, *deltas)
                acc[path][0] += nmse(heads, clean_heads) / draws
                acc[path][1] += nmse(out, clean_out) / draws
        results.append(LayerAmplification(layer.cache_idx, layer.module, acc["content"][0], acc["rope"][0],
                                          acc["content"][1], acc["rope"][1]))
    return results


def next_token_stats(logits: torch.Tensor, ref_logits: torch.Tensor, input_ids: torch.Tensor) -> dict:
    """KL(ref || logits) per next token (mean, nats) and perplexity of both on the next tokens."""
    lp, ref = F.log_softmax(logits[:, :-1].double(), -1), F.log_softmax(ref_logits[:, :-1].double(), -1)
    kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    target = input_ids[:, 1:].unsqueeze(-1)
    ppl = math.exp(-lp.gather(-1, target).mean().item())
    ppl_ref = math.exp(-ref.gather(-1, target).mean().item())
    return {"kl": kl, "ppl": ppl, "ppl_clean": ppl_ref}


@torch.no_grad()
def end_to_end(model, layers: list[MLALayer], input_ids: torch.Tensor, nmse_target: float = 0.01,
               seed: int = 0, policy: CacheConfig = CacheConfig(), chunk: int = CHUNK) -> dict:
    """Noise on one path of every layer at once, where `policy` quantizes: next-token KL to the clean model
    and perplexity. The sequences are fed in chunks of `chunk` tokens (a query sees up to chunk - 1 window
    tokens noisy early)."""
    clean = model(input_ids).logits
    out = {}
    for path in PATHS:
        cache = PerturbedCache(model.config, path, nmse_target, {layer.cache_idx for layer in layers}, seed,
                               policy.sink, policy.recent)
        kw = cache_kwargs(model, cache)
        logits = torch.cat([model(input_ids[:, a:a + chunk], use_cache=True, **kw).logits
                            for a in range(0, input_ids.shape[1], chunk)], dim=1)
        out[path] = next_token_stats(logits, clean, input_ids)
    return out


def amplification(model, layers, input_ids, nmse_target=0.01, seed=0, progress=True,
                  policy: CacheConfig = CacheConfig()) -> AmplificationResult:
    """Both experiments with noise where `policy` (default: sink 4, recent 128) would quantize."""
    per_layer = layer_amplification(model, layers, input_ids, nmse_target, seed, progress=progress, policy=policy)
    e2e = end_to_end(model, layers, input_ids, nmse_target, seed, policy)
    return AmplificationResult(nmse_target, int(input_ids.numel()), per_layer, e2e, policy.sink, policy.recent)


def plot(result: AmplificationResult, path, title: str = "") -> None:
    """Per-layer attention-output NMSE for content-only and RoPE-only noise, with the ratio on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [layer.layer for layer in result.layers]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(xs) + 3), 4))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [layer.content_out_nmse for layer in result.layers], w, label="noise in content c")
    ax.bar([x + w / 2 for x in xs], [layer.rope_out_nmse for layer in result.layers], w, label="noise in RoPE k_pe")
    ax.set_xticks(xs)
    ax.set_xlabel("layer (cache index)")
    ax.set_ylabel(f"attention-output NMSE (cache NMSE {result.nmse:g})")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(xs, [layer.ratio for layer in result.layers], "k.-", label="ratio RoPE/content")
    ax2.set_ylabel("ratio RoPE / content")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title(title or f"Amplification: mean ratio {result.mean_ratio:.2f}x")
    fig.tight_layout()
    # A name without an extension gets a PNG under that very name (matplotlib would append ".png" to it).
    fig.savefig(path, dpi=120, format=None if Path(path).suffix else "png")
    plt.close(fig)
