"""The GPU kernels of the engine's prefill of one 8K prompt, BF16 vs INT4/INT4, by torch.profiler.

    PYTHONPATH=src python benchmarks/prefill_kernels.py        # CUDA GPU; prints the top kernels per format

The serving benchmark's model (random bf16 weights), one 8192-token prompt prefilled after a warm-up prompt,
with the engine's default prefill chunk and query blocks. Figures quoted in
benchmarks/results/engine_profile_prefill.md.
"""

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "src"))

from serving_pressure import ModelSpec, build_model  # noqa: E402

from quantmla.engine import LLM, SamplingParams  # noqa: E402


def main(top: int = 22) -> None:
    model = build_model(ModelSpec(), torch.device("cuda"), 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 102400, (8192,), generator=g).tolist() for _ in range(2)]
    for content, rope in (("bf16", "bf16"), ("int4", "int4")):
        llm = LLM(model, content=content, rope=rope, kv_cache_bytes=4 << 30, max_num_seqs=2, max_model_len=8200,
                  cuda_graphs=False)  # fmt: skip
        for p in prompts:
            llm.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
        warm, _ = llm.scheduler.schedule()
        llm.runner.prefill(warm)
        torch.cuda.synchronize()
        seqs, _ = llm.scheduler.schedule()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            llm.runner.prefill(seqs)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        print(f"== {content}/{rope}: wall {wall * 1e3:.0f} ms (profiled)")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"  {e.self_device_time_total / 1e3:8.2f} ms  n={e.count:5d}  {e.key[:100]}")
        llm.close()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=22, help="kernels listed per format")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    main(args.top)
