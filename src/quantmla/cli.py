"""The `quantmla` command. The only place where command-line flags exist."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from quantmla.config import CLIPS

console = Console()

MODEL_HELP = ("local Hugging Face checkpoint directory (config.json + safetensors); "
              "default: the small trained MLA model shipped with quantmla")


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"wrote {path}")


def _check_out_file(path: str | None, flag: str) -> str | None:
    """An output file (--json, --plot), checked before any work: a directory, or a file on the way
    (file/x.json), would fail only after the run and lose its results. Returns the path to write: `~` expanded
    (no shell expands it after `--json=`), as it was checked."""
    if path is None:
        return None
    if not path.strip():
        raise ValueError(f"{flag} is empty: name the file to write")
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file")
    parent = next(p for p in target.parents if p.exists())
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: {parent} is not writable")
    return str(Path(path).expanduser())


# ---------------------------------------------------------------- info
def cmd_info(args) -> None:
    from quantmla.config import CacheConfig
    from quantmla.data import resolve_model_dir
    from quantmla.models import describe
    from quantmla.models.adapters import multimodal
    from quantmla.quant import bytes_per_token
    from quantmla.calibrate.export import cache_config_of

    args.json = _check_out_file(args.json, "--json")
    model_dir = resolve_model_dir(args.model)
    layers = describe(model_dir)
    # A calibrated checkpoint's own formats (per layer) for each path not asked for; int4 without one.
    section = cache_config_of(model_dir)
    if section:
        cfg = CacheConfig(args.content or section.content, args.rope or section.rope,
                          layers=tuple((args.content or c, args.rope or r) for c, r in section.layers))
    else:
        cfg = CacheConfig(args.content or "int4", args.rope or "int4")
    cfg = cfg.fit(layers[0].kv_lora_rank, layers[0].rope_dim)
    console.print(layers_table(model_dir.name, layers))
    mm = multimodal(model_dir)
    if mm is not None:
        console.print(f"the language model of a multimodal {mm.config.model_type} checkpoint: quantmla reads it "
                      f"alone, as {mm.text.architectures[0]} (the vision tower is not read)")
    rows = []
    for layer in layers:
        wp, cp = layer.weight_pairs, layer.cache_pairs
        bf16 = 2 * (layer.kv_lora_rank + layer.rope_dim)
        mine = cfg.at(layer.cache_idx)
        quant = bytes_per_token(mine.content, layer.kv_lora_rank) + bytes_per_token(mine.rope, layer.rope_dim)
        rows.append({**layer.__dict__, "weight_pairs": wp, "cache_pairs": cp, "bytes_bf16": bf16,
                     "content": str(mine.content), "rope": str(mine.rope), "bytes_quantized": quant})
    bf16 = sum(r["bytes_bf16"] for r in rows)
    quant = sum(r["bytes_quantized"] for r in rows)
    asked = " ".join(f"--{path} {getattr(cfg, path)}" for path in ("content", "rope") if getattr(args, path))
    if section:
        own = "the checkpoint's own (its quantmla section)"
        kept = [path for path in ("content", "rope") if not getattr(args, path)]
        source = own if not asked else f"{asked}; {kept[0]}: {own}" if kept else asked
    else:
        source = f"--content {cfg.content} --rope {cfg.rope}" + ("" if asked else ", the defaults")
    console.print(bytes_table(rows, source))
    _write_json(args.json, {"model": str(model_dir), "multimodal": mm.config.model_type if mm else None,
                            "content": str(cfg.content), "rope": str(cfg.rope),
                            "layers": rows, "bytes_per_token_bf16": bf16, "bytes_per_token": quant})


def bytes_table(rows: list[dict], source: str) -> Table:
    """`info`'s cache bytes per token, readable at 80 columns: BF16, then the formats, one row per run of
    consecutive layers that share them (a calibrated checkpoint may choose per layer), then their total."""
    table = Table(title="Cache bytes per token (sink/recent tokens stay BF16)",
                  caption=f"formats: {source}", box=box.SIMPLE_HEAD)
    for col in ("layers", "content", "rope", "B/tok/layer", "B/tok", "%BF16"):
        table.add_column(col, justify="left" if col in ("layers", "content", "rope") else "right")
    bf16 = sum(r["bytes_bf16"] for r in rows)
    table.add_row("all", "bf16", "bf16", str(rows[0]["bytes_bf16"]), str(bf16), "100.0")
    runs = []  # [first, last, content, rope, bytes per layer]
    for i, r in enumerate(rows):
        key = [r["content"], r["rope"], r["bytes_quantized"]]
        if runs and runs[-1][2:] == key:
            runs[-1][1] = i
        else:
            runs.append([i, i, *key])
    for a, b, content, rope, per_layer in runs:
        total, share = per_layer * (b - a + 1), sum(r["bytes_bf16"] for r in rows[a : b + 1])
        table.add_row("all" if len(runs) == 1 else str(a) if a == b else f"{a}-{b}", content, rope,
                      str(per_layer), str(total), f"{100 * total / share:.1f}")
    if len(runs) > 1:
        quant = sum(r["bytes_quantized"] for r in rows)
        table.add_row("total", "", "", f"{quant / len(rows):g}", str(quant), f"{100 * quant / bf16:.1f}")
    return table


def layers_table(name: str, layers) -> Table:
    """`info`'s MLA description, readable at 80 columns: one row per run of consecutive layers that agree on
    every field. The module (layer numbers as *) and the RoPE pair mapping go in the caption where every
    layer shares them, else in columns of their own."""
    def fields(layer) -> dict:
        wp, cp = layer.weight_pairs, layer.cache_pairs
        return {"module": re.sub(r"\.\d+(?=\.|$)", ".*", layer.module), "heads": str(layer.num_heads),
                "dc/rope/nope/v": f"{layer.kv_lora_rank}/{layer.rope_dim}/{layer.nope_dim}/{layer.v_dim}",
                "q path": layer.q_path, "rope style": layer.rope_style, "latent": f"{layer.latent_scale:.4g}",
                "softmax": f"{layer.softmax_scale:.4g}", "pair j=1": f"({wp[1][0]},{wp[1][1]}) -> ({cp[1][0]},{cp[1][1]})"}

    runs = []  # [first index, last index, fields]
    for layer in layers:
        f = fields(layer)
        if runs and runs[-1][2] == f and runs[-1][1] == layer.cache_idx - 1:
            runs[-1][1] = layer.cache_idx
        else:
            runs.append([layer.cache_idx, layer.cache_idx, f])
    shared = {k: runs[0][2][k] for k in ("module", "pair j=1") if len({r[2][k] for r in runs}) == 1}
    caption = "; ".join(([f"modules {shared['module']}"] if "module" in shared else []) +
                        ([f"RoPE pair j=1: weight rows -> cache coordinates {shared['pair j=1']}"]
                         if "pair j=1" in shared else []) +
                        ([f"queries x (1 + {layers[0].query_pos_beta:g} ln(1 + floor(position / "
                          f"{layers[0].query_pos_max})))"] if layers[0].query_pos_beta else []))
    table = Table(title=f"MLA layers of {name} ({layers[0].model_type}, {len(layers)} attentions)",
                  caption=caption or None, box=box.SIMPLE_HEAD)
    cols = [k for k in runs[0][2] if k not in shared]
    for col in ["layers", *cols]:
        table.add_column(col)
    for first, last, f in runs:
        table.add_row(str(first) if first == last else f"{first}-{last}", *(f[k] for k in cols))
    return table


def _at_least(low: int):
    """argparse type: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


_positive = _at_least(1)
_tokens = _at_least(0)  # --sink / --recent: refused by argparse, before any model loads


def _check_out_dir(out: str, model_dir: Path, overwrite: bool) -> Path:
    """calibrate's --out, checked before any work: never the model's own directory (its weights would be
    replaced by the folded ones, or deleted first by --streaming), not a file, and empty unless --overwrite."""
    if not out.strip():
        raise ValueError("--out is empty: name the directory the calibrated checkpoint goes to")
    path = Path(out).expanduser().resolve()
    if path == model_dir.resolve():
        raise ValueError(f"--out {out} is the model's own directory: the calibrated weights would replace the "
                         "ones being read; choose another directory")
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if path.is_dir() and not overwrite and (held := sorted(p.name for p in path.iterdir())):
        raise ValueError(f"--out {out} is not empty ({len(held)} entries, e.g. {held[0]}); choose a new directory, "
                         "or pass --overwrite to replace the checkpoint files in it")
    parent = next(p for p in (path, *path.parents) if p.exists())
    if not parent.is_dir():  # a file on the way (out/file/new): mkdir would fail only after the calibration
        raise ValueError(f"--out {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: {parent} is not writable")
    return path


def _check_length(model, length: int, sink: int, recent: int) -> None:
    """Windows longer than the model's positions would calibrate or measure it where it never runs (eval and
    serve refuse them too); a BF16 window that covers all of them would leave nothing quantized."""
    from quantmla.policy import check_window_fits

    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and length > limit:
        raise ValueError(f"--length {length} exceeds the model's max_position_embeddings {limit}; "
                         f"use --length {limit} or less")
    check_window_fits(limit, sink, recent)


# ---------------------------------------------------------------- analyze
def _ratio(x: float) -> str:
    """2 decimals where that shows the value (0.1 to 10000x), else 3 significant digits in e-notation."""
    return f"{x:.2f}" if 0.1 <= x < 1e4 else f"{x:.2e}"


def cmd_analyze(args) -> None:
    from quantmla.analysis.amplification import amplification, plot
    from quantmla.config import CacheConfig
    from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
    from quantmla.models import describe, load_model

    args.json = _check_out_file(args.json, "--json")
    args.plot = _check_out_file(args.plot, "--plot")
    if args.plot and (suffix := Path(args.plot).suffix[1:].lower()):
        from matplotlib.backend_bases import FigureCanvasBase

        if suffix not in (known := FigureCanvasBase.get_supported_filetypes()):  # refused only after the run
            raise ValueError(f"--plot {args.plot}: matplotlib cannot write .{suffix} files; use .png (or "
                             f"{', '.join(sorted(known))})")
    model_dir = resolve_model_dir(args.model)
    if not 0 < args.nmse < 1:
        raise ValueError(f"--nmse must be in (0, 1), got {args.nmse}")
    console.print(f"model: {model_dir}")
    text = read_text(args.data)  # a missing or empty file, before the (slow) model load
    model = load_model(model_dir)
    _check_length(model, args.length, args.sink, args.recent)  # first: a window past the model's positions
    if args.length < args.sink + args.recent + 2:  # the per-layer part needs one token less
        raise ValueError(f"--length {args.length}: the end-to-end KL and perplexity score next-token predictions, "
                         f"and with sink {args.sink} + recent {args.recent} BF16 tokens none sees a noised key; use "
                         f"--length {args.sink + args.recent + 2} or more, or a smaller --recent")
    layers = describe(model)
    ids = encode(text, tokenizer_for(model_dir), model.config.vocab_size, args.length * args.samples)
    batch = token_windows(ids, args.length, args.samples)
    console.print(f"text: {args.data or 'built-in calibration sample'}; {batch.shape[0]} x {batch.shape[1]} tokens")
    result = amplification(model, layers, batch, args.nmse, args.seed, policy=CacheConfig(sink=args.sink,
                                                                                      recent=args.recent))

    table = Table(title=f"Attention-output NMSE with cache NMSE {args.nmse:g} in one path of one layer",
                  caption="before / after: the heads' output before o_proj, the layer's after it; "
                          "ratio: rope after / content after",
                  box=box.SIMPLE_HEAD)
    for col in ("layer", "content before", "content after", "rope before", "rope after", "ratio"):
        table.add_column(col, justify="right")
    for r in result.layers:
        table.add_row(str(r.layer), f"{r.content_heads_nmse:.3e}", f"{r.content_out_nmse:.3e}",
                      f"{r.rope_heads_nmse:.3e}", f"{r.rope_out_nmse:.3e}", _ratio(r.ratio))
    table.add_section()
    table.add_row("mean", "", "", "", "", _ratio(result.mean_ratio))
    console.print(table)
    e2e = Table(title="End to end: the same NMSE in one path of every layer", box=box.SIMPLE_HEAD)
    for col in ("noise in", "next-token KL (nats)", "perplexity", "clean perplexity"):
        e2e.add_column(col, justify="right")
    for path, s in result.end_to_end.items():
        e2e.add_row(path, f"{s['kl']:.3e}", f"{s['ppl']:.4f}", f"{s['ppl_clean']:.4f}")
    console.print(e2e)
    _write_json(args.json, {"model": str(model_dir), **result.to_dict()})
    if args.plot:
        plot(result, args.plot, f"{model_dir.name}: RoPE/content amplification, mean {_ratio(result.mean_ratio)}x")
        console.print(f"wrote {args.plot}")


# ---------------------------------------------------------------- calibrate
def calibration_table(reports) -> Table:
    """Per layer and path: RTN (the identity), SmoothQuant and the chosen point's objective on the report
    sequences, the gain over RTN, and the format chosen."""
    # collapse_padding: one space between columns keeps a format such as int8:16r128c0.95 whole at 80 columns
    table = Table(title="Calibration objectives on the report sequences (they neither fit nor chose; real "
                        "quantization)", box=box.SIMPLE_HEAD, collapse_padding=True)
    for col in ("layer", "path", "chosen format", "RTN", "SmoothQuant", "quantmla", "vs RTN"):
        table.add_column(col, justify="left" if col in ("path", "chosen format") else "right")
    for r in reports:
        for path in ("content", "rope"):
            rtn, sq, best = (getattr(r, f"{path}_{k}") for k in ("identity", "smoothquant", "best"))
            if best is None:
                table.add_row(str(r.layer), path, "bf16", "-", "-", "-", "-")
                continue
            table.add_row(str(r.layer), path, getattr(r, f"{path}_format"), f"{rtn:.2e}", f"{sq:.2e}", f"{best:.2e}",
                          f"{rtn / best:.3g}x" if best > 0 else "-")
    return table


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise ValueError(f"{flag} takes comma-separated numbers, e.g. 1,0.9,0.8, got {text!r}")
    return values


def _formats(args):
    """--content/--rope, with --group applied to the integer formats that name no group of their own (their
    rank and clipping ratio kept)."""
    from quantmla.config import QuantFormat

    out = []
    for spec in (args.content, args.rope):
        kind = re.match(r"int\d+", spec.strip().lower())
        if args.group and ":" not in spec and kind:  # spelled in: a rank is checked against this group, not 64
            spec = f"{kind.group()}:{args.group}{spec.strip().lower()[kind.end():]}"
        out.append(QuantFormat.parse(spec))
    return out


def cmd_calibrate(args) -> None:
    import torch

    from quantmla.calibrate.driver import calibrate_model, check_calibratable, chosen_config
    from quantmla.calibrate.export import save_calibrated
    from quantmla.calibrate.space import SearchSpace
    from quantmla.config import CacheConfig
    from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
    from quantmla.models import describe, load_model
    from quantmla.models.adapters import check_unquantized, multimodal
    from quantmla.calibrate.export import quantmla_section

    model_dir = resolve_model_dir(args.model)
    out_dir = _check_out_dir(args.out, model_dir, args.overwrite)  # written where checked (~ expanded)
    check_unquantized(model_dir)
    if quantmla_section(model_dir):
        console.print(f"note: {model_dir} is already calibrated; the new transforms fold on top of its own (exact) "
                      "and the new quantmla section replaces its record (calibrate the original checkpoint to "
                      "start afresh)", soft_wrap=True)
    content, rope = _formats(args)
    # The search's options, checked before the model loads (the search itself meets them only at layer 0).
    space = SearchSpace(clips=_float_list(args.clips, "--clips"), token_axis=args.token_axis, ranked=args.ranked)
    if args.budget is None:
        check_calibratable(CacheConfig(content, rope))
    else:
        from quantmla.calibrate.budget import check_budget

        check_budget(args.budget)  # before the model loads
        if args.context <= args.sink + args.recent:
            raise ValueError(f"--context {args.context} leaves no quantized tokens after sink {args.sink} + recent "
                             f"{args.recent}: a budget counts the cache at a longer context (default 131072)")
    text = read_text(args.data)  # a missing or empty file, before the (slow) model load
    if args.streaming:
        from quantmla.calibrate.streaming import skeleton

        model = skeleton(model_dir)  # parameters on the meta device; calibrate_streaming loads them per layer
    else:
        model = load_model(model_dir)
    if args.length is None:
        from quantmla.calibrate.driver import default_length

        args.length = default_length(model)
    _check_length(model, args.length, args.sink, args.recent)
    layers = describe(model)
    cfg = CacheConfig(content, rope, args.sink, args.recent).fit(layers[0].kv_lora_rank, layers[0].rope_dim)
    ids = encode(text, tokenizer_for(model_dir), model.config.vocab_size, args.length * args.samples)
    batch = token_windows(ids, args.length, args.samples)
    if batch.shape[0] < 3:  # one each to fit, select and report
        raise ValueError(f"need at least 3 calibration sequences of {args.length} tokens (fit / select / report); "
                         f"the text gives {batch.shape[0]}")
    console.print(f"calibrating {model_dir} ({len(layers)} MLA attentions) for content {cfg.content}, "
                  f"rope {cfg.rope}: {batch.shape[0]} x {batch.shape[1]} tokens, {args.steps} steps per path")
    calibration = {"samples": int(batch.shape[0]), "length": int(batch.shape[1]), "steps": args.steps,
                   "seed": args.seed, "source": str(model_dir), "data": args.data or "built-in"}
    if args.dtype == "auto":
        from quantmla.calibrate.export import source_dtype

        dtype = source_dtype(model_dir)
    else:
        dtype = getattr(torch, args.dtype)
    if args.budget is not None:
        if args.streaming:
            raise ValueError("--budget needs the model in memory (it scores every format on all layers first); "
                             "drop --streaming")
        from quantmla.calibrate.budget import choose_formats

        alloc = choose_formats(model, layers, batch, cfg, args.budget, args.context, ranked=args.ranked)
        cfg = alloc.config
        calibration["budget"] = {"fraction": args.budget, "context": args.context, "chosen_fraction": alloc.fraction}
        console.print(alloc.summary(), soft_wrap=True)
    calibration["space"] = {"clips": list(space.clips), "token_axis": space.token_axis, "ranked": space.ranked}
    torch.manual_seed(args.seed)
    if args.streaming:
        from quantmla.calibrate.streaming import calibrate_streaming

        result = calibrate_streaming(model_dir, out_dir, batch, cfg, args.steps, args.seed, dtype, calibration,
                                     space=space)
        reports = result.reports
    else:
        reports = calibrate_model(model, layers, batch, cfg, args.steps, args.seed, space=space)
    console.print(calibration_table(reports))
    chosen = chosen_config(cfg, reports)
    unservable = sorted({str(f) for pair in chosen.per_layer for f in pair if not SearchSpace.servable(f)})
    token = sorted({str(f) for pair in chosen.per_layer for f in pair if f.axis == "token"})
    from quantmla.calibrate.budget import fraction_at
    from quantmla.eval.suite import body_bytes_per_token

    dc, dr = layers[0].kv_lora_rank, layers[0].rope_dim
    body = body_bytes_per_token(chosen, dc, dr)
    console.print(f"cache: {body:g} B/token/layer quantized (BF16 {2 * (dc + dr)}); with sink {chosen.sink} + recent "
                  f"{chosen.recent} in BF16: {100 * fraction_at(body, 2 * (dc + dr), chosen, args.context):.2f} % "
                  f"of BF16 at {args.context} tokens", soft_wrap=True)
    console.print("servable by `quantmla serve` (paged cache, its writers, decode kernel): "
                  + ("yes" if not unservable else f"no: {', '.join(unservable)}")
                  + (f"; by the vLLM plugin: no, token-axis {', '.join(token)} (calibrate without --token-axis "
                     "for vLLM); on the GPU the decode kernel serves token-axis formats only on the RoPE path "
                     "at <= 16 heads" if token else ""), soft_wrap=True)
    if args.streaming:
        out = result.out_dir
        console.print(f"peak resident weights {result.peak_weight_bytes / 2**20:.1f} MiB of "
                      f"{result.checkpoint_bytes / 2**20:.1f} MiB in the checkpoint")
    else:
        out = save_calibrated(model, out_dir, cfg, calibration, reports, model_dir, dtype)
    console.print(f"wrote calibrated checkpoint to {out} (weights in {str(dtype).replace('torch.', '')})")
    if (mm := multimodal(model_dir)) is not None:
        console.print(f"note: {model_dir} is a multimodal {mm.config.model_type} checkpoint; {out} holds its "
                      f"{mm.text.model_type} language model alone, a text-only checkpoint "
                      f"({mm.text.architectures[0]}, no vision tower)", soft_wrap=True)


# ---------------------------------------------------------------- eval
def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. 512,1024, got {text!r}") from None


def cmd_eval(args) -> None:
    from quantmla.data import read_text, resolve_model_dir, tokenizer_for
    from quantmla.eval.methods import METHODS, MethodArgs
    from quantmla.eval.suite import EvalSettings, evaluate
    from quantmla.models import load_model

    # Check everything the user typed before the (slow) model load.
    args.json = _check_out_file(args.json, "--json")
    from quantmla.calibrate.export import quantmla_section

    calibrated = quantmla_section(resolve_model_dir(args.model)) is not None
    if args.method is None:
        args.method = "quantmla" if calibrated else "bf16"
    if args.method not in METHODS:
        raise ValueError(f"unknown method {args.method!r}; known methods: {', '.join(METHODS)}")
    if calibrated and args.method not in ("quantmla", "bf16"):
        console.print(f"note: {args.model} is calibrated: {args.method} runs on its folded weights, transforms "
                      "included; for the baseline on the original weights, evaluate the original checkpoint",
                      soft_wrap=True)
    method_args = MethodArgs(args.content, args.rope, args.sink, args.recent)
    lengths = _int_list(args.lengths, "--lengths")
    scored = args.scored if args.scored is not None else min(256, max(lengths, default=512) // 2)  # short: half
    settings = EvalSettings(tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
                            lengths=lengths, samples=args.samples, scored=scored, seed=args.seed, batch=args.batch,
                            windows=args.windows)
    if args.data:
        read_text(args.data)  # a missing or empty file, before the (slow) model load
    check_device(args.device)
    model_dir = resolve_model_dir(args.model)
    model = load_model(model_dir, attn=args.attn).to(args.device)
    console.print(f"model: {model_dir}; method {args.method}; tasks {','.join(settings.tasks)}; "
                  f"lengths {','.join(map(str, settings.lengths))}; {settings.samples} samples")
    r = evaluate(model, tokenizer_for(model_dir), args.method, method_args, settings, text_path=args.data)
    d = r.to_dict()

    console.print(result_table(model_dir.name, r))
    if r.niah:
        title = "Needle retrieval, % exact (greedy answer)"
        needles = Table(title=title, box=box.SIMPLE_HEAD, min_width=len(title))  # a narrow table wrapped its title
        needles.add_column("task")
        for length in settings.lengths:
            needles.add_column(str(length), justify="right")
        for task, by_length in r.niah.items():
            needles.add_row(task, *(f"{100 * by_length[n]:.0f}%" for n in settings.lengths))
        console.print(needles)
    console.print(f"took {r.seconds:.1f} s")
    _write_json(args.json, {"model": str(model_dir), **d})


def result_table(name: str, r) -> Table:
    """`eval`'s result as field / value rows: readable at 80 columns whatever the formats' names."""
    from quantmla.eval.suite import LONG_CONTEXT

    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    table = Table(title=f"{name}: method {r.method}", box=box.SIMPLE_HEAD)
    table.add_column("")
    table.add_column("value", overflow="fold")
    for field, value in (
            ("content / rope", f"{r.content} / {r.rope}"), ("BF16 sink + recent", f"{r.sink} + {r.recent} tokens"),
            (f"bytes/token/layer @{r.bytes_length}", f"{r.bytes_per_token:.1f} "
             f"({100 * r.bytes_per_token / r.bytes_per_token_bf16:.1f} % of BF16)"),
            (f"bytes/token/layer @{LONG_CONTEXT // 1024}K", f"{r.bytes_per_token_long:.1f} "
             f"({100 * r.bytes_per_token_long / r.bytes_per_token_bf16:.2f} % of BF16)"),
            ("one quantized token", f"{r.bytes_per_token_body:g} B/layer"),
            ("perplexity / BF16's", f"{num(r.ppl, '.4f')} / {num(r.ppl_bf16, '.4f')}"),
            ("KL to BF16 (nats/token)", num(r.kl, ".3e"))):
        table.add_row(field, value)
    return table


def cmd_lm_eval(args) -> None:
    import quantmla.eval.lm_eval_bridge  # noqa: F401  (registers the lm-eval model "quantmla")
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args.lm_eval_args]
    cli_evaluate()


# ---------------------------------------------------------------- demo


def demo_table(name: str, rows, lengths) -> Table:
    """The demo's comparison, readable at 80 columns: bytes per token and layer as measured at the evaluated
    length and at 128 K (both measured from the cache, protected and staged tokens included), KL,
    perplexity, and needle accuracy as single/multikey/multivalue at the one length; at several lengths the
    needles go in `demo_needles_table` (a column per length does not fit 80 columns: rich cut the cells)."""
    needles = lengths if len(lengths) == 1 else ()
    table = Table(title=f"{name}: cache methods (held-out KL/ppl{'; needles s/mk/mv %' if needles else ''})",
                  box=box.SIMPLE_HEAD)
    for col in ("method", "B/tok", "%BF16", "@128K", "KL", "ppl", *(f"needles {n}" for n in needles)):
        table.add_column(col, justify="left" if col == "method" else "right")
    for label, r in rows:
        bf16 = r.bytes_per_token_bf16
        table.add_row(label, f"{r.bytes_per_token:.0f}", f"{100 * r.bytes_per_token / bf16:.1f}",
                      f"{100 * r.bytes_per_token_long / bf16:.1f}",
                      f"{r.kl:.2e}", f"{r.ppl:.3f}", *(_needles(r, n) for n in needles))
    return table


def _needles(r, length: int) -> str:
    return "/".join(f"{100 * r.niah[t][length]:.0f}" for t in ("single", "multikey", "multivalue"))


def demo_needles_table(name: str, rows, lengths) -> Table:
    """The demo's needle accuracy (single/multikey/multivalue %) at each of several lengths, a column each."""
    table = Table(title=f"{name}: needles s/mk/mv %", box=box.SIMPLE_HEAD)
    for col in ("method", *map(str, lengths)):
        table.add_column(col, justify="left" if col == "method" else "right")
    for label, r in rows:
        table.add_row(label, *(_needles(r, n) for n in lengths))
    return table


def cmd_demo(args) -> None:
    from quantmla.data import resolve_model_dir
    from quantmla.demo import DemoSettings, run_demo
    from quantmla.models.adapters import check_unquantized
    from quantmla.eval.suite import EvalSettings

    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory")
    _check_out_file(str(out / "demo.json"), "--out")  # a file further up, or no write permission: before any work
    lengths = _int_list(args.lengths, "--lengths")
    # The demo has no --scored/--sink/--recent: say what its fixed 128 scored and 4 + 128 BF16 tokens need here,
    # before the BF16 row (the evaluation's own errors name flags the demo lacks, and come after that row).
    floor = max(DemoSettings.sink + DemoSettings.recent, 128)
    if lengths and max(lengths) <= floor:
        raise ValueError(f"--lengths {args.lengths}: the demo keeps sink {DemoSettings.sink} + recent "
                         f"{DemoSettings.recent} tokens in BF16 and scores the last 128 of each window; use a length "
                         f"above {floor}")
    model_dir = resolve_model_dir(args.model)
    check_unquantized(model_dir)  # the demo writes calibrated checkpoints
    settings = DemoSettings(calib_steps=args.steps,
                            eval=EvalSettings(lengths=lengths, samples=args.samples,
                                              windows=args.windows, scored=128, batch=8))
    console.rule(f"quantmla demo on {model_dir.name}")
    rows = run_demo(model_dir, out, settings, log=lambda m: console.print(f"[bold]>[/] {m}"))
    console.print(demo_table(model_dir.name, rows, settings.eval.lengths))
    if len(settings.eval.lengths) > 1:
        console.print(demo_needles_table(model_dir.name, rows, settings.eval.lengths))
    _write_json(str(out / "demo.json"),
                {"model": str(model_dir), "rows": [{"label": label, **r.to_dict()} for label, r in rows]})


# ---------------------------------------------------------------- serve
def cmd_serve(args) -> None:
    try:
        from quantmla.engine.server import serve
    except ImportError as e:
        raise ValueError(f"quantmla serve needs the serve extra ({e}): pip install -e '.[serve]'") from None
    from quantmla.engine import LLM

    if args.device is not None:
        check_device(args.device)
    check_can_listen(args.host, args.port)
    llm = LLM(args.model, content=args.content, rope=args.rope, sink=args.sink, recent=args.recent,
              device=args.device, kv_cache_bytes=args.kv_cache_bytes,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len)
    if llm.tokenizer is None:
        raise ValueError(f"{args.model or 'the model'} has no tokenizer (tokenizer.json / tokenizer_config.json "
                         "beside its weights): the server needs one to turn text into tokens")
    s = llm.stats()
    console.print(f"KV pool: {s['pages_total']} pages = {s['capacity_tokens']} tokens ({s['format']}, "
                  f"{s['kv_cache_bytes'] / 2**20:.1f} MiB), up to {args.max_num_seqs} sequences of at most "
                  f"{llm.max_model_len} tokens, on {llm.model.device} (decode kernel: {s['decode_kernel']})",
                  soft_wrap=True)
    # By default a request may name the model by its folder or, as vLLM names it, by the path it was started with.
    names = args.served_model_name or [llm.model_name, *([args.model] if args.model else [])]
    names = tuple(dict.fromkeys(names))
    console.print(f"serving {' or '.join(names)} at http://{args.host}:{args.port}/v1 (OpenAI API; also "
                  f"/health, /metrics)", soft_wrap=True)
    serve(llm, args.host, args.port, model_names=names)


def check_device(name: str) -> None:
    """A torch device this machine has, or ValueError naming what is wrong."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch has no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def byte_count(text: str) -> int:
    """--kv-cache-bytes: a positive number of bytes, '8e9' or '8000000000'."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of bytes, got {text!r}")
    return int(value)


def port_number(text: str) -> int:
    """--port: 1-65535. Past 65535 uvicorn listened on the port modulo 65536 while the log named the one asked
    for; a negative one failed only after the model had loaded."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1-65535, got {text!r}")
    return value


def check_can_listen(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (a port in use, a host that does not resolve) before the
    model loads, not minutes later. uvicorn binds again afterwards (with SO_REUSEADDR, as here)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


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
    s.add_argument("--content", help="content format: bf16, fp8, int8, int4, int2 [:group] (default: a calibrated "
                                      "checkpoint's own formats, else int4)")
    s.add_argument("--rope", help="RoPE format, same spelling (default: the checkpoint's, else int4)")
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
    s.add_argument("--length", type=_positive, default=512, help="tokens per sequence (default 512)")
    s.add_argument("--samples", type=_positive, default=4, help="number of sequences (default 4)")
    # the policy that says where noise goes; its error for too short sequences suggests a smaller window
    s.add_argument("--sink", type=_tokens, default=4, help="first tokens kept noise-free, as BF16 (default 4)")
    s.add_argument("--recent", type=_tokens, default=128, help="most recent tokens kept noise-free (default 128)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", help="write the results as JSON here")
    s.add_argument("--plot", help="write a per-layer plot (PNG) here")
    s.set_defaults(func=cmd_analyze)
    s = sub.add_parser("calibrate", help="learn both path transforms and write a fused checkpoint",
                       description="Calibrate the content transform (rotation + channel scale, on attention-output "
                                   "reconstruction) and the RoPE transform (per-pair rotation + scale, on "
                                   "positional QK reconstruction) layer by layer, fold both into the weights and "
                                   "write a checkpoint that plain transformers loads; its config.json gets a "
                                   "quantmla section that configures quantmla's cache. Per path and layer the "
                                   "search also chooses the quantizer: RTN (identity), SmoothQuant and the fitted "
                                   "transform, each with every clipping ratio of --clips, with channel groups and "
                                   "with --token-axis KIVI-style token groups, scored on held-out "
                                   "selection sequences; the chosen formats go into the section per layer. Every "
                                   "point is servable by `quantmla serve`; the vLLM plugin serves channel "
                                   "groups only.")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--content", default="int4", help="content format (default int4)")
    s.add_argument("--rope", default="int4", help="RoPE format (default int4)")
    s.add_argument("--group", type=_positive, help="channels per scale group for integer formats without their own")
    s.add_argument("--sink", type=_tokens, default=4, help="first tokens kept in BF16 (default 4)")
    s.add_argument("--recent", type=_tokens, default=128, help="most recent tokens kept in BF16 (default 128)")
    s.add_argument("--data", help="calibration text file (default: the built-in calibration sample)")
    s.add_argument("--samples", type=_positive, default=8,
                   help="calibration sequences, >= 3: fit/select/report (default 8)")
    s.add_argument("--length", type=_positive, default=None,
                   help="tokens per sequence (default 2048, or the model's max_position_embeddings if shorter; "
                        "longer sequences show the search more quantized keys per query, as long contexts do)")
    s.add_argument("--steps", type=_positive, default=100, help="optimiser steps per path and layer (default 100)")
    s.add_argument("--clips", default=",".join(map(str, CLIPS)),
                   help="clipping ratios the search tries per path and layer, chosen on the real objective of "
                        f"the selection sequences (default {','.join(map(str, CLIPS))}; 1 = no clipping). "
                        "Servable: `quantmla serve` writes clipped formats byte for byte")
    s.add_argument("--token-axis", action=argparse.BooleanOptionalAction, default=False,
                   help="also try KIVI-style token-axis groups (int4:t64, at no more bytes) per path and layer. "
                        "Off by default: `quantmla serve` serves them, but its GPU decode kernel reads them at "
                        "0.13-0.59x the speed of BF16 (channel formats: 0.68-1.48x); the vLLM plugin not at all")
    s.add_argument("--ranked", action=argparse.BooleanOptionalAction, default=True,
                   help="also try, on the content path, ranked formats of no more bytes (e.g. int8r128 for int2: "
                        "the principal axes' leading channels at more bits, the rest dropped). Served by "
                        "`quantmla serve` and the vLLM plugin like any channel format")
    s.add_argument("--budget", type=float,
                   help="cache size as a fraction of BF16's at --context tokens, e.g. 0.27: choose bits and group "
                        "size per path and layer (bf16, int8/int4/int2 channel groups, ranked content formats unless "
                        "--no-ranked) to fit it, "
                        "by RTN attention-output error, then calibrate for the chosen formats (--content/--rope "
                        "then only name the section's base formats)")
    s.add_argument("--context", type=_positive, default=131072,
                   help="context length at which --budget is counted (default 131072; the sink + recent window "
                        "counts as BF16)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weight dtype of the written checkpoint (default: the source's)")
    s.add_argument("--streaming", action="store_true",
                   help="for checkpoints larger than memory: hold one decoder layer's weights at a time, read "
                        "from the safetensors shards and written to the output's shards as soon as folded")
    s.add_argument("--out", required=True,
                   help="output directory: new or empty (never the model's own), unless --overwrite")
    s.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out, replacing the checkpoint files there (never the model's "
                        "own directory)")
    s.set_defaults(func=cmd_calibrate)
    s = sub.add_parser("eval", help="quality of a cache method: perplexity, KL to BF16, needle retrieval",
                       description="Evaluate one KV-cache method: perplexity and next-token KL to BF16 on held-out "
                                   "text, and RULER-style needle retrieval (single, multikey, multivalue) at each "
                                   "length, exact match of the greedy answer (teacher-forced: the argmax at every "
                                   "answer token); the same seeds for every method. Both see the cache as a server "
                                   "does: every query attends to the sink and its own last --recent keys in BF16 and "
                                   "to every other key as the cache stores it, in prefill as in decode. Cache bytes "
                                   "per token are measured from the cache at the longest length.")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--method", default=None,
                   help="bf16; fp8 (whole row e4m3, one scale); fp8-content (FlashMLA: content e4m3 per 128, RoPE "
                        "BF16); rtn / rtn-content (round-to-nearest, RoPE BF16 for the latter); fp4 (e2m1, block "
                        "scales); turboquant (rotation + 3-bit codebook latent, RoPE BF16); kivi (per-channel, "
                        "token groups); quarot (Hadamard; online on RoPE); smoothquant (channel scaling); quantmla "
                        "(calibrates first unless MODEL is a calibrated checkpoint). Default: quantmla for a "
                        "calibrated checkpoint, else bf16")
    s.add_argument("--content", help="content format: bf16, fp8, int8, int4, int2 [:group] (default int4), for rtn, "
                                     "rtn-content, kivi (as token groups), quarot, smoothquant and quantmla; fp4 and "
                                     "turboquant take only their own kinds, bf16/fp8/fp8-content none")
    s.add_argument("--rope", help="RoPE format, same spelling (default int4; rtn-content and turboquant keep RoPE in "
                                  "BF16)")
    s.add_argument("--sink", type=_tokens, help="first tokens kept in BF16 (default: 0 for bf16, fp8 and "
                                                "fp8-content; a calibrated checkpoint's own; else 4)")
    s.add_argument("--recent", type=_tokens, help="most recent tokens kept in BF16 (default: 0 for bf16, fp8 and "
                                                  "fp8-content; a calibrated checkpoint's own; else 128)")
    s.add_argument("--tasks", default="ppl,kl,niah", help="comma-separated subset of ppl,kl,niah (default all)")
    s.add_argument("--lengths", default="512,1024,2048",
                   help="needle lengths (bytes of prompt + answer: tokens of the byte-level default model); "
                        "ppl/kl windows are as many tokens as the longest (default 512,1024,2048)")
    s.add_argument("--samples", type=int, default=8,
                   help="needle samples per task and length, and ppl/kl windows unless --windows (default 8)")
    s.add_argument("--windows", type=int, default=None,
                   help="held-out ppl/kl windows (default: --samples); a mean KL over few tokens is carried by "
                        "the few whose prediction flips, so it wants more tokens than the needles want samples")
    s.add_argument("--scored", type=int, default=None,
                   help="scored tokens at the end of each ppl/kl window (default 256, or half a shorter window)")
    s.add_argument("--batch", type=int, default=8, help="sequences per forward (default 8)")
    s.add_argument("--data", help="held-out text file for ppl/kl and needle filler (default: the shipped heldout.txt)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="cpu", help="torch device to run the model on, e.g. cuda (default cpu)")
    s.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                   help="attention implementation of the BF16 reference forward (the method under test "
                        "always runs quantmla's serving attention): sdpa (default) never holds the [batch, heads, "
                        "L, L] scores that eager does (69 GB in fp32 for 8 windows of 16 K tokens)")
    s.add_argument("--json", help="write the results as JSON here")
    s.set_defaults(func=cmd_eval)
    s = sub.add_parser("lm-eval", help="lm-evaluation-harness with a quantized cache (model 'quantmla')",
                       description="lm-eval's own command line, with the model 'quantmla' registered: lm-eval's "
                                   "Hugging Face model whose every token attends as on a server (the sink and the "
                                   "last recent tokens in BF16, older ones as the cache stores them). Example: "
                                   "quantmla lm-eval run --model quantmla --device cpu "
                                   "--tasks TASKS --model_args pretrained=DIR,method=rtn,content=int4,rope=int4. "
                                   "Needs the eval extra (pip install -e '.[eval]').")
    s.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval (e.g. run --model ...)")
    s.set_defaults(func=cmd_lm_eval)
    s = sub.add_parser("demo", help="the main job in one go: calibrate, then compare BF16 / RTN / quantmla",
                       description="On MODEL (default: the shipped model): calibrate quantmla for INT4/INT4 and "
                                   "INT2/INT4, write the fused checkpoints under --out, and compare a BF16 cache, "
                                   "round-to-nearest and quantmla on KL, perplexity and needle retrieval. Sized "
                                   "for a few minutes on a CPU; `quantmla eval` measures the same things at "
                                   "any size.")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--out", default="runs/demo", help="where the calibrated checkpoints go (default runs/demo)")
    s.add_argument("--lengths", default="512", help="needle lengths; ppl/kl windows use the longest (default 512)")
    s.add_argument("--samples", type=_positive, default=16, help="needle samples per cell (default 16)")
    s.add_argument("--windows", type=_positive, default=64,
                   help="held-out windows for KL and perplexity, the last 128 tokens of each scored (default 64)")
    s.add_argument("--steps", type=_positive, default=40, help="calibration steps per path and layer (default 40)")
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the paged quantized cache",
                       description="Serve MODEL over HTTP with quantmla's engine (continuous batching over a paged "
                                   "KV pool in the chosen formats): POST /v1/completions and "
                                   "/v1/chat/completions (streaming with \"stream\": true), GET /v1/models, "
                                   "/health and /metrics (Prometheus). One model, n=1. Needs the serve extra "
                                   "(pip install -e '.[serve]').")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--content", help="content format: bf16, fp8, int8, int4, int2 [:group], or token-axis (KIVI-style) "
                                     "int8/int4/int2:tTOKENS, e.g. int4:t64 (TOKENS dividing the 64-token page) "
                                     "(default: a calibrated checkpoint's own, else int4)")
    s.add_argument("--rope", help="RoPE format, same spelling (default: a calibrated checkpoint's own, else int4)")
    s.add_argument("--sink", type=_tokens, help="first tokens kept in BF16 (default: the checkpoint's, else 4)")
    s.add_argument("--recent", type=_tokens,
                   help="most recent tokens kept in BF16 (default: the checkpoint's, else 128)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    s.add_argument("--device", help="torch device, e.g. cuda or cpu (default: cuda if available, else cpu)")
    s.add_argument("--kv-cache-bytes", type=byte_count,
                   help="byte budget of the KV pool, all layers, e.g. 8e9 (default: on CUDA "
                        "--gpu-memory-utilization of the card; on the CPU room for --max-num-seqs sequences of "
                        "--max-model-len tokens)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the model and pool may use when --kv-cache-bytes is not given "
                        "(default 0.9)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most (default 64)")
    s.add_argument("--max-model-len", type=int,
                   help="prompt + output tokens of one request at most (default: the model's max_position_embeddings)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names a request's \"model\" may give; the first is the one responses and /v1/models "
                        "report (default: the checkpoint folder's name, and MODEL as given)")
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # bad input: no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
