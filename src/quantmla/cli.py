"""The `quantmla` command. The only place where command-line flags exist."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()

MODEL_HELP = ("local Hugging Face checkpoint directory (config.json + safetensors); "
              "default: the small trained MLA model shipped with quantmla")


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"wrote {path}")


# ---------------------------------------------------------------- info
def cmd_info(args) -> None:
    from quantmla.config import CacheConfig
    from quantmla.data import resolve_model_dir
    from quantmla.models import describe
    from quantmla.quant import bytes_per_token

    model_dir = resolve_model_dir(args.model)
    layers = describe(model_dir)
    cfg = CacheConfig(args.content, args.rope).fit(layers[0].kv_lora_rank, layers[0].rope_dim)
    table = Table(title=f"MLA layers of {model_dir}  ({layers[0].model_type}, {len(layers)} attentions)")
    for col in ("cache idx", "module", "heads", "dc", "rope", "nope", "v", "q path", "rope style",
                "weight pairs", "cache pairs", "latent scale", "softmax scale", "mscale"):
        table.add_column(col)
    rows = []
    for layer in layers:
        wp, cp = layer.weight_pairs, layer.cache_pairs
        table.add_row(str(layer.cache_idx), layer.module, str(layer.num_heads), str(layer.kv_lora_rank),
                      str(layer.rope_dim), str(layer.nope_dim), str(layer.v_dim), layer.q_path, layer.rope_style,
                      f"{wp[0]},{wp[1]},…", f"{cp[0]},{cp[1]},…", f"{layer.latent_scale:.4g}",
                      f"{layer.softmax_scale:.4g}", f"{layer.mscale:.4g}")
        bf16 = 2 * (layer.kv_lora_rank + layer.rope_dim)
        quant = bytes_per_token(cfg.content, layer.kv_lora_rank) + bytes_per_token(cfg.rope, layer.rope_dim)
        rows.append({**layer.__dict__, "weight_pairs": wp, "cache_pairs": cp, "bytes_bf16": bf16,
                     "bytes_quantized": quant})
    console.print(table)
    bf16 = sum(r["bytes_bf16"] for r in rows)
    quant = sum(r["bytes_quantized"] for r in rows)
    summary = Table(title="Cache bytes per token (all layers, body; sink/recent tokens stay BF16)")
    for col in ("format", "content", "rope", "bytes/token/layer", "bytes/token", "% of BF16"):
        summary.add_column(col)
    summary.add_row("bf16", "bf16", "bf16", str(rows[0]["bytes_bf16"]), str(bf16), "100.0")
    summary.add_row("chosen", str(cfg.content), str(cfg.rope), str(rows[0]["bytes_quantized"]), str(quant),
                    f"{100 * quant / bf16:.1f}")
    console.print(summary)
    _write_json(args.json, {"model": str(model_dir), "content": str(cfg.content), "rope": str(cfg.rope),
                            "layers": rows, "bytes_per_token_bf16": bf16, "bytes_per_token": quant})


# ---------------------------------------------------------------- analyze
def cmd_analyze(args) -> None:
    from quantmla.analysis.amplification import amplification, plot
    from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
    from quantmla.models import describe, load_model

    model_dir = resolve_model_dir(args.model)
    if not 0 < args.nmse < 1:
        raise ValueError(f"--nmse must be in (0, 1), got {args.nmse}")
    console.print(f"model: {model_dir}")
    model = load_model(model_dir)
    layers = describe(model)
    ids = encode(read_text(args.data), tokenizer_for(model_dir), model.config.vocab_size)
    batch = token_windows(ids, args.length, args.samples)
    console.print(f"text: {args.data or 'built-in calibration sample'}; {batch.shape[0]} x {batch.shape[1]} tokens")
    result = amplification(model, layers, batch, args.nmse, args.seed)

    table = Table(title=f"Attention-output NMSE with cache NMSE {args.nmse:g} in one path of one layer")
    for col in ("layer", "content: before o_proj", "content: after o_proj", "rope: before o_proj",
                "rope: after o_proj", "ratio rope/content"):
        table.add_column(col, justify="right")
    for r in result.layers:
        table.add_row(str(r.layer), f"{r.content_heads_nmse:.3e}", f"{r.content_out_nmse:.3e}",
                      f"{r.rope_heads_nmse:.3e}", f"{r.rope_out_nmse:.3e}", f"{r.ratio:.2f}")
    table.add_section()
    table.add_row("mean", "", "", "", "", f"{result.mean_ratio:.2f}")
    console.print(table)
    e2e = Table(title="End to end: the same NMSE in one path of every layer")
    for col in ("noise in", "next-token KL (nats)", "perplexity", "clean perplexity"):
        e2e.add_column(col, justify="right")
    for path, s in result.end_to_end.items():
        e2e.add_row(path, f"{s['kl']:.3e}", f"{s['ppl']:.4f}", f"{s['ppl_clean']:.4f}")
    console.print(e2e)
    _write_json(args.json, {"model": str(model_dir), **result.to_dict()})
    if args.plot:
        plot(result, args.plot, f"{model_dir.name}: RoPE/content amplification, mean {result.mean_ratio:.2f}x")
        console.print(f"wrote {args.plot}")


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quantmla",
        description="Path-aware quantization of the MLA KV cache: the content latent and the RoPE key, each "
                    "in its own format. MODEL is always a local checkpoint directory; leave it out to use the "
                    "small trained MLA model that ships with quantmla.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="describe every MLA layer and the cache bytes per token",
                       description="Show the detected MLA description of every attention layer (dims, query path, "
                                   "which rows/cache coordinates form RoPE pairs, family scalars) and the cache "
                                   "bytes per token in BF16 and in a chosen format pair.")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--content", default="int4", help="content format: bf16, fp8, int8, int4, int2 [:group] (default int4)")
    s.add_argument("--rope", default="int4", help="RoPE format, same spelling (default int4)")
    s.add_argument("--json", help="also write the description as JSON here")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("analyze", help="how much more RoPE-cache error hurts than content-cache error",
                       description="Per layer, inject noise of exactly --nmse into the content cache only, then "
                                   "into the RoPE cache only, and measure the attention output's NMSE before "
                                   "and after o_proj; print the per-layer ratio RoPE/content and its mean, and "
                                   "the end-to-end next-token KL and perplexity with every layer perturbed.")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--nmse", type=float, default=0.01, help="cache noise, as normalised MSE (default 0.01 = 1%%)")
    s.add_argument("--data", help="text file to run on (default: the built-in calibration sample)")
    s.add_argument("--length", type=int, default=512, help="tokens per sequence (default 512)")
    s.add_argument("--samples", type=int, default=4, help="number of sequences (default 4)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", help="write the results as JSON here")
    s.add_argument("--plot", help="write a per-layer plot (PNG) here")
    s.set_defaults(func=cmd_analyze)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: say what is wrong, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
