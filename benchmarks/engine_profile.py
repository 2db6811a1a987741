"""Where the engine's time goes: the prefill of one long prompt, and one decode step at a large batch.

    PYTHONPATH=src python benchmarks/engine_profile.py --out benchmarks/results      # CUDA GPU
    PYTHONPATH=src python benchmarks/engine_profile.py --tiny --out /tmp/ep          # CPU smoke run

Model: the serving benchmark's (`serving_pressure.py`: DeepSeek-V2-Lite attention geometry, 27 layers, dense
MLP, random bf16 weights; speed does not depend on their values). For each cache format:
  prefill  one PROMPT-token prompt (after a warm-up prompt), for each prefill chunk size: wall time of
           `ModelRunner.prefill` (synchronized), and on CUDA whether anything in it synchronizes with the host
           (`torch.cuda.set_sync_debug_mode("error")` raises on the first sync: a prefill that syncs is
           host-bound, the GPU idles while Python catches up);
  decode   BATCH sequences of CONTEXT tokens decoding with CUDA graphs (eager on the CPU): per step the wall
           time of `LLM.step()`, the GPU time of the forward (CUDA events around graph replay and sampling's
           argmax; the GPU never idles in between), the host time outside it (wall - GPU), and that host time
           split into the scheduler, the runner's input preparation and launch, waiting for the sampled
           tokens, and the engine's bookkeeping.
Writes engine_profile.{json,md} to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from serving_pressure import TINY_MODEL, ModelSpec, build_model  # noqa: E402

from quantmla.engine import LLM, SamplingParams  # noqa: E402

FORMATS = {"bf16/bf16": ("bf16", "bf16"), "int4/int4": ("int4", "int4"), "int2/int4": ("int2", "int4")}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def profile_prefill(model, dev, fmt, prompt_len: int, chunks: list[int], query_blocks: list[int], vocab: int
                    ) -> list[dict]:
    import quantmla.engine.attention as attention

    rows, default_block = [], attention.QUERY_BLOCK
    for chunk, query_block in [(c, q) for c in chunks for q in query_blocks]:
        attention.QUERY_BLOCK = query_block
        llm = LLM(model, content=fmt[0], rope=fmt[1], device=dev, kv_cache_bytes=None if dev.type == "cpu" else 4 << 30,
                  max_num_seqs=2, max_model_len=prompt_len + 8, prefill_chunk=chunk, cuda_graphs=False)  # fmt: skip
        for p in prompts(2, prompt_len, vocab, seed=1):
            llm.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
        warm, _ = llm.scheduler.schedule()
        llm.runner.prefill(warm[:1])  # warm-up
        seqs, _ = llm.scheduler.schedule()
        assert len(warm) == len(seqs) == 1
        sync(dev)
        syncs = None
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                llm.runner.prefill(seqs)
                syncs = "none"
            except RuntimeError as e:
                syncs = str(e).splitlines()[0][:120]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sync(dev)
        t = time.perf_counter()
        llm.runner.prefill(seqs)
        sync(dev)
        wall = time.perf_counter() - t
        rows.append(dict(chunk=chunk, query_block=query_block, prompt=prompt_len, wall_s=wall, tok_s=prompt_len / wall, host_syncs=syncs))
        llm.close()
        del llm
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    attention.QUERY_BLOCK = default_block  # the decode runs' prefills use the engine's own
    return rows


def profile_decode(model, dev, fmt, batch: int, context: int, steps: int, vocab: int) -> dict:
    import quantmla.engine.llm as llm_mod

    llm = LLM(model, content=fmt[0], rope=fmt[1], device=dev, max_num_seqs=batch,
              max_model_len=context + steps + 16, kv_cache_bytes=None if dev.type == "cpu" else 40 << 30)  # fmt: skip
    for p in prompts(batch, context, vocab, seed=2):
        llm.add_request(p, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while llm.stats()["decode_steps"] < 3:  # all prefilled, graphs warm
        llm.step()
    assert llm.stats()["running"] == batch
    split = dict(schedule=0.0, runner=0.0, sample=0.0)
    events = []
    cuda = dev.type == "cuda"

    def timed(name, f, gpu_span=False):
        def call(*a, **k):
            t = time.perf_counter()
            if gpu_span and cuda:
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
            out = f(*a, **k)
            if gpu_span and cuda:  # processed by the GPU when the forward is done
                events[-1][1].record()
            split[name] += time.perf_counter() - t
            return out

        return call

    schedule, decode, sample = llm.scheduler.schedule, llm.runner.decode, llm_mod.sample
    llm.scheduler.schedule = timed("schedule", schedule)
    llm.runner.decode = timed("runner", decode, gpu_span=True)
    llm_mod.sample = timed("sample", sample)
    walls = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            llm.step()
            walls.append(time.perf_counter() - t)
    finally:
        llm_mod.sample = sample
    sync(dev)
    gpu = statistics.median(s.elapsed_time(e) for s, e in events) if events else None
    wall = statistics.median(walls) * 1e3
    n = len(walls)
    split = {k: v / n * 1e3 for k, v in split.items()}
    split["rest_of_step"] = sum(walls) / n * 1e3 - sum(split.values())
    row = dict(batch=batch, context=context, steps=steps, cuda_graphs=llm.stats()["cuda_graphs"] != [],
               wall_ms=wall, gpu_ms=gpu, host_ms=None if gpu is None else wall - gpu,
               host_share=None if gpu is None else (wall - gpu) / wall, split_ms=split)
    llm.close()
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return row


def markdown(res: dict) -> str:
    lines = ["# Engine profile: prefill and decode step\n", f"Card: {res['device']}. Date: {res['date']}. "
             f"torch {res['torch']}. Command: `{res['command']}`.\n", "Model: " + res["model"] + "\n",
             "## Prefill of one prompt\n", "| format | prompt | chunk | query block | wall s | tok/s | host syncs |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for fmt, rows in res["prefill"].items():
        for r in rows:
            lines.append(f"| {fmt} | {r['prompt']} | {r['chunk']} | {r['query_block']} | {r['wall_s']:.3f} | {r['tok_s']:.0f} | "
                         f"{r['host_syncs']} |")
    lines += ["", "## Decode step (median per step, ms)\n",
              "| format | batch | context | graphs | wall | GPU | host | host share | schedule | runner | sample | rest |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fmt, r in res["decode"].items():
        s = r["split_ms"]
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        share = "-" if r["host_share"] is None else f"{100 * r['host_share']:.1f} %"
        lines.append(f"| {fmt} | {r['batch']} | {r['context']} | {r['cuda_graphs']} | {r['wall_ms']:.2f} | "
                     f"{f(r['gpu_ms'])} | {f(r['host_ms'])} | {share} | {s['schedule']:.2f} | {s['runner']:.2f} | "
                     f"{s['sample']:.2f} | {s['rest_of_step']:.2f} |")
    lines += ["", "runner: the runner's decode call (inputs, block-table copies, graph launch); sample: sampling "
              "up to the tokens on the host (waits for the GPU); rest: the engine's bookkeeping. GPU: forward + "
              "argmax on the device. host = wall - GPU: the time the GPU waits for Python each step."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a 2-layer model, short prompts")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--query-blocks", default="1024", help="prefill attention query blocks to compare")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("engine_profile.py needs a CUDA GPU (--tiny: the CPU smoke run)")
    dev = torch.device("cpu" if args.tiny else "cuda")
    spec = TINY_MODEL if args.tiny else ModelSpec()
    if args.tiny:
        args.query_blocks = "1024,64"
        args.prompt, args.chunks, args.batch, args.context, args.steps = 300, "64,512", 8, 200, 5
    model = build_model(spec, dev, seed=0)
    if dev.type == "cpu":
        model = model.float()
    res = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               torch=torch.__version__, command="python " + " ".join(sys.argv),
               model=f"{spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads, kv_lora_rank {spec.kv_lora_rank}, "
                     f"rope {spec.rope}, dense MLP {spec.intermediate}, random weights",  # fmt: skip
               prefill={}, decode={})
    chunks = [int(c) for c in args.chunks.split(",")]
    for key in args.formats.split(","):
        fmt = FORMATS[key]
        res["prefill"][key] = profile_prefill(model, dev, fmt, args.prompt, chunks,
                                              [int(q) for q in args.query_blocks.split(",")], spec.vocab)
        print(key, "prefill", res["prefill"][key], flush=True)
        res["decode"][key] = profile_decode(model, dev, fmt, args.batch, args.context, args.steps, spec.vocab)
        print(key, "decode", res["decode"][key], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "engine_profile.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
