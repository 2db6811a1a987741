"""Serving under KV-memory pressure: the engine (`quantmla.engine.LLM`) with each cache format, one KV budget.

    PYTHONPATH=src python benchmarks/serving_pressure.py [--out benchmarks/results]      # the H200 run
    PYTHONPATH=src python benchmarks/serving_pressure.py --tiny --out /tmp/sp          # CPU smoke run

Model: DeepSeek-V2-Lite's attention geometry (27 layers, hidden 2048, 16 heads, kv_lora_rank 512, rope 64,
nope 128, v 128, no q LoRA, vocab 102400) with a dense MLP in every layer, intermediate 10944 (V2-Lite's
dense width), which puts 2.40 B parameters in the matmuls of every token, V2-Lite's ~2.4 B active ones.
Random bf16 weights, built in memory on the device: speed does not depend on their values (greedy decoding
with ignore_eos runs every request to its full length whatever the tokens are). One model serves every row;
each `LLM` replaces its attention modules, and they are put back before the next one is built.

Workloads (prompts: seeded random token ids, the same for every row; SamplingParams(max_tokens=OUT,
temperature=0, ignore_eos=True)), driven by hand through add_request/step to time every request:
  headline  64 requests x 8192-token prompts x 1024 output tokens, all arriving at t=0, every format, at a KV
            budget of 1/3 of what BF16 needs to hold the whole load (BF16 must preempt; INT4/INT4 needs ~30 %);
  sweep     a smaller load (32 x 4096 + 512, to fit the time budget) at budgets from 1.0 (BF16 just fits all
            of it) down to 0.25, so the headline is not a chosen point: BF16, FP8-576 and INT4/INT4, throughput
            ratio to BF16 at each budget, plotted;
  poisson   the sweep's load arriving as a Poisson process (4 requests/s), the same three formats, at the
            headline's budget fraction.
Every run has a time limit (--time-limit, 120 s: a run still going is cut, its row says so) and the whole
benchmark one (--total-time-limit, 470 s: runs that would not fit are skipped and listed as such).
The KV budget (`kv_cache_bytes`) is a fraction of the BF16 pages the whole load needs, plus the engine's
one scratch page; every format gets the same bytes. Quantized formats keep sink 4 + recent 128 tokens per
sequence in BF16 (those rows come out of the same budget); the FP8 rows use no BF16 window, as vLLM and
FlashMLA do.

Measured per row: tokens the pool holds, preemptions, output tok/s and requests/s (over the run's wall
time), TTFT (arrival -> first token) and TPOT ((last - first) / (n - 1)) median and p99, peak batch, and a
time split: first prefill, re-prefill after preemption and decode, from timing every engine step. Within
decode, a torch.profiler window of decode steps halfway through the headline run (kernels replayed from the
CUDA graphs included) splits the GPU time into attention (`_mla_decode_kernel`, the CUDA kernel `mla_decode_int`, or
`_gluon_decode_kernel` with $QUANTMLA_DECODE_KERNEL=gluon, + `_combine_kernel`), the new token's cache write (`_append_decode_kernel`,
where the engine uses it), GEMMs (the weights), sampling (argmax/top-k kernels) and other kernels, and the step's host time not covered by kernels (Python,
launches). If the profiler sees no attention kernel in the CUDA-graph run, the kernel times come from an eager
twin (same format and budget, cuda_graphs=False, the row's peak batch), are set against the CUDA-graph run's
decode step at that batch, and the output says so. Writes serving_pressure.{json,md,png} to --out; results
are saved after every run, so a run cut short by the time guards still leaves what it measured.
"""

from __future__ import annotations

import os

# CUDA graphs + CUPTI teardown crash on the second profiling session (see torch.profiler); no teardown.
os.environ.setdefault("TEARDOWN_CUPTI", "0")
os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")

import argparse  # noqa: E402
import bisect  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from quantmla.cache.paged import PagedMLACache  # noqa: E402
from quantmla.config import CacheConfig, QuantFormat  # noqa: E402
from quantmla.engine import LLM, SamplingParams  # noqa: E402
from quantmla.models.adapters import describe  # noqa: E402


@dataclass(frozen=True)
class Format:
    key: str  # content/rope as quantmla spells them (= llm.stats()["format"])
    label: str
    content: str
    rope: str
    sink: int
    recent: int


FORMATS = {
    f.key: f
    for f in (
        Format("bf16/bf16", "BF16", "bf16", "bf16", 0, 0),
        Format("fp8:0/fp8:0", "FP8, scale 1.0 (vLLM, 576 B)", "fp8:0", "fp8:0", 0, 0),
        Format("fp8/bf16", "FP8 + BF16 RoPE (FlashMLA, 656 B)", "fp8", "bf16", 0, 0),
        Format("int4/int4", "quantmla INT4/INT4", "int4", "int4", 4, 128),
        Format("int2/int4", "quantmla INT2/INT4", "int2", "int4", 4, 128),
    )
}
BF16, FP8 = "bf16/bf16", "fp8:0/fp8:0"  # the rows the targets compare against


@dataclass(frozen=True)
class ModelSpec:
    layers: int = 27
    hidden: int = 2048
    heads: int = 16
    kv_lora_rank: int = 512
    rope: int = 64
    nope: int = 128
    v: int = 128
    intermediate: int = 10944
    vocab: int = 102400


# Paths wide enough that the formats' byte ratios are close to the real ones (INT4/INT4 0.285 of BF16 here, 0.281
# at 512 + 64), so the tiny run shows the same pressure pattern.
TINY_MODEL = ModelSpec(layers=2, hidden=64, heads=2, kv_lora_rank=256, rope=32, nope=16, v=16, intermediate=128,
                       vocab=512)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_len: int
    output_len: int
    rate: float = 0.0  # requests/s of a Poisson process; 0: all arrive at t=0
    seed: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.output_len


# --- the model --------------------------------------------------------------------------------------------


def build_model(spec: ModelSpec, device: torch.device, seed: int) -> torch.nn.Module:
    """A DeepSeek-V2 model with `spec`'s dims, random bf16 weights, built directly on `device`."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    config = DeepseekV2Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=spec.rope, qk_nope_head_dim=spec.nope,
        v_head_dim=spec.v, first_k_dense_replace=spec.layers,  # dense MLP in every layer: no MoE routing
        max_position_embeddings=163840, topk_method="greedy", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def param_counts(model: torch.nn.Module) -> dict:
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    # The input embedding is a lookup; every other weight is read by a matmul for every token.
    return {"total": total, "embedding": embed, "matmul_per_token": total - embed}


@dataclass
class Engines:
    """Builds one LLM at a time on a shared model and puts the model's own attention modules back after."""

    model: torch.nn.Module
    device: torch.device
    block_size: int
    max_num_seqs: int | None  # None: the workload's request count (each slot's BF16 rows cost budget)
    prefill_chunk: int

    def __post_init__(self):
        self.originals = {layer.module: self.model.get_submodule(layer.module) for layer in describe(self.model)}
        self.attn_impl = self.model.config._attn_implementation

    @contextmanager
    def open(self, fmt: Format, budget: int, w: Workload, cuda_graphs: bool = True):
        try:  # the constructor replaces the attention modules before it may fail (e.g. in graph capture)
            yield LLM(model=self.model, content=fmt.content, rope=fmt.rope, sink=fmt.sink, recent=fmt.recent,
                      device=self.device, kv_cache_bytes=budget, max_num_seqs=self.max_num_seqs or w.requests,
                      max_model_len=w.tokens, block_size=self.block_size, prefill_chunk=self.prefill_chunk,
                      cuda_graphs=cuda_graphs)  # fmt: skip
        finally:
            for name, module in self.originals.items():
                self.model.set_submodule(name, module)
            self.model.config._attn_implementation = self.attn_impl

    def release(self) -> None:
        """Call once the last reference to an LLM is gone: frees its pools and graphs before the next one."""
        if self.device.type == "cuda":
            gc.collect()  # in case of reference cycles through the replaced modules
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def body_bytes_per_token(fmt: Format, spec: ModelSpec) -> int:
    """Pool bytes of one quantized token in one layer (scales and zeros included)."""
    cfg = CacheConfig(fmt.content, fmt.rope, fmt.sink, fmt.recent).fit(spec.kv_lora_rank, spec.rope)
    return PagedMLACache.allocate(cfg, spec.kv_lora_rank, spec.rope, 1, 1, 1, "meta").body_bytes_per_token


def bf16_load_bytes(w: Workload, spec: ModelSpec, block_size: int) -> int:
    """BF16 pages for every request of `w` at its full length, all layers."""
    pages = -(-w.tokens // block_size)
    return w.requests * pages * block_size * spec.layers * (spec.kv_lora_rank + spec.rope) * 2


def budget_bytes(fraction: float, w: Workload, spec: ModelSpec, block_size: int) -> int:
    """`fraction` of the BF16 load, plus one BF16 page: the engine keeps one scratch page for the padded rows
    of a CUDA-graph batch, so at fraction 1.0 BF16 holds exactly the whole load."""
    page = block_size * spec.layers * (spec.kv_lora_rank + spec.rope) * 2
    return int(fraction * bf16_load_bytes(w, spec, block_size)) + page


def prompts_for(w: Workload, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(w.seed)
    return torch.randint(0, vocab, (w.requests, w.prompt_len), generator=g).tolist()


def arrivals_for(w: Workload) -> list[float]:
    if w.rate <= 0:
        return [0.0] * w.requests
    rng = np.random.default_rng(w.seed + 1)
    return np.cumsum(rng.exponential(1 / w.rate, w.requests)).tolist()


# --- driving the engine -----------------------------------------------------------------------------------


class Clock:
    """Seconds since start, minus paused time (profiler start/stop and analysis are not the engine's time)."""

    def __init__(self):
        self.t0, self.paused = time.perf_counter(), 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    @contextmanager
    def pause(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - t


@dataclass
class Step:
    kind: str  # "prefill" | "decode" | "idle" (nothing could be scheduled)
    seconds: float
    batch: int
    first_tokens: int = 0  # prefill: prompt tokens prefilled for the first time
    recompute_tokens: int = 0  # prefill: tokens prefilled again after a preemption
    profiled: bool = False  # taken inside a profiler window (tracing slows it down)


def timed_step(llm: LLM, clock: Clock, generated: list[int], w: Workload, label: str | None = None):
    """One engine step; returns (outputs, Step, end time). `generated[i]`: tokens request i had before."""
    before = llm.stats()["prefill_steps"]
    t0 = clock()
    if label is None:
        outs = llm.step()
    else:
        with torch.profiler.record_function(label):
            outs = llm.step()
    t1 = clock()
    kind = "prefill" if llm.stats()["prefill_steps"] > before else "decode" if outs else "idle"
    step = Step(kind, t1 - t0, len(outs))
    if kind == "prefill":
        for o in outs:
            n = generated[int(o.request_id)]
            if n:  # it had tokens already: preempted, now recomputed (prompt + generated)
                step.recompute_tokens += w.prompt_len + n
            else:
                step.first_tokens += w.prompt_len
    return outs, step, t1


@dataclass
class Run:
    wall_s: float
    arrival: list[float]
    first: list[float | None]
    last: list[float | None]
    generated: list[int]
    finished: list[bool]
    steps: list[Step]
    stats: dict
    capacity_tokens: int
    kv_cache_bytes: int
    cut: bool
    pages_left: int  # pages still allocated when the loop ended, before aborting what was left: 0 = no leak
    profile: dict | None = None


class Window:
    """A torch.profiler window over `decode_steps` decode steps, started halfway through the output."""

    def __init__(self, decode_steps: int, cuda: bool, start_at: float = 0.5):
        self.decode_steps, self.cuda, self.start_at = decode_steps, cuda, start_at
        self.prof, self.steps, self.result = None, [], None

    def wants_start(self, done_fraction: float, last_kind: str) -> bool:
        return self.prof is None and self.result is None and done_fraction >= self.start_at and last_kind == "decode"

    def start(self):
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
        try:
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
        except Exception as e:  # the profile is a side measurement: never lose the run over it
            self.prof = None
            self.result = {"error": f"profiler start: {type(e).__name__}: {e}", "attention_share": None}

    def label(self) -> str | None:
        return f"qm_step_{len(self.steps)}" if self.prof is not None else None

    def record(self, step: Step) -> bool:
        """Note a step taken under label(); True when the window is complete."""
        self.steps.append(step)
        n_dec = sum(s.kind == "decode" for s in self.steps)
        return n_dec >= self.decode_steps or len(self.steps) >= 4 * self.decode_steps

    def stop(self) -> dict:
        if self.prof is None:  # start failed
            return self.result
        try:
            self.prof.stop()
            self.result = analyze_window(self.prof.events(), self.steps)
        except Exception as e:
            self.result = {"error": f"profiler: {type(e).__name__}: {e}", "attention_share": None}
        self.prof = None
        return self.result


def drive(llm: LLM, w: Workload, prompts: list[list[int]], limit_s: float, window: Window | None = None) -> Run:
    """Run the workload to the end (or to limit_s, then abort what is left) and time every request."""
    n, arrivals = w.requests, arrivals_for(w)
    params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    first, last, gen, fin = [None] * n, [None] * n, [0] * n, [False] * n
    steps, clock, nxt, cut, last_kind = [], Clock(), 0, False, "prefill"
    total = n * w.output_len
    while nxt < n or llm.has_unfinished():
        now = clock()
        while nxt < n and arrivals[nxt] <= now:
            llm.add_request(prompts[nxt], params, request_id=str(nxt))
            nxt += 1
        if not llm.has_unfinished():  # idle until the next arrival
            time.sleep(max(0.0, min(arrivals[nxt] - now, 0.01)))
            continue
        if now > limit_s:
            cut = True
            break
        if window is not None and window.wants_start(sum(gen) / total, last_kind):
            with clock.pause():
                window.start()
        outs, step, t = timed_step(llm, clock, gen, w, window.label() if window else None)
        steps.append(step)
        last_kind = step.kind
        for o in outs:
            i = int(o.request_id)
            first[i] = t if first[i] is None else first[i]
            last[i] = t
            gen[i] += len(o.new_token_ids)
            fin[i] = fin[i] or o.finished
        step.profiled = window is not None and window.prof is not None
        if step.profiled and window.record(step):
            with clock.pause():
                window.stop()
    wall = clock()
    if window is not None and window.prof is not None:  # the run ended inside the window
        with clock.pause():
            window.stop()
    pages_left = llm.stats()["pages_used"]
    for i in range(n):
        if not fin[i]:
            llm.abort(str(i))
    stats = llm.stats()
    return Run(wall, arrivals, first, last, gen, fin, steps, stats, llm.capacity_tokens,
               stats.get("kv_cache_bytes", 0), cut, pages_left, window.result if window else None)  # fmt: skip


# --- the profile window -----------------------------------------------------------------------------------

# Triton / CUDA (mla_decode_int.cu) / Gluon decode, and the split combine
ATTENTION_KERNELS = ("_mla_decode_kernel", "mla_decode_int", "_gluon_decode_kernel", "_combine_kernel")
CACHE_WRITE_KERNELS = ("_append_decode_kernel",)  # the fused quantize-and-store of the new token, when used
CLASSES = ("attention", "cache_write", "weights", "sampling", "other_kernels")
GEMM = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|splitk|cublas|matmul", re.I)
SAMPLING = re.compile(r"argmax|topk|sort|softmax|exponential|multinomial", re.I)


def kernel_class(name: str) -> str:
    if any(k in name for k in ATTENTION_KERNELS):
        return "attention"
    if any(k in name for k in CACHE_WRITE_KERNELS):
        return "cache_write"
    if GEMM.search(name):
        return "weights"
    if SAMPLING.search(name):
        return "sampling"
    return "other_kernels"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def analyze_window(events, steps: list[Step]) -> dict:
    """Split the decode steps of a profiled window: per-step means (ms) of wall, GPU busy (union of kernel
    intervals), kernel time per class, and host time (wall not covered by kernels). Device events are
    attributed to the labelled step (record_function `qm_step_<i>`) in which they start."""
    from torch.autograd import DeviceType

    spans = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("qm_step_"):
            spans[int(e.name[8:])] = (e.time_range.start, e.time_range.end)
    order = sorted(spans)
    starts = [spans[i][0] for i in order]
    per_step = {i: {"kernels": [], "ms": {}} for i in order}
    seen = 0
    for e in events:
        if e.device_type == DeviceType.CPU or e.name.startswith("qm_step_"):
            continue  # CPU ops, and the GPU-timeline copies of our own labels
        k = bisect.bisect_right(starts, e.time_range.start) - 1
        if k < 0 or e.time_range.start > spans[order[k]][1]:
            continue
        seen += 1
        rec = per_step[order[k]]
        rec["kernels"].append((e.time_range.start, e.time_range.end))
        cls = kernel_class(e.name)
        rec["ms"][cls] = rec["ms"].get(cls, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    dec = [i for i in order if i < len(steps) and steps[i].kind == "decode"]
    out = {"decode_steps": len(dec), "kernels_seen": seen, "attention_share": None}
    if not seen:
        out["note"] = "the profiler saw no GPU kernels"
    if not dec or not seen:
        return out
    mean = lambda xs: float(sum(xs) / len(xs))  # noqa: E731
    out["batches"] = [steps[i].batch for i in dec]
    out["mean_batch"] = mean(out["batches"])
    out["step_ms"] = mean([(spans[i][1] - spans[i][0]) / 1e3 for i in dec])
    out["gpu_busy_ms"] = mean([_union(per_step[i]["kernels"]) / 1e3 for i in dec])
    for cls in CLASSES:
        out[f"{cls}_ms"] = mean([per_step[i]["ms"].get(cls, 0.0) for i in dec])
    out["host_ms"] = max(out["step_ms"] - out["gpu_busy_ms"], 0.0)
    if seen and out["attention_ms"] > 0:
        out["attention_share"] = out["attention_ms"] / out["step_ms"]
        out["attention_share_of_gpu"] = out["attention_ms"] / max(out["gpu_busy_ms"], 1e-9)
    return out


def profile_twin(engines: Engines, fmt: Format, budget: int, w: Workload, prompts, batch: int,
                 decode_steps: int, limit_s: float) -> dict:  # fmt: skip
    """The profile window from an eager twin: `batch` requests prefilled, a few decode steps, then the window
    (given up, with a note, past limit_s)."""
    with engines.open(fmt, budget, w, cuda_graphs=False) as llm:
        params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            llm.add_request(prompts[i], params, request_id=str(i))
        clock, gen = Clock(), [0] * w.requests
        warm = steps = 0
        result = None
        # Until every request is prefilled and decoding (a bounded number of steps, should it keep preempting).
        while llm.has_unfinished() and (llm.stats()["waiting"] or warm < 3) and steps < 2 * batch + 50:
            if clock() > limit_s:
                result = {"error": f"eager twin cut at {limit_s:.0f} s before its window", "attention_share": None}
                break
            steps += 1
            outs, step, _ = timed_step(llm, clock, gen, w)
            warm += step.kind == "decode"
            for o in outs:
                gen[int(o.request_id)] += len(o.new_token_ids)
        if result is None:
            window = Window(decode_steps, engines.device.type == "cuda", start_at=0.0)
            window.start()
            while llm.has_unfinished():
                outs, step, _ = timed_step(llm, clock, gen, w, window.label())
                for o in outs:
                    gen[int(o.request_id)] += len(o.new_token_ids)
                if window.record(step):
                    break
            result = window.stop()
        for i in range(batch):
            llm.abort(str(i))
    del llm
    engines.release()
    result["source"] = f"eager twin (cuda_graphs=False), batch {batch}, contexts ~{w.prompt_len}"
    return result


# --- rows -------------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(run: Run, fmt: Format, spec: ModelSpec, w: Workload, fraction: float, budget: int) -> dict:
    n_done = sum(run.finished)
    ttft = [f - a for f, a in zip(run.first, run.arrival) if f is not None]
    tpot = [(la - f) / (g - 1) for f, la, g in zip(run.first, run.last, run.generated) if f is not None and g > 1]
    e2e = [la - a for la, a, ok in zip(run.last, run.arrival, run.finished) if ok]
    tokens = sum(run.generated)
    prefill = [s for s in run.steps if s.kind == "prefill"]
    decode = [s for s in run.steps if s.kind == "decode"]

    def share(s: Step) -> float:  # a prefill step's time, split by the tokens it prefilled
        return s.recompute_tokens / max(s.first_tokens + s.recompute_tokens, 1)

    split = {
        "prefill_s": sum(s.seconds * (1 - share(s)) for s in prefill),
        "reprefill_s": sum(s.seconds * share(s) for s in prefill),
        "decode_s": sum(s.seconds for s in decode),
    }
    split["driver_s"] = run.wall_s - sum(split.values())  # add_request, idle waits for arrivals, this loop
    bpt = body_bytes_per_token(fmt, spec)
    row = {
        "format": fmt.key, "label": fmt.label, "content": fmt.content, "rope": fmt.rope,
        "bf16_window": f"sink {fmt.sink} + recent {fmt.recent}" if fmt.sink + fmt.recent else "none",
        "body_bytes_per_token": bpt, "body_bytes_per_token_all_layers": bpt * spec.layers,
        "budget_fraction": fraction, "kv_budget_bytes": budget, "kv_cache_bytes": run.kv_cache_bytes,
        "capacity_tokens": run.capacity_tokens, "load_tokens": w.requests * w.tokens,
        "preemptions": run.stats["preemptions"], "peak_batch": run.stats["peak_batch"],
        "requests": w.requests, "requests_done": n_done, "requests_lost": w.requests - n_done,
        "pages_left_allocated": run.pages_left, "output_tokens": tokens, "wall_s": run.wall_s,
        "output_tok_s": tokens / run.wall_s, "request_throughput_rps": n_done / run.wall_s,
        "ttft_median_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_median_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "e2e_median_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "prefill_steps": len(prefill), "decode_steps": len(decode),
        "prefill_tokens": sum(s.first_tokens for s in prefill),
        "reprefill_tokens": sum(s.recompute_tokens for s in prefill),
        "mean_decode_batch": sum(s.batch for s in decode) / max(len(decode), 1),
        "decode_step_ms": 1e3 * split["decode_s"] / max(len(decode), 1),
        "time_split": split, "cut": run.cut, "attention_share": None,
        "cuda_graphs": run.stats.get("cuda_graphs"),  # batch sizes captured; [] = eager decode
    }  # fmt: skip
    row["decode_step_ms_by_batch"] = {
        b: 1e3 * float(np.mean([s.seconds for s in decode if s.batch == b and not s.profiled]))
        for b in sorted({s.batch for s in decode if not s.profiled})
    }  # fmt: skip
    if run.profile is not None:
        apply_profile(row, run.profile)
    return row


def apply_profile(row: dict, prof: dict) -> None:
    """Attach a profile window to a row. The shares are taken over the run's own unprofiled decode steps at the
    window's batch sizes (tracing slows the profiled steps, and an eager twin's host time is not the engine's);
    the window's per-step kernel times scaled to the run's decode time give seconds in each part of decode
    (host = step - GPU busy)."""
    row["profile"] = prof
    if prof.get("attention_share") is None:
        return
    by_batch = row["decode_step_ms_by_batch"]
    ref = [by_batch[b] for b in prof["batches"] if b in by_batch]
    step_ms = prof["reference_step_ms"] = float(np.mean(ref)) if ref else prof["step_ms"]
    ms = {k: prof[f"{k}_ms"] for k in CLASSES}
    ms["host"] = max(step_ms - prof["gpu_busy_ms"], 0.0)
    row["attention_share"] = ms["attention"] / step_ms
    row["decode_split_s"] = {k: row["time_split"]["decode_s"] * v / step_ms for k, v in ms.items()}


def add_ratios(rows: list[dict]) -> None:
    """Throughput relative to the BF16 and the 576-byte FP8 rows of the same list."""
    base = {r["format"]: r["output_tok_s"] for r in rows if not r.get("skipped")}
    for r in rows:
        if r.get("skipped"):
            continue
        r["x_bf16"] = r["output_tok_s"] / base[BF16] if BF16 in base else None
        r["x_fp8_576"] = r["output_tok_s"] / base[FP8] if FP8 in base else None


# --- output -----------------------------------------------------------------------------------------------


def fmt_num(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def rich_tables(result: dict) -> None:
    """The results in 80 columns (the full tables are in the markdown)."""
    from rich.console import Console
    from rich.table import Table

    def table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
        t = Table(title=title, title_justify="left")
        for c in columns:
            t.add_column(c, justify="left" if c == "format" else "right", no_wrap=c == "format")
        for r in rows:
            t.add_row(*r)
        return t

    def name(r: dict) -> str:
        return r["format"] + (" CUT" if r["cut"] else "")

    def p50_p99(r: dict, key: str, spec: str, scale: float = 1.0) -> str:
        return f"{fmt_num(r[f'{key}_median_s'], spec, scale)}/{fmt_num(r[f'{key}_p99_s'], spec, scale)}"

    con = Console(width=100 if sys.stdout.isatty() else 80)
    rows = [r for r in result["rows"] if not r.get("skipped")]
    if rows:
        con.print(table(f"headline: {result['config']['headline']['describe']}",
                        ["format", "pool", "pre", "peak", "tok/s", "xBF16", "xFP8", "req/s"],
                        [[name(r), str(r["capacity_tokens"]), str(r["preemptions"]), str(r["peak_batch"]),
                          f"{r['output_tok_s']:.0f}", fmt_num(r.get("x_bf16")), fmt_num(r.get("x_fp8_576")),
                          f"{r['request_throughput_rps']:.2f}"] for r in rows]))  # fmt: skip
        con.print(table("headline: latency p50/p99 and time split (s)",
                        ["format", "TTFT s", "TPOT ms", "prefill", "re-pf", "decode", "attn"],
                        [[name(r), p50_p99(r, "ttft", ".1f"), p50_p99(r, "tpot", ".1f", 1e3),
                          f"{r['time_split']['prefill_s']:.1f}", f"{r['time_split']['reprefill_s']:.1f}",
                          f"{r['time_split']['decode_s']:.1f}", fmt_num(r["attention_share"], ".0%")]
                         for r in rows]))  # fmt: skip
    for phase in ("sweep", "poisson"):
        rows = [r for r in result.get(phase, []) if not r.get("skipped")]
        if rows:
            con.print(table(f"{phase}: {result['config'][phase]['describe']}",
                            ["budget", "format", "pool", "pre", "tok/s", "xBF16", "TTFT s", "TPOT ms"],
                            [[f"{r['budget_fraction']:.2f}", name(r), str(r["capacity_tokens"]), str(r["preemptions"]),
                              f"{r['output_tok_s']:.0f}", fmt_num(r.get("x_bf16")), fmt_num(r["ttft_median_s"]),
                              fmt_num(r["tpot_median_s"], ".1f", 1e3)] for r in rows]))  # fmt: skip


def table_lines(rows: list[dict]) -> list[str]:
    """One markdown table, one line per run (the same columns for the headline, the sweep and Poisson)."""
    lines = ["| budget (x BF16 load) | format | B/token/layer | pool tokens | preemptions | peak batch | "
             "output tok/s | x BF16 | x FP8-576 | req/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | "
             "attention share of decode | wall s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['budget_fraction']:.2f} | {r['format']} | skipped: {r['skipped']} ||||||||||||")
            continue
        lines.append(
            f"| {r['budget_fraction']:.2f} | {r['label']} (`{r['format']}`){' **cut**' if r['cut'] else ''} | "
            f"{r['body_bytes_per_token']} | {r['capacity_tokens']} | {r['preemptions']} | {r['peak_batch']} | "
            f"{r['output_tok_s']:.0f} | {fmt_num(r.get('x_bf16'))} | {fmt_num(r.get('x_fp8_576'))} | "
            f"{r['request_throughput_rps']:.2f} | {fmt_num(r['ttft_median_s'], '.2f')} / "
            f"{fmt_num(r['ttft_p99_s'], '.2f')} | {fmt_num(r['tpot_median_s'], '.1f', 1e3)} / "
            f"{fmt_num(r['tpot_p99_s'], '.1f', 1e3)} | {fmt_num(r['attention_share'], '.0%')} | {r['wall_s']:.1f} |"
        )
    return lines


def markdown(result: dict) -> str:
    c = result["config"]
    m = c["model"]
    lines = [
        "# Serving under KV-memory pressure",
        "",
        f"Card: {result['card']}. Date: {result['date']}. torch {result['torch']}. Command: `{result['command']}`"
        f" ($QUANTMLA_DECODE_KERNEL={result.get('decode_kernel', 'auto')}).",
        "",
        f"Model: DeepSeek-V2-Lite attention geometry, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, "
        f"kv_lora_rank {m['kv_lora_rank']}, rope {m['rope']}, nope {m['nope']}, v {m['v']}, dense MLP "
        f"{m['intermediate']} in every layer, vocab {m['vocab']}: {fmt_params(c['params']['total'])} parameters, "
        f"{fmt_params(c['params']['matmul_per_token'])} of them in the matmuls of every token. Random bf16 "
        "weights: speed does not depend on their values (greedy, ignore_eos: every request runs to its length).",
        "",
        f"Headline: {c['headline']['describe']}. KV budget {fmt_bytes(c['headline']['budget_bytes'])} = "
        f"{c['headline']['budget_fraction']:.3f} of the BF16 pages the whole load needs (+ one scratch page). "
        f"max_num_seqs {c['max_num_seqs']}, page {c['block_size']} tokens, prefill chunk {c['prefill_chunk']}, "
        f"{c['time_limit_s']:.0f} s limit per run. Quantized formats keep {c['windows']['int4/int4']} tokens per "
        "sequence, inside the same budget; the FP8 rows keep no BF16 window (as vLLM and FlashMLA).",
        "",
    ]
    if result["rows"]:  # the headline (a Poisson-only or sweep-only run has none)
        lines += table_lines(result["rows"])
        lines += ["", "Time split of the headline runs (seconds of wall time; decode parts from the profile window's "
                  "shares applied to the run's decode time):", "",
                  "| format | wall | prefill | re-prefill | decode | of decode: attention | cache write | weights (GEMM) | "
                  "sampling | other kernels | host (Python, launches) | driver |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["rows"]:
            if r.get("skipped"):
                continue
            s, d = r["time_split"], r.get("decode_split_s", {})
            parts = [fmt_num(d.get(k), ".1f") for k in (*CLASSES, "host")]
            lines.append(f"| {r['format']} | {r['wall_s']:.1f} | {s['prefill_s']:.1f} | {s['reprefill_s']:.1f} | "
                         f"{s['decode_s']:.1f} | {' | '.join(parts)} | {s['driver_s']:.1f} |")
        graphs = {r["format"]: r["cuda_graphs"] for r in result["rows"] if not r.get("skipped")}
        if c["device"].startswith("cuda"):
            eager = [k for k, v in graphs.items() if not v]
            lines += ["", f"Decode ran as CUDA graphs (batch sizes {next(iter(graphs.values()), [])})"
                      + (f", except eagerly for {', '.join(eager)}." if eager else ".")]
        lines += ["", "Profile windows (per decode step, ms; the profiler's own callbacks inflate the host time, "
                  "which `benchmarks/engine_profile.py` measures without it):", ""]
        for r in result["rows"]:
            p = r.get("profile")
            if p and p.get("step_ms") is not None:
                lines.append(
                    f"- {r['format']}: {p['decode_steps']} decode steps at mean batch {p['mean_batch']:.1f} "
                    f"({p.get('source', 'in the CUDA-graph run')}): profiled step {p['step_ms']:.2f}, GPU busy "
                    f"{p['gpu_busy_ms']:.2f}, attention {p['attention_ms']:.2f}, cache write {p['cache_write_ms']:.2f}, "
                    f"GEMM {p['weights_ms']:.2f}, sampling "
                    f"{p['sampling_ms']:.2f}, other kernels {p['other_kernels_ms']:.2f}, host {p['host_ms']:.2f}; "
                    f"{p['kernels_seen']} kernels seen"
                    + f"; the run's unprofiled decode step at these batch sizes: {fmt_num(p.get('reference_step_ms'))}"
                )
            elif p is not None:
                why = p.get("error") or p.get("note") or "no decode step in the window"
                lines.append(f"- {r['format']}: no attention share measured ({why})")
    for name in ("sweep", "poisson"):
        rows = result.get(name, [])
        if not rows:
            continue
        lines += ["", f"## {name.capitalize()}: {c[name]['describe']}", ""] + table_lines(rows)
    if result.get("plot"):
        lines += ["", f"![serving pressure]({result['plot']})"]
    lines += ["", "## Targets", ""] + targets(result)
    return "\n".join(lines) + "\n"


def targets(result: dict) -> list[str]:
    """The issue's targets read off the headline rows, with the measured time split of the shortfall."""
    got = {r["format"]: r for r in result["rows"] if not r.get("skipped")}
    q, b, f = got.get("int4/int4"), got.get(BF16), got.get(FP8)
    if not q:
        return ["- no INT4/INT4 headline row"]
    out = [f"- INT4/INT4 preemptions: {q['preemptions']} (target 0), BF16 preemptions: "
           f"{b['preemptions'] if b else '-'} (must be > 0 for the budget to be a pressure point)"]
    if b:
        out.append(f"- INT4/INT4 output throughput {q['x_bf16']:.2f}x BF16 (target >= 5x)")
    if f:
        out.append(f"- INT4/INT4 output throughput {q['x_fp8_576']:.2f}x FP8-576 (target >= 1.8x)")
    rows = [r for r in result["rows"] if not r.get("skipped")]
    out.append("- requests finished / pages still allocated when each headline run ended: " + ", ".join(
        f"{r['format']} {r['requests_done']}/{r['requests']} / {r.get('pages_left_allocated', '-')}"
        + (" (cut by the time limit)" if r["cut"] else "") for r in rows))  # fmt: skip
    for r in (b, f, q):
        if not r:
            continue
        s = r["time_split"]
        out.append(
            f"- {r['format']}: {r['wall_s']:.1f} s = prefill {s['prefill_s']:.1f} + re-prefill {s['reprefill_s']:.1f} "
            f"+ decode {s['decode_s']:.1f} ({r['decode_steps']} steps at mean batch {r['mean_decode_batch']:.1f}, "
            f"{r['decode_step_ms']:.2f} ms each) + driver {s['driver_s']:.1f}"
        )
    return out


def plot(result: dict, path: str) -> str | None:
    rows = [r for r in result.get("sweep", []) if not r.get("skipped")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key in dict.fromkeys(r["format"] for r in rows):
        color = f"C{list(FORMATS).index(key)}"  # one color per format in both panels
        pts = sorted(((r["budget_fraction"], r) for r in rows if r["format"] == key), key=lambda p: p[0])
        xs = [x for x, _ in pts]
        ax1.plot(xs, [r["output_tok_s"] for _, r in pts], "o-", color=color, label=FORMATS[key].label)
        ratio = [(x, r["x_bf16"]) for x, r in pts if r.get("x_bf16") is not None]
        if ratio and key != BF16:
            ax2.plot(*zip(*ratio), "o-", color=color, label=FORMATS[key].label)
    for ax in (ax1, ax2):
        ax.set_xlabel("KV budget / bytes BF16 needs for the whole load")
        ax.axvline(result["config"]["headline"]["budget_fraction"], ls=":", color="gray", lw=0.8)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("output throughput / BF16's")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['config']['sweep']['describe']} ({result['card']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.basename(path)


def save(result: dict, out_dir: str, t_start: float, replot: bool = False) -> None:
    result["seconds"] = round(time.time() - t_start, 1)
    if replot:  # only when the sweep changed: a plot takes ~0.5 s
        result["plot"] = plot(result, os.path.join(out_dir, "serving_pressure.png"))
    with open(os.path.join(out_dir, "serving_pressure.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out_dir, "serving_pressure.md"), "w") as fh:
        fh.write(markdown(result))


# --- main -------------------------------------------------------------------------------------------------


class Deadline:
    """The whole run's time guard: a run is skipped when the longest run of its phase so far (or `guess`, for
    the first) would not fit, and no run may go on past the end (its own limit is cut to what is left)."""

    def __init__(self, seconds: float, guess: float):
        self.end, self.guess, self.longest = time.time() + seconds, guess, {}

    def remaining(self) -> float:
        return self.end - time.time()

    def allows(self, phase: str) -> bool:
        return 1.1 * self.longest.get(phase, self.guess) < self.remaining()

    def took(self, phase: str, seconds: float) -> None:
        self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a 2-layer model and small loads")
    ap.add_argument("--device", default=None,
                    help="default: cuda (cpu with --tiny); without a GPU the full run stops unless this is cpu")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"headline rows: {', '.join(FORMATS)} or any quantmla CONTENT/ROPE pair")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--budget-fraction", type=float, default=1 / 3, help="headline KV budget / BF16 load")
    ap.add_argument("--sweep", default="1.0,0.5,0.33,0.25", help="budget fractions ('' to skip the sweep)")
    ap.add_argument("--sweep-formats", default=f"{BF16},{FP8},int4/int4")
    ap.add_argument("--sweep-load", help="REQUESTSxPROMPT+OUTPUT of the sweep and Poisson runs, e.g. 32x4096+512")
    ap.add_argument("--poisson-rate", type=float, help="requests/s (0 to skip the Poisson runs)")
    ap.add_argument("--poisson-formats", default=f"{BF16},{FP8},int4/int4")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, help="default: each run's request count")
    ap.add_argument("--profile-steps", type=int, help="decode steps in the profile window (0: none)")
    ap.add_argument("--profile-mode", choices=("auto", "eager"), default="auto",
                    help="auto: profile the CUDA-graph run, an eager twin if it shows no attention kernel; "
                         "eager: always the twin")  # fmt: skip
    ap.add_argument("--time-limit", type=float, help="seconds per run; a run still going is cut and reported")
    ap.add_argument("--total-time-limit", type=float, help="seconds for everything; later runs are skipped")
    ap.add_argument("--window", help="SINK+RECENT BF16 tokens per sequence of the quantized formats (4+128)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # The tiny window is shorter than quantmla's 4 + 128 so that its prompts, too, are mostly quantized.
    # The tiny loads keep the headline's shapes: output = prompt / 8, and at 1/3 of the BF16 load the pool
    # holds exactly 3/8 of the prompts, which then must grow: BF16 preempts, INT4/INT4 has room.
    tiny = {"requests": 8, "prompt_len": 512, "output_len": 64, "sweep_load": "6x256+32", "poisson_rate": 100.0,
            "block_size": 16, "window": "4+8", "profile_steps": 3, "time_limit": 60.0,
            "total_time_limit": 300.0}  # fmt: skip
    full = {"requests": 64, "prompt_len": 8192, "output_len": 1024, "sweep_load": "32x4096+512", "poisson_rate": 4.0,
            "block_size": 64, "window": "4+128", "profile_steps": 12, "time_limit": 120.0,
            "total_time_limit": 470.0}  # fmt: skip
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def parse_load(spec: str, seed: int, rate: float = 0.0) -> Workload:
    m = re.fullmatch(r"(\d+)x(\d+)\+(\d+)", spec.strip())
    if not m:
        raise SystemExit(f"bad load {spec!r}: expected REQUESTSxPROMPT+OUTPUT, e.g. 32x4096+512")
    return Workload(int(m[1]), int(m[2]), int(m[3]), rate, seed)


def describe_load(w: Workload) -> str:
    arrive = f"Poisson arrivals at {w.rate:g} requests/s" if w.rate > 0 else "all arriving at t=0"
    return f"{w.requests} requests x {w.prompt_len}-token prompts x {w.output_len} output tokens, {arrive}"


def quantmla_format(key: str) -> Format:
    """Any other CONTENT/ROPE pair quantmla stores (e.g. a ranked format a calibration chose: int8r256/int4)."""
    try:
        content, rope = key.split("/")
        QuantFormat.parse(content), QuantFormat.parse(rope)
    except ValueError as e:
        raise SystemExit(f"unknown format {key!r} ({e}); known: {', '.join(FORMATS)} or any CONTENT/ROPE pair")
    return Format(key, f"quantmla {key}", content, rope, 4, 128)


def format_list(text: str, window: str) -> list[Format]:
    """The formats named in `text`; the quantized ones with the BF16 window `window` (SINK+RECENT)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    m = re.fullmatch(r"(\d+)\+(\d+)", window.strip())
    if not m:
        raise SystemExit(f"bad --window {window!r}: expected SINK+RECENT, e.g. 4+128")
    fmts = [FORMATS.get(k) or quantmla_format(k) for k in keys]
    return [replace(f, sink=int(m[1]), recent=int(m[2])) if f.sink + f.recent else f for f in fmts]


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.command = " ".join(["python", "benchmarks/serving_pressure.py"] + (sys.argv[1:] if argv is None else argv))
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("serving_pressure.py needs a CUDA GPU (--tiny: the CPU smoke run; --device cpu forces the full run "
                 "onto the CPU)")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # tiny ops gain nothing from threads, and spinning OpenMP workers slow them 10-100x
        torch.set_num_threads(1)
    try:
        return run_all(args, device)
    finally:
        torch.set_num_threads(threads)


def run_all(args: argparse.Namespace, device: torch.device) -> dict:
    base = TINY_MODEL if args.tiny else ModelSpec()
    spec = ModelSpec(**{**asdict(base), **{k: getattr(args, k) for k in ("layers", "hidden", "heads", "intermediate")
                                          if getattr(args, k) is not None}})  # fmt: skip
    head = Workload(args.requests, args.prompt_len, args.output_len, 0.0, args.seed)
    sweep_w = parse_load(args.sweep_load, args.seed)
    pois_w = parse_load(args.sweep_load, args.seed, args.poisson_rate)
    fractions = [float(x) for x in args.sweep.split(",") if x.strip()]
    fmts, sweep_fmts = format_list(args.formats, args.window), format_list(args.sweep_formats, args.window)
    pois_fmts = format_list(args.poisson_formats, args.window) if args.poisson_rate > 0 else []
    os.makedirs(args.out, exist_ok=True)
    t_start, deadline = time.time(), Deadline(args.total_time_limit, guess=min(args.time_limit, 20.0))

    t = time.time()
    model = build_model(spec, device, args.seed)
    params = param_counts(model)
    print(f"model built on {device} in {time.time() - t:.1f} s: {fmt_params(params['total'])} parameters, "
          f"{fmt_params(params['matmul_per_token'])} in the matmuls of every token (random bf16 weights: speed "
          f"does not depend on their values)", flush=True)  # fmt: skip
    engines = Engines(model, device, args.block_size, args.max_num_seqs, args.prefill_chunk)
    head_budget = budget_bytes(args.budget_fraction, head, spec, args.block_size)
    result = {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": args.command,
        "torch": torch.__version__,
        "decode_kernel": os.environ.get("QUANTMLA_DECODE_KERNEL", "auto"),
        "config": {
            "model": asdict(spec), "params": params, "device": str(device), "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs or "the run's request count", "prefill_chunk": args.prefill_chunk,
            "time_limit_s": args.time_limit, "total_time_limit_s": args.total_time_limit,
            "random_weights": "random bf16 weights; speed does not depend on their values",
            "windows": {f.key: (f"sink {f.sink} + recent {f.recent} BF16" if f.sink + f.recent else "none")
                        for f in format_list(",".join(FORMATS), args.window)},
            "headline": {**asdict(head), "describe": describe_load(head), "budget_fraction": args.budget_fraction,
                         "budget_bytes": head_budget, "bf16_load_bytes": bf16_load_bytes(head, spec, args.block_size)},
            "sweep": {**asdict(sweep_w), "describe": describe_load(sweep_w) + " (own budgets: fractions of its "
                      "BF16 load)", "fractions": fractions},
            "poisson": {**asdict(pois_w), "describe": describe_load(pois_w) + f" at budget fraction "
                        f"{args.budget_fraction:.3f} of its BF16 load"},
        },
        "rows": [], "sweep": [], "poisson": [], "plot": None,
    }  # fmt: skip
    try:
        result["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        pass

    def one(phase: str, fmt: Format, w: Workload, fraction: float, window: Window | None = None) -> dict:
        if not deadline.allows(phase):
            print(f"{phase} {fmt.key} @ {fraction:.2f}: skipped (--total-time-limit)", flush=True)
            return {"format": fmt.key, "budget_fraction": fraction, "skipped": "total time limit"}
        t = time.time()
        budget = budget_bytes(fraction, w, spec, args.block_size)
        prompts = prompts_for(w, spec.vocab)
        try:
            with engines.open(fmt, budget, w) as llm:
                built = time.time() - t
                run = drive(llm, w, prompts, min(args.time_limit, deadline.remaining()), window)
            del llm
        except Exception as e:  # one broken row must not lose the others
            traceback.print_exc()
            engines.release()
            print(f"{phase} {fmt.key} @ {fraction:.2f}: FAILED ({type(e).__name__}: {e})", flush=True)
            return {"format": fmt.key, "budget_fraction": fraction, "skipped": f"error: {type(e).__name__}: {e}"}
        engines.release()
        row = summarize(run, fmt, spec, w, fraction, budget)
        row["build_s"] = built
        deadline.took(phase, time.time() - t)
        eager = " EAGER DECODE (no CUDA graph)" if device.type == "cuda" and not row["cuda_graphs"] else ""
        print(f"{phase} {fmt.key:12s} @ {fraction:.2f}: pool {row['capacity_tokens']} tok, {row['preemptions']} "
              f"preemptions, {row['output_tok_s']:.0f} tok/s, peak batch {row['peak_batch']}, wall "
              f"{row['wall_s']:.1f} s (+{built:.1f} s build){' CUT' if row['cut'] else ''}{eager}",
              flush=True)  # fmt: skip
        return row

    # 1. Headline: every format at one budget, with a profile window per row.
    for fmt in fmts:
        want = args.profile_steps > 0
        window = Window(args.profile_steps, device.type == "cuda") if want and args.profile_mode == "auto" else None
        row = one("headline", fmt, head, args.budget_fraction, window)
        p = row.get("profile")
        needs_twin = want and not row.get("skipped") and (
            args.profile_mode == "eager" or (device.type == "cuda" and (p or {}).get("attention_share") is None))
        if needs_twin and deadline.allows("twin"):
            t = time.time()
            prompts = prompts_for(head, spec.vocab)
            try:
                twin = profile_twin(engines, fmt, head_budget, head, prompts, max(row["peak_batch"], 1),
                                    args.profile_steps, min(args.time_limit, deadline.remaining()))  # fmt: skip
            except Exception as e:
                traceback.print_exc()
                engines.release()
                twin = {"error": f"eager twin failed: {type(e).__name__}: {e}", "attention_share": None}
            deadline.took("twin", time.time() - t)
            apply_profile(row, twin)
        result["rows"].append(row)
        add_ratios(result["rows"])
        save(result, args.out, t_start)

    # 2. Sweep of budgets on the sweep load.
    for fraction in fractions:
        rows = [one("sweep", fmt, sweep_w, fraction) for fmt in sweep_fmts]
        add_ratios(rows)
        result["sweep"] += rows
        save(result, args.out, t_start, replot=True)

    # 3. Poisson arrivals at the headline fraction.
    for fmt in pois_fmts:
        result["poisson"].append(one("poisson", fmt, pois_w, args.budget_fraction))
        add_ratios(result["poisson"])
        save(result, args.out, t_start)

    save(result, args.out, t_start)
    rich_tables(result)
    print("\n".join(targets(result)))
    print(f"wrote {os.path.join(args.out, 'serving_pressure.md')} ({time.time() - t_start:.0f} s)")
    return result


if __name__ == "__main__":
    main()
