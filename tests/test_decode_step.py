"""`decode_step` — the per-layer call an engine makes — on real transformers model classes, kernel included.

Each tiny model runs its own forward over a prompt plus one more token (capturing what every attention saw,
returned and cached); the prompt's cache entries go into a `PagedMLACache`, then `decode_step` handles the
last token: it must cache that token as the model did and return the model's attention output for it (BF16
cache), or the oracle's on the dequantized cache (INT4 cache). Without a GPU the Triton kernel runs under
TRITON_INTERPRET=1.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the decode kernel needs triton")

from quantmla.cache.paged import PagedMLACache, make_block_tables  # noqa: E402
from quantmla.capture import capture  # noqa: E402
from quantmla.config import CacheConfig  # noqa: E402
from quantmla.decode_step import decode_step  # noqa: E402
from quantmla.mla import attention_from_cache  # noqa: E402
from quantmla.models.adapters import attention_module, describe, query_weight  # noqa: E402
from quantmla.models.tiny import TINY_FAMILIES, tiny_model  # noqa: E402

B, T, PAGE = 2, 37, 16  # the INT4 body (positions 2..28) crosses a page
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def at(pe, t):
    """The position embeddings of token t only ((cos, sin) or complex freqs, [B, T, ...])."""
    return tuple(x[:, t : t + 1] for x in pe) if isinstance(pe, tuple) else pe[:, t : t + 1]


def rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("kernel", ["triton", "reference"])
# ("int2:t8", "int4:t4"): token-axis paths of different blocks; the step completes a rope block (34..37).
@pytest.mark.parametrize("fmts", [("bf16", "bf16"), ("int4", "int4"), ("int2:t8", "int4:t4")],
                         ids=lambda f: "-".join(f))
@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f != "axk1"])  # axk1: deepseek_v3's attention
def test_decode_step_matches_the_model(family, fmts, kernel, one_thread):
    model = tiny_model(family).to(DEV)
    layers = describe(model)
    if DEV == "cuda" and layers[0].rope_dim < 16:  # tensor-core tiles need 16 (real models have >= 32)
        model = tiny_model(family, qk_rope_head_dim=16).to(DEV)
        layers = describe(model)
    with torch.no_grad():  # peaked attention: random tiny models attend almost uniformly, which hides scale bugs
        for layer in layers:
            query_weight(attention_module(model, layer), layer).weight.mul_(8)
    ids = torch.randint(0, model.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(3))
    seen = capture(model, layers, ids.to(DEV))
    tables, nb = make_block_tables([T + 1] * B, PAGE)
    tables = tables.to(DEV)
    seq_lens = torch.full((B,), T, dtype=torch.int32, device=DEV)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEV)  # sequence b lives in slot 1 - b
    for layer in layers:
        s, attn = seen[layer.cache_idx], attention_module(model, layer)
        cfg = CacheConfig(*fmts, sink=2, recent=8).fit(layer.kv_lora_rank, layer.rope_dim)
        cache = PagedMLACache.allocate(cfg, layer.kv_lora_rank, layer.rope_dim, nb, B, block_size=PAGE,
                                       device=DEV, fill=float("nan"))  # fmt: skip
        for b in range(B):
            cache.append(int(slots[b]), tables[b], 0, s.c[b, :T], s.k_pe[b, :T])
        pe = at(s.position_embeddings, T)
        out = decode_step(attn, layer, s.hidden[:, T:], pe, cache, tables, seq_lens, slots, max_seq_len=T + 1,
                          kernel=kernel)
        views = [cache.gather(int(slots[b]), tables[b], T + 1) for b in range(B)]
        c, k_pe = (torch.stack(v) for v in zip(*views))
        # The new token is cached as the model caches it (in BF16: the window, or the bf16 pool).
        assert rel(c[:, T], s.c[:, T]) < 4e-3 and rel(k_pe[:, T], s.k_pe[:, T]) < 4e-3
        # The output: the model's own (BF16 cache) or the oracle's on the dequantized cache (INT4). The
        # kernel's bf16 operands (truncated, in the interpreter) leave 0.1-1 %; a 5 % error in the softmax
        # scale costs 1.6-3.6 % on the families with the most peaked attention.
        oracle = attention_from_cache(attn, layer, s.hidden[:, T:], pe, c, k_pe, positions=s.positions[:, T:])[0]
        assert rel(out, s.output[:, T:] if fmts[0] == "bf16" else oracle) < 1.5e-2
        if fmts[0] != "bf16":  # and the INT4 cache is not a no-op: the model's own output is further away
            assert rel(out, s.output[:, T:]) > 2 * rel(out, oracle)


def test_decode_step_takes_one_token():
    model = tiny_model("deepseek_v3")
    layer = describe(model)[0]
    with pytest.raises(ValueError, match="one new token per sequence"):
        decode_step(attention_module(model, layer), layer, torch.zeros(B, 2, 64), None, None, None, None, None)


@pytest.mark.skipif(DEV != "cuda", reason="needs a GPU: CUDA graphs")
def test_decode_step_replays_as_a_cuda_graph():
    """checked=False + max_seq_len: the whole layer step (projections, cache write, kernel, o_proj) is
    captured once and its replay equals the eager step, cache bytes included."""
    model = tiny_model("deepseek_v3").to(DEV)
    layer = describe(model)[0]
    attn = attention_module(model, layer)
    ids = torch.randint(0, model.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(3))
    s = capture(model, [layer], ids.to(DEV))[layer.cache_idx]
    tables, nb = make_block_tables([T + 1] * B, PAGE)
    tables, slots = tables.to(DEV), torch.arange(B, dtype=torch.int32, device=DEV)
    seq_lens = torch.full((B,), T, dtype=torch.int32, device=DEV)
    caches = []
    for _ in range(2):
        cfg = CacheConfig("int4", "int4", sink=2, recent=8).fit(layer.kv_lora_rank, layer.rope_dim)
        cache = PagedMLACache.allocate(cfg, layer.kv_lora_rank, layer.rope_dim, nb, B, block_size=PAGE, device=DEV)
        for b in range(B):
            cache.append(b, tables[b], 0, s.c[b, :T], s.k_pe[b, :T])
        caches.append(cache)
    hidden, pe = s.hidden[:, T:].clone(), tuple(x.clone() for x in at(s.position_embeddings, T))
    step = lambda cache: decode_step(attn, layer, hidden, pe, cache, tables, seq_lens, slots,  # noqa: E731
                                     max_seq_len=T + 1, checked=False)  # fmt: skip
    want = step(caches[0])  # eager (also compiles the kernel before the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(caches[1])
    graph.replay()
    torch.cuda.synchronize()
    assert rel(got, want) < 1e-6  # same kernels; cuBLAS may pick another algorithm under capture
    for a, b in zip(caches[0].content.tensors() + caches[0].rope.tensors(),
                    caches[1].content.tensors() + caches[1].rope.tensors()):  # fmt: skip
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(caches[0].protected_content, caches[1].protected_content)
