"""Measured cache bytes per token and layer of every row of an eval_methods results JSON, at other lengths.

An eval_methods.py run measures each row's bytes at its longest length and at 128 K only. The bytes do not
depend on the model's values, only on the row's cache config (formats per path and layer, sink + recent,
which the JSON stores in each row's settings["cache"]), so they can be measured at any length afterwards on
the CPU, with the same function the evaluation uses (`quantmla.eval.suite.measure_bytes_per_token`:
`QuantMLACache.memory_bytes()` after N BF16 tokens, sink + body + staging + recent; per layer, the mean over
layers) and without calibrating again.

    python benchmarks/bytes_at_lengths.py benchmarks/results/accuracy_16k_500_stage3.json
    python benchmarks/bytes_at_lengths.py RESULTS.json --lengths 2048,8192,16384,131072 --out /tmp/x

Writes OUT.json (every row: bytes per token at each length, mean over layers and per layer) and OUT.md
(default OUT: benchmarks/results/bytes_at_lengths_<stem of the results JSON>). It checks that it reproduces
the JSON's own figures (bytes_per_token at the run's longest length, bytes_per_token_long at 131072) exactly;
where a row does not, its check column says so and the script exits 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from quantmla.config import CacheConfig
from quantmla.data import resolve_model_dir
from quantmla.eval.suite import LONG_CONTEXT, measure_bytes_per_token

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def model_dims(model: str) -> tuple[int, int]:
    """(kv_lora_rank, rope dim) from the model's config.json (the results JSON's "model", relative to the
    repository root where it is not absolute)."""
    path = Path(model)
    path = resolve_model_dir(path if path.is_absolute() else ROOT / path)
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])


def row_bytes(cache: dict, dc: int, dr: int, lengths: list[int]) -> dict:
    """Per length: bytes per token and layer (mean over layers, as the evaluation reports it) and per layer."""
    config = CacheConfig.from_dict(cache)
    out = {}
    for n in lengths:
        per_layer = [measure_bytes_per_token(CacheConfig(c, r, config.sink, config.recent, config.rope_rotation),
                                             dc, dr, n) for c, r in config.per_layer]
        out[str(n)] = {"mean": sum(per_layer) / len(per_layer), "per_layer": per_layer}  # as the evaluation
    return out


def markdown(data: dict) -> str:
    lengths = data["lengths"]
    lines = [f"# Measured cache bytes per token and layer, rows of `{data['source']}`", "",
             f"Command: `{data['command']}` ({data['date_utc']}). Model dims: kv_lora_rank {data['kv_lora_rank']}, "
             f"rope {data['rope_dim']}.", "",
             "Each row's cache config (formats per path and layer, sink + recent) as stored in the results JSON, "
             "measured with `quantmla.eval.suite.measure_bytes_per_token` (the evaluation's own function: "
             "`QuantMLACache.memory_bytes()` after N BF16 tokens, sink + body + staging + recent, divided by N; "
             "mean over layers). No calibration: the formats are the ones the run chose. Check: the JSON's own "
             f"figures (at {data['bytes_length']} and at {LONG_CONTEXT} tokens) are reproduced "
             f"{'exactly for every row' if data['check_ok'] else 'NOT for every row (see check column)'}.", "",
             "| # | method | content | rope | sink+recent | " + " | ".join(f"B/token @{n}" for n in lengths)
             + f" | per layer @{lengths[0]} (layer 0 / 1 / ...) | check |",
             "| ---: | --- | --- | --- | --- |" + " ---: |" * len(lengths) + " --- | --- |"]
    for i, r in enumerate(data["rows"]):
        cells = " | ".join(f"{r['bytes'][str(n)]['mean']:.1f}" for n in lengths)
        per_layer = r["bytes"][str(lengths[0])]["per_layer"]
        layers = (f"{per_layer[0]:.1f} (every layer)" if len(per_layer) == 1
                  else " / ".join(f"{b:.1f}" for b in per_layer))
        lines.append(f"| {i} | {r['method']} | {r['content'].replace('|', chr(92) + '|')} | "
                     f"{r['rope'].replace('|', chr(92) + '|')} | {r['sink']}+{r['recent']} | {cells} | {layers} | "
                     f"{'ok' if r['check_ok'] else 'MISMATCH'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="an eval_methods.py results JSON")
    ap.add_argument("--lengths", default="2048,8192,16384,131072", help="token counts (comma-separated)")
    ap.add_argument("--out", help="output path without extension (default benchmarks/results/bytes_at_lengths_STEM)")
    args = ap.parse_args(argv)
    src = Path(args.results)
    data = json.loads(src.read_text())
    dc, dr = model_dims(data["model"])
    lengths = [int(v) for v in args.lengths.split(",")]
    longest = max(r["bytes_length"] for r in data["results"])
    measure = sorted(set(lengths) | {r["bytes_length"] for r in data["results"]} | {LONG_CONTEXT})
    rows, ok = [], True
    for r in data["results"]:
        if r["bytes_per_token_bf16"] != 2 * (dc + dr):
            raise SystemExit(f"{r['method']}: BF16 bytes {r['bytes_per_token_bf16']} != 2 * ({dc} + {dr})")
        got = row_bytes(r["settings"]["cache"], dc, dr, measure)
        check = (got[str(r["bytes_length"])]["mean"] == r["bytes_per_token"]
                 and got[str(LONG_CONTEXT)]["mean"] == r.get("bytes_per_token_long"))
        ok &= check
        rows.append({"method": r["method"], "content": r["content"], "rope": r["rope"], "sink": r["sink"],
                     "recent": r["recent"], "cache": r["settings"]["cache"],
                     "json_bytes_per_token": r["bytes_per_token"], "json_bytes_length": r["bytes_length"],
                     "json_bytes_per_token_long": r.get("bytes_per_token_long"), "check_ok": check,
                     "bytes": {str(n): got[str(n)] for n in lengths}})
        print(f"{r['method']:18s} {r['sink']}+{r['recent']:<4d} " + "  ".join(
            f"{n}: {got[str(n)]['mean']:.4f}" for n in lengths) + f"  check {'ok' if check else 'MISMATCH'}",
            flush=True)
    try:
        shown = src.resolve().relative_to(ROOT)
    except ValueError:
        shown = src
    out = Path(args.out) if args.out else RESULTS / f"bytes_at_lengths_{src.stem}"
    meta = {"source": str(shown), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/bytes_at_lengths.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "kv_lora_rank": dc, "rope_dim": dr, "lengths": lengths, "bytes_length": longest,
            "check_ok": ok, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(meta, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(meta))
    if not ok:
        print("some rows do not reproduce the results JSON's own bytes (see check)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
