"""Each path's calibration objective, identity transform vs calibrated, per layer, on the report sequences
(neither fit nor selected the transform) with real quantization and the serving policy (sink 4 and recent
128 BF16) — what `quantmla calibrate` prints, kept as a results file.

    python benchmarks/calibration_objectives.py [--content int4 --rope int4] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
from pathlib import Path

from quantmla.calibrate.export import quantmla_section
from quantmla.calibrate.search import Splits
from quantmla.cli import main as quantmla
from quantmla.config import CacheConfig
from quantmla.policy import query_positions

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--content", default="int4")
    p.add_argument("--rope", default="int4")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if quantmla(["calibrate", "--content", a.content, "--rope", a.rope, "--out", tmp]):
            raise SystemExit(1)
        reports = json.loads((Path(tmp) / "calibration_report.json").read_text())
        section = quantmla_section(tmp)
    settings, cfg = section["calibration"], CacheConfig.from_dict(section)
    n, length = settings["samples"], settings["length"]
    splits, pos = Splits.of(n), query_positions(length, cfg, 1 << 30)
    count = lambda s: len(range(n)[s])  # noqa: E731
    name = f"calibration_objectives_{a.content}_{a.rope}".replace(":", "g")
    lines = [
        f"Calibration objectives of the default model, content {a.content}, RoPE {a.rope} (defaults of "
        f"`quantmla calibrate`: {n} x {length} tokens of the built-in calibration text, {count(splits.fit)} fit, "
        f"{count(splits.select)} select, {count(splits.report)} report, {settings['steps']} steps per path; "
        f"queries at positions {int(pos[0])}-{int(pos[-1])}, each seeing the keys in [{cfg.sink}, t - "
        f"{cfg.recent - 1}) quantized). "
        "Identity: RTN at the requested format; calibrated: the point the search chose on the select "
        "sequences (content may be a ranked format of no more bytes), both scored on the report sequences. "
        "Content and RoPE: attention-output NMSE with that path quantized (the RoPE fit itself runs on the "
        "positional QK error; results before 2026-12-02 judged RoPE on that QK error). Real quantization, on the "
        f"{count(splits.report)} report sequences. Command: `python benchmarks/calibration_objectives.py --content "
        f"{a.content} --rope {a.rope}` ({datetime.date.today()}, CPU {platform.machine()}).",
        "",
        "| layer | content: identity | content: calibrated | gain | RoPE: identity | RoPE: calibrated | gain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        cells = []
        for path in ("content", "rope"):
            ident, best = r[f"{path}_identity"], r[f"{path}_best"]
            cells += ["-", "-", "-"] if ident is None else [f"{ident:.3e}", f"{best:.3e}", f"{ident / best:.2f}x"]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + " |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(reports, indent=1) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
