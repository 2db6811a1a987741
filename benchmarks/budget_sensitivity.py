"""How far the byte budget's old common currency (attention-output NMSE, summed over paths and layers) is from
the model's output error: per (layer, path, candidate format), the RTN NMSE `calibrate.budget.format_errors`
scores and the next-token KL to BF16 with only that path of that layer quantized (RTN, serving semantics,
`eval.serving`), both on the fit + select calibration sequences (16 x 512 tokens of the built-in text, as
benchmarks/budget.py), KL at the positions from sink + 2 recent on (where format_errors draws its queries).
The KL's reference is a plain forward (so it includes a ~2e-8 floor, reported as kl_bf16). Then joint KL
(every path quantized) vs the sum of the single-path KLs, for four fixed format pairs.

    python benchmarks/budget_sensitivity.py MODEL|default OUT.json      (CPU: ~6 min V2-MoE, ~15 min default)

benchmarks/results/budget_sensitivity.{json,md} hold its output for both models with the budget.py rows.
"""
import json, sys, time, math
import torch, torch.nn.functional as F
from quantmla.calibrate.budget import format_errors
from quantmla.calibrate.search import Splits
from quantmla.config import CacheConfig, QuantFormat
from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.eval.serving import serving_logits
from quantmla.eval.suite import heldout_windows
from quantmla.models import describe, load_model
from quantmla.eval import perplexity

torch.set_num_threads(2)
md = resolve_model_dir(sys.argv[1] if sys.argv[1] != "default" else None)
out_path = sys.argv[2]
tok = tokenizer_for(md); model = load_model(md); layers = describe(model)
dc, dr = layers[0].kv_lora_rank, layers[0].rope_dim
calib = token_windows(encode(read_text(None), tok, model.config.vocab_size), 512, 16)
base = CacheConfig("int4", "int4", 4, 128).fit(dc, dr)
t0 = time.perf_counter()
errors = format_errors(model, layers, calib, base)
print("format_errors", time.perf_counter() - t0, flush=True)
sp = Splits.of(calib.shape[0]); ids = calib[sp.fit.start:sp.select.stop]
first = base.sink + 2 * base.recent
rows = torch.arange(first - 1, ids.shape[1] - 1)
with torch.no_grad():
    ref = F.log_softmax(model(ids, use_cache=False).logits[:, rows].float(), -1)
bf = QuantFormat("bf16")
def kl_of(cfg, x=ids, r=ref):
    with torch.no_grad():
        lp = F.log_softmax(serving_logits(model, x, cfg, rows).float(), -1)
    return perplexity.kl(r, lp).mean().item()
def single(l, path, f):
    pairs = [(bf, bf)] * len(layers)
    pairs[l] = (f, bf) if path == "content" else (bf, f)
    from dataclasses import replace
    return replace(base, layers=tuple(pairs))
res = {"model": md.name, "rows": []}
t0 = time.perf_counter()
res["kl_bf16"] = kl_of(single(0, "content", bf))
for (l, path), opts in errors.items():
    for f, e in opts.items():
        if f.kind == "bf16":
            continue
        k = kl_of(single(l, path, f))
        res["rows"].append({"layer": l, "path": path, "format": str(f), "nmse": e, "kl": k})
        print(l, path, f, f"nmse {e:.3e} kl {k:.3e} ratio {k / e:.3e}", flush=True)
print("singles", time.perf_counter() - t0, flush=True)
# additivity: joint KL vs sum of singles
from dataclasses import replace
joint = {}
for name, pairs in [("int4/int4", [(QuantFormat("int4"), QuantFormat("int4"))] * 4),
                    ("int2/int4", [(QuantFormat("int2"), QuantFormat("int4"))] * 4),
                    ("int2/int2", [(QuantFormat("int2"), QuantFormat("int2"))] * 4),
                    ("int4/int2", [(QuantFormat("int4"), QuantFormat("int2"))] * 4)]:
    cfg = replace(base, layers=tuple(pairs)).fit(dc, dr)
    k = kl_of(cfg)
    s = 0.0
    for l, (c, r) in enumerate(cfg.per_layer):
        for path, f in (("content", c), ("rope", r)):
            s += next(x["kl"] for x in res["rows"] if x["layer"] == l and x["path"] == path and x["format"] == str(f))
    joint[name] = {"joint_kl": k, "sum_single_kl": s}
    print(name, joint[name], flush=True)
res["joint"] = joint
json.dump(res, open(out_path, "w"), indent=1)
