"""Every cache method on one model (default: the shipped default model): bytes per token, perplexity, KL to
BF16 and needle retrieval, with the same windows, seeds and needle samples for every method.

Writes benchmarks/results/eval_methods.json (every number, the settings, the command) and eval_methods.md
(the tables pasted into README's "Quality" section).

    python benchmarks/eval_methods.py                        # all methods, defaults below
    python benchmarks/eval_methods.py --methods bf16,rtn --samples 2 --lengths 512 --out /tmp/x
    python benchmarks/eval_methods.py --device cuda --lengths 512,1024,2048 --samples 200 --scored 512 \
        --batch 100                                          # the committed 2 K results (older protocol)
    python benchmarks/eval_methods.py --methods rtn@int4/int4,quantmla@budget=0.2823 --samples 2 --lengths 512 \
        --out /tmp/y                                         # formats chosen per layer for 28.23 % of BF16 at 128 K
    python benchmarks/eval_methods.py --merge /tmp/a.json /tmp/b.json --out benchmarks/results/x
                                                             # one table from parts run in separate calls

Every method runs through the serving forward (`quantmla.eval.serving`): ppl/KL one forward per batch of
windows, needles one teacher-forced forward per batch of samples (see `quantmla.eval.suite`). Parts (one
--methods subset and --out each, the other settings the same) merge with --merge, rows in the order given;
the BF16 quality table comes from the part that has the bf16 row.

The defaults are sized for a CPU: 4 samples per cell at 512 and 2048 tokens, 71 s (BF16) to 90 s (RTN
INT4/INT4) per method on this project's busy 2-core machine (273 s for BF16 before the serving scorer).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from quantmla.config import QuantFormat
from quantmla.data import resolve_model_dir, tokenizer_for
from quantmla.eval.baselines import KIVI_TOKENS, RECENT, SINK
from quantmla.eval.methods import METHODS, MethodArgs, check_method
from quantmla.eval.suite import EvalSettings, evaluate, paired_changes
from quantmla.models import load_model

RESULTS = Path(__file__).resolve().parent / "results"

# The accuracy table of issues 4 and 10: every method at INT4/INT4, then INT2/INT4, then content-only INT4;
# with --equal-bytes (on for this preset) a quantmla row at no more than KIVI's measured bytes follows each kivi
# row (equal if the search keeps the requested formats, fewer where it picks a smaller one, e.g. a ranked format).
# quantmla's search has ranked content formats besides channel groups; quantmla-c is the search without them.
ACCURACY = (
    "bf16,fp8,fp8-content,rtn@int4/int4,fp4,turboquant,kivi@int4/int4,quarot@int4/int4,smoothquant@int4/int4,"
    "quantmla-c@int4/int4,quantmla@int4/int4,"
    "rtn@int2/int4,kivi@int2/int4,quarot@int2/int4,smoothquant@int2/int4,quantmla-c@int2/int4,quantmla@int2/int4,"
    "rtn-content@int4/bf16,kivi@int4/bf16,quarot@int4/bf16,smoothquant@int4/bf16,quantmla@int4/bf16"
)


def parse_rows(text: str) -> list[tuple[str, MethodArgs]]:
    """'method', 'method@CONTENT/ROPE' or 'method@budget=F' (quantmla: formats chosen per path and
    layer to fit F of BF16's bytes at 128 K tokens), each optionally followed by '+rRECENT' (a BF16 window of
    RECENT tokens), comma-separated. A bad spec exits with its message before any model is loaded."""
    rows = []
    for spec in (r.strip() for r in text.split(",") if r.strip()):
        head, _, recent = spec.partition("+r")
        method, _, formats = head.partition("@")
        budget = formats.removeprefix("budget=") if formats.startswith("budget=") else None
        content, _, rope = ("" if budget is not None else formats).partition("/")
        try:
            args = MethodArgs(content or None, rope or None, recent=int(recent) if recent else None,
                              budget=None if budget is None else float(budget))
            check_method(method, args)
        except ValueError as e:
            raise SystemExit(f"--methods {spec!r}: {e}") from None
        rows.append((method, args))
    return rows


def staged_tokens(length: int, block: int, sink: int = SINK, recent: int = RECENT) -> int:
    """Tokens a token-axis cache of `length` tokens holds in BF16 staging: left the window, block not full."""
    return max(length - sink - recent, 0) % block


def _channel_twin(spec: str | None) -> str:
    """The channel-grouped format of the same kind as a kivi path's format (kivi's default: int4:t64)."""
    fmt = QuantFormat.parse(spec or "int4")
    return str(fmt) if fmt.axis == "channel" else fmt.kind


def equal_bytes_rows(rows: list[tuple[str, MethodArgs]], length: int) -> list[tuple[str, MethodArgs]]:
    """rows plus, after each kivi row, quantmla at the channel-grouped twin of its formats with the BF16
    window widened by KIVI's staged tokens at `length`. The widening is counted with the *requested* formats:
    at those formats the row holds KIVI's measured bytes at `length` (staging holds those tokens in BF16 on
    both paths, or on the one token-axis path while the other is bf16 anyway), and with blocks of 64 the
    staging is the same at 2048 and at 131072 tokens, so at 128 K too. quantmla's search then only picks
    formats of no more bytes per token (clipping: the same; ranked content formats: fewer), so the row holds
    at most KIVI's measured bytes, fewer where a ranked format was chosen (accuracy_v2_moe: int8r256, 387.1
    B/token at 2048 and 309.2 at 128 K against KIVI's 401.6 and 325.2): compare the rows' measured bytes."""
    out = []
    for method, args in rows:
        out.append((method, args))
        if method == "kivi":
            blocks = [QuantFormat.parse(f).group for f in (args.content, args.rope)
                      if f and QuantFormat.parse(f).axis == "token"]
            extra = staged_tokens(length, min(blocks, default=KIVI_TOKENS))
            if extra:
                out.append(("quantmla", MethodArgs(_channel_twin(args.content), _channel_twin(args.rope),
                                                   recent=RECENT + extra)))
    return out


def protocol(s: dict) -> list[str]:
    """How ppl/KL and needles were measured (results written before the serving scorer carry "chunk")."""
    windows = (f"- ppl / KL: {s['windows'][0]} windows of {s['windows'][1]} held-out tokens "
               "(`quantmla/data/heldout.txt`); ")
    if "chunk" in s:
        return [windows + f"the context is prefilled through the cache under test in one call (every key older "
                f"than the last `recent` quantized for all its queries), then the last {s['scored']} tokens of each "
                f"window are scored in chunks of {s['chunk']} against it. KL is the mean next-token KL(BF16 || "
                "method) in nats on the same tokens.",
                f"- Needles: {s['samples']} samples per task and length (prompt + answer bytes = tokens), filler "
                f"from the held-out text, greedy `generate` with the cache under test (one-call prefill), exact "
                f"match; seed {s['seed']}, the same samples for every method."]
    lines = [windows + "each is one forward under serving semantics (`quantmla.eval.serving`, as the engine's "
             "prefill and decode): every query sees the sink and its own last `recent` keys in BF16 and every "
             "other key as the cache stores it (KIVI's tokens once their block has left the window); the last "
             f"{s['scored']} tokens are scored. KL is the mean next-token KL(BF16 || method) in nats on the same "
             "tokens, against a plain forward of the BF16 model."]
    if "niah" in s.get("tasks", ["niah"]):  # KL-only runs measured no needles
        lines.append(
            f"- Needles: {s['samples']} samples per task and length (prompt + answer bytes = tokens), filler from "
            "the held-out text; a sample is correct iff greedy decoding under the same serving semantics writes the "
            "answer exactly, scored teacher-forced in one forward (the argmax at every answer token; EOS at its "
            f"final newline); seed {s['seed']}, the same samples for every method.")
    return lines


def _cell(text: str) -> str:
    """A table cell: per-layer formats are joined by '|'."""
    return text.replace("|", "\\|")


def markdown(results: list[dict], meta: dict) -> str:
    s = meta["settings"]
    lengths = s["lengths"]
    tasks = list(results[0]["niah"])
    bf16 = next((r for r in results if r["method"] == "bf16"), None)  # needles in BF16 need its row
    first = bf16 or results[0]  # ppl_bf16 (the plain forward that every row's KL is against) is in every row
    lines = [
        f"# Cache methods on `{Path(meta['model']).name}`",
        "",
        f"Model `{meta['model']}`; {meta['date_utc']}; {meta['device']}, {meta['threads']} thread(s), "
        f"{meta['seconds']:.0f} s in all.",
        f"Command: `{meta['command']}`",
        "",
        *protocol(s),
        f"- Bytes per token and layer: measured from the cache's `memory_bytes()` after {lengths[-1]} BF16 "
        "tokens and after 131072 (\"@128K\"), protected (sink + recent) and staged tokens included; \"body\" is "
        "one quantized token by the formula (mean over layers). A quantmla row with a wider BF16 window "
        "(sink+recent) right after a kivi row was widened by KIVI's staged tokens, counted with the requested "
        "formats: it holds at most that kivi row's measured bytes (equal at the requested formats, fewer where "
        "the search chose a smaller one, e.g. a ranked content format): compare the two rows' bytes columns.",
        "",
        "## BF16 quality of the model",
        "",
        f"Perplexity per byte on the scored held-out tokens: **{first['ppl_bf16']:.4f}** "
        f"({s['windows'][0]} x {s['scored']} tokens).",
        "",
    ]
    if bf16 is None or not tasks:
        lines.append("No bf16 row with needles in this run: its needle accuracy is not measured here.")
    else:
        lines += ["| task | " + " | ".join(str(n) for n in lengths) + " |", "| --- |" + " --- |" * len(lengths)]
        for task in tasks:
            lines.append(f"| {task} | " + " | ".join(f"{100 * bf16['niah'][task][str(n)]:.1f} %" for n in lengths)
                         + " |")
    cols = [f"{t} {n}" for t in tasks for n in lengths]
    lines += [
        "",
        "## Methods",
        "",
        "| method | content | rope | sink+recent | bytes/token | % of BF16 | B/token @128K | % @128K | body B/token "
        "| online FLOPs/token | ppl | KL |" + "".join(f" {c} |" for c in cols),
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(cols),
    ]
    for r in results:
        acc = [f"{100 * r['niah'][t][str(n)]:.1f}" for t in tasks for n in lengths]
        lines.append(f"| {r['method']} | {_cell(r['content'])} | {_cell(r['rope'])} | {r['sink']}+{r['recent']} | "
                     f"{r['bytes_per_token']:.1f} | {r['percent_of_bf16']:.1f} | "
                     f"{r.get('bytes_per_token_long', 0):.1f} | {r.get('percent_of_bf16_long', 0):.2f} | "
                     f"{r['bytes_per_token_body']:g} | "
                     f"{r.get('costs', {}).get('online_flops_per_token', 0) or '-'} | "
                     f"{r['ppl']:.4f} | {r['kl']:.2e} |" + "".join(f" {a} |" for a in acc))
    if tasks:
        lines += ["", "Needle columns: accuracy in % per task and length."]
    lines += paired_section(results, bf16, tasks, lengths)
    return "\n".join(lines) + "\n"


def paired_section(results: list[dict], bf16: dict | None, tasks: list[str], lengths: list[int]) -> list[str]:
    """Sample by sample against the bf16 row, for the rows that kept each needle sample's outcome."""
    rows = [r for r in results if r is not bf16 and r.get("niah_samples")]
    if bf16 is None or not bf16.get("niah_samples") or not rows:
        return []
    cols = [f"{t} {n}" for t in tasks for n in lengths]
    lines = ["", "## Needles sample by sample against BF16", "",
             "Per cell: samples BF16 answers and the method does not (-), the reverse (+), and the exact two-sided "
             "McNemar p-value of that split (the chance of one at least this uneven if a change were as likely to "
             "go either way); with p well above 0.05 the split is what chance alone gives.",
             "", "| method | content | rope | " + " | ".join(cols) + " |",
             "| --- | --- | --- |" + " ---: |" * len(cols)]
    for r in rows:
        changes = [paired_changes(bf16["niah_samples"][t][str(n)], r["niah_samples"][t][str(n)])
                   for t in tasks for n in lengths]
        lines.append(f"| {r['method']} | {_cell(r['content'])} | {_cell(r['rope'])} | "
                     + " | ".join(f"-{lost} +{gained} (p {p:.2g})" for lost, gained, p in changes) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated METHOD, METHOD@CONTENT/ROPE or quantmla@budget=F (F of BF16's bytes at "
                         "128 K, formats chosen per layer) (default: every method at its defaults); "
                         "'accuracy' = the issue-4 table: every method at int4/int4, int2/int4, int4/bf16")
    ap.add_argument("--lengths", default="512,2048", help="needle lengths; ppl/kl windows use the longest")
    ap.add_argument("--samples", type=int, default=4, help="needle samples per cell, and ppl/kl windows unless --windows")
    ap.add_argument("--windows", type=int, default=None, help="ppl/kl windows (default: --samples)")
    ap.add_argument("--tasks", default="ppl,kl,niah", help="comma-separated subset of ppl,kl,niah (default all)")
    ap.add_argument("--scored", type=int, default=256, help="scored tokens per ppl/kl window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="attention implementation (sdpa: no [batch, heads, L, L] scores, needed at 16 K)")
    ap.add_argument("--out", default=str(RESULTS / "eval_methods"), help="output path without extension")
    ap.add_argument("--equal-bytes", action=argparse.BooleanOptionalAction, default=None,
                    help="after each kivi row, quantmla with its BF16 window widened by KIVI's staging at the "
                         "longest length: KIVI's measured bytes at the requested formats, fewer where the search "
                         "picks a smaller (ranked) format; default: on for --methods accuracy")
    ap.add_argument("--render", help="only rewrite the .md beside this results JSON (no evaluation)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no evaluation: concatenate the rows of these results JSONs (parts run with the same "
                         "settings, e.g. one --methods subset per GPU call) into --out .json and .md")
    args = ap.parse_args(argv)
    if args.equal_bytes is None:
        args.equal_bytes = args.methods == "accuracy"
    if args.render:
        data = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(data.pop("results"), data))
        return 0
    if args.merge:
        merge([Path(p) for p in args.merge], Path(args.out))
        return 0
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"eval_methods.py --device {args.device} needs a CUDA GPU")
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = parse_rows(ACCURACY if args.methods == "accuracy" else args.methods)
    if args.equal_bytes:
        rows = equal_bytes_rows(rows, max(int(v) for v in args.lengths.split(",")))
    settings = EvalSettings(lengths=tuple(int(v) for v in args.lengths.split(",")), samples=args.samples,
                            scored=args.scored, seed=args.seed, batch=args.batch, windows=args.windows,
                            tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()))
    model_dir = resolve_model_dir(args.model)
    model = load_model(model_dir, attn=args.attn).to(args.device)
    tokenizer = tokenizer_for(model_dir)
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for m, method_args in rows:
        r = evaluate(model, tokenizer, m, method_args, settings).to_dict()
        print(f"{r['method']:12s} {r['content']:>7s}/{r['rope']:<7s} {r['bytes_per_token']:7.1f} B/token "
              f"({r['bytes_per_token_long']:.1f} @128K, sink+recent {r['sink']}+{r['recent']})  ppl "
              f"{r['ppl']:.4f}  kl {r['kl']:.3e}  niah {r['niah']}  ({r['seconds']:.0f} s)", flush=True)
        results.append(r)
        write(out, results, args, argv, model_dir, t0)
    return 0


def _comparable(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in ("cache", "progress", "batch")}


def merge(parts: list[Path], out: Path) -> None:
    """One results JSON (and its .md) from parts measured with the same model and settings, rows in order."""
    data = [json.loads(p.read_text()) for p in parts]
    first = data[0]
    for p, d in zip(parts, data):
        if d["model"] != first["model"] or _comparable(d["settings"]) != _comparable(first["settings"]):
            raise SystemExit(f"{p}: another model or other settings than {parts[0]}; cannot merge")
    meta = {**{k: v for k, v in first.items() if k != "results"},
            "command": " ; ".join(d["command"] for d in data), "seconds": sum(d["seconds"] for d in data),
            "date_utc": max(d["date_utc"] for d in data), "parts": [str(p) for p in parts]}
    results = [r for d in data for r in d["results"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(results, meta))


def write(out: Path, results: list[dict], args, argv, model_dir: Path, t0: float) -> None:
    """Rewritten after every method, so a run cut short still leaves what it measured."""
    meta = {
        "model": str(model_dir.relative_to(Path.cwd()) if model_dir.is_relative_to(Path.cwd()) else model_dir),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/eval_methods.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
        else f"CPU ({platform.machine()})", "threads": torch.get_num_threads(),
        "torch": torch.__version__, "seconds": time.perf_counter() - t0, "settings": results[0]["settings"],
    }
    results = json.loads(json.dumps(results))  # as stored: needle lengths become string keys
    Path(f"{out}.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(results, meta))


if __name__ == "__main__":
    sys.exit(main())
