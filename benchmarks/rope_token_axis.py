"""Why does KIVI's token-axis grouping win on the RoPE path? (issue 10, item 2: the hypothesis, measured.)

Hypothesis: low-frequency RoPE pairs barely rotate across 64 neighbouring tokens, so a per-channel scale
over a 64-token block fits them tightly, while one per-token scale shared by all pairs (channel groups)
cannot. On the default model (or --model), per layer:

1. per RoPE pair j (frequency theta_j, rotation 64 theta_j over a block): the INT4 step size a token-axis
   block gives its channels, relative to the step a channel group of the whole token gives, and each pair's
   share of the quantization error in the positional scores q . dk (channel g64 vs token t64);
2. the positional QK error (rope.qk_error: the calibration objective, serving policy sink 4 + recent 128) of
   channel-grouped formats (groups 64/32/16/8, clipping), token-axis blocks (t64, t32), each with the identity
   and with the commuting per-pair scale alpha that equalises the pairs' magnitudes; bytes per token beside.

    python benchmarks/rope_token_axis.py [--model DIR] [--samples 6 --length 1024] [--out benchmarks/results]

Writes rope_token_axis.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
from pathlib import Path

import torch

from quantmla.calibrate.rope import _pair_index, qk_error
from quantmla.capture import capture
from quantmla.config import CacheConfig, QuantFormat
from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.mla import project_queries
from quantmla.models import describe, load_model
from quantmla.models.adapters import attention_module
from quantmla.policy import quantized_keys, query_positions
from quantmla.quant.formats import bytes_per_token, fake_quantize

FORMATS = ("int4", "int4:64c0.9", "int4:64c0.8", "int4:32", "int4:16", "int4:8", "int4:t64", "int4:t32",
           "int2", "int2:64c0.8", "int2:16", "int2:t64")


def pair_stats(k: torch.Tensor, pairs, block: int = 64, bits: int = 4) -> dict:
    """Per pair: mean token-axis step (channel range over a block of `block` tokens) / mean channel-group step
    (range over all channels of one token), both / (2^bits - 1)."""
    n = (k.shape[1] // block) * block
    kb = k[:, :n].unflatten(1, (-1, block))  # [B, nb, block, dr]
    tok_step = (kb.amax(2) - kb.amin(2)).mean((0, 1))  # [dr]
    chan_step = (k.amax(-1) - k.amin(-1)).mean()  # scalar
    idx = _pair_index(pairs)
    return {"token_over_channel_step": (tok_step[idx].mean(-1) / chan_step).tolist()}


def error_by_pair(q, k, pairs, fmt: QuantFormat, cfg: CacheConfig, quantized) -> list[float]:
    """Each pair's share of sum (q_j . dk_j)^2 over the quantized (query, key) pairs."""
    from quantmla.policy import quantize_body

    dk = quantize_body(k, fmt, cfg.sink, fake_quantize) - k
    idx = _pair_index(pairs)
    out = []
    for j in range(idx.shape[0]):
        e = torch.einsum("bhtr,bsr->bhts", q[..., idx[j]], dk[..., idx[j]])
        out.append(float((e.pow(2) * quantized).sum()))
    total = sum(out)
    return [v / total for v in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    command = "python benchmarks/rope_token_axis.py" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out" and v != p.get_default(k))
    torch.manual_seed(0)
    model_dir = resolve_model_dir(a.model)
    model = load_model(model_dir)
    layers = describe(model)
    ids = token_windows(encode(read_text(None), tokenizer_for(model_dir), model.config.vocab_size), a.length,
                        a.samples)
    store = capture(model, layers, ids)
    cfg = CacheConfig("int4", "int4")
    pos = query_positions(ids.shape[1], cfg, a.queries)
    theta = getattr(model.config, "rope_parameters", {}).get("rope_theta", 10000.0)
    dr = layers[0].rope_dim
    rotation64 = [64 * theta ** (-2 * j / dr) for j in range(dr // 2)]
    result = {"command": command,
              "model": str(model_dir), "date": str(datetime.date.today()), "machine": f"CPU {platform.machine()}",
              "sequences": list(ids.shape), "queries": [int(pos[0]), int(pos[-1]), len(pos)],
              "rotation_per_64_tokens": rotation64, "layers": []}
    for layer in layers:
        cap = store[layer.cache_idx]
        with torch.no_grad():
            _, q_pe = project_queries(attention_module(model, layer), layer, cap.hidden, cap.position_embeddings)
        q, k = q_pe[:, :, pos].float(), cap.k_pe.float()
        pairs = layer.cache_pairs
        mag = k[..., _pair_index(pairs)].pow(2).sum(-1).mean((0, 1)).sqrt()
        transforms = {"identity": {"log_scale": torch.zeros_like(mag), "angle": torch.zeros_like(mag)},
                      "alpha": {"log_scale": -torch.log(mag), "angle": torch.zeros_like(mag)}}
        row = {"layer": layer.cache_idx, **pair_stats(k, pairs), "qk_error": {}, "bytes": {}}
        for spec in FORMATS:
            fmt = QuantFormat.parse(spec)
            c = CacheConfig("int4", fmt)
            quantized = quantized_keys(pos, k.shape[1], c, fmt).float()
            row["bytes"][spec] = bytes_per_token(fmt, dr)
            with torch.no_grad():
                row["qk_error"][spec] = {name: float(qk_error(q, k, pairs, t, c, quantized, fake_quantize))
                                         for name, t in transforms.items()}
        for spec in ("int4", "int4:t64"):
            fmt = QuantFormat.parse(spec)
            c = CacheConfig("int4", fmt)
            row[f"error_share_{spec}"] = error_by_pair(q, k, pairs, fmt, c,
                                                       quantized_keys(pos, k.shape[1], c, fmt).float())
        result["layers"].append(row)
        print(f"layer {layer.cache_idx}: " + ", ".join(f"{s} {v['identity']:.2e}/{v['alpha']:.2e}"
                                                       for s, v in row["qk_error"].items()), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rope_token_axis.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "rope_token_axis.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# RoPE path: channel groups vs token-axis (KIVI) groups", "",
             f"Model `{Path(r['model']).name}`, {r['date']}, {r['machine']}; {r['sequences'][0]} x {r['sequences'][1]} "
             f"tokens of the built-in calibration text, queries at {r['queries'][2]} positions "
             f"{r['queries'][0]}-{r['queries'][1]} (each sees keys [4, t - 127) quantized). Command: "
             f"`{r.get('command', 'python benchmarks/rope_token_axis.py')}`.", "",
             "## 1. Per pair: step size of a 64-token block vs one token's channel group, error share", "",
             "Step ratio: mean over blocks of a channel's range over 64 tokens / mean over tokens of the range "
             "over all 64 channels (< 1: the token-axis step is finer). Share: the pair's part of "
             "sum (q_j . dk_j)^2, INT4 g64 (channel) vs t64 (token).", "",
             "| pair j | rotation over 64 tokens (rad) | " +
             " | ".join(f"L{l['layer']} step ratio | L{l['layer']} share g64 / t64" for l in r["layers"]) + " |",
             "|---:|---:|" + "---:|---:|" * len(r["layers"])]
    for j, rot in enumerate(r["rotation_per_64_tokens"]):
        cells = []
        for l in r["layers"]:
            cells += [f"{l['token_over_channel_step'][j]:.2f}",
                      f"{100 * l['error_share_int4'][j]:.1f} / {100 * l['error_share_int4:t64'][j]:.1f} %"]
        lines.append(f"| {j} | {rot:.3g} | " + " | ".join(cells) + " |")
    specs = list(r["layers"][0]["qk_error"])
    lines += ["", "## 2. Positional QK error (normalised), identity / equalising alpha", "",
              "| format | RoPE B/token | " + " | ".join(f"layer {l['layer']}" for l in r["layers"]) + " |",
              "|---|---:|" + "---:|" * len(r["layers"])]
    for s in specs:
        lines.append(f"| {s} | {r['layers'][0]['bytes'][s]:g} | " + " | ".join(
            f"{l['qk_error'][s]['identity']:.2e} / {l['qk_error'][s]['alpha']:.2e}" for l in r["layers"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
