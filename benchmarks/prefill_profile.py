"""Where the engine's prefill of one 8K-token prompt spends its time, quantized (INT4/INT4) vs BF16 cache.

    PYTHONPATH=src python benchmarks/prefill_profile.py        # CUDA GPU; prints per-range CPU and GPU time

V2-Lite-geometry model with random bf16 weights (as benchmarks/serving_pressure.py), one 8192-token prompt
prefilled in 2048-token chunks after a warm-up prompt, under torch.profiler with ranges around the pool write
(Q_append), the history read (Q_gather), the attention (Q_sdpa) and the whole prefill attention of a layer.
Results: benchmarks/results/prefill_profile.md.
"""
import time, torch
from torch.profiler import profile, ProfilerActivity, record_function
from transformers import DeepseekV2Config, AutoModelForCausalLM
import quantmla.engine.attention as A
from quantmla.engine import LLM, SamplingParams
# Label the pieces of the prefill for the profiler (wrappers in this script only; the library is unchanged).
import quantmla.cache.paged as P
for name in ["append", "gather"]:
    f = getattr(P.PagedMLACache, name)
    def w(self, *a, _f=f, _n=name, **k):
        with record_function("Q_" + _n): return _f(self, *a, **k)
    setattr(P.PagedMLACache, name, w)
sd = A.F.scaled_dot_product_attention
def sdpa(*a, **k):
    with record_function("Q_sdpa"): return sd(*a, **k)
A.F.scaled_dot_product_attention = sdpa
pa = A.prefill_attention
def pa2(*a, **k):
    with record_function("Q_prefill_attention"): return pa(*a, **k)
A.prefill_attention = pa2
cfg = DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=27, max_position_embeddings=16384)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
for fmt in [("int4","int4"), ("bf16","bf16")]:
    llm = LLM(model, content=fmt[0], rope=fmt[1], kv_cache_bytes=8 << 30, max_num_seqs=4, cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(2): llm.add_request(torch.randint(0, 102400, (8192,), generator=g).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
    seqs, _ = llm.scheduler.schedule()
    llm.runner.prefill(seqs[:1]); torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        llm.runner.prefill(seqs[1:2]); torch.cuda.synchronize()
    print(fmt, "8K prefill wall", time.perf_counter() - t)
    for e in prof.key_averages():
        if e.key.startswith("Q_") or e.key in ("aten::mm", "aten::_cudnn_attention_forward", "aten::nonzero", "aten::index_put_", "aten::copy_", "aten::cat"):
            print(f"   {e.key:32s} n={e.count:6d} cpu_total={e.cpu_time_total/1e3:8.1f}ms dev_total={e.device_time_total/1e3:8.1f}ms")
    llm.close()
    del llm; torch.cuda.empty_cache()
