"""The quantization rule (quantmla.policy): its two views agree, and QuantMLACache stages by it."""

import pytest
import torch

from quantmla.cache import QuantMLACache
from quantmla.config import CacheConfig, QuantFormat
from quantmla.policy import NEVER, block_of, quantized_end, ring_size, stored_from


@pytest.mark.parametrize("fmt", ["int4", "int4:t4", "int2:t8", "bf16"])
@pytest.mark.parametrize("sink,recent", [(0, 0), (3, 0), (2, 5), (0, 3)])
def test_stored_from_is_the_first_query_whose_cache_has_the_key_quantized(fmt, sink, recent):
    fmt = QuantFormat.parse(fmt)
    n = 40
    sf = stored_from(fmt, sink, recent, n)
    for t in range(n):
        q = quantized_end(t + 1, sink, recent, block_of(fmt))
        assert q == int(quantized_end(torch.tensor(t + 1), sink, recent, block_of(fmt)))
        assert t + 1 - q <= ring_size(recent, block_of(fmt)) or t + 1 <= sink
        if fmt.kind != "bf16":
            assert [bool(sf[p] <= t) for p in range(t + 1)] == [sink <= p < q for p in range(t + 1)], t
    if fmt.kind == "bf16":
        assert torch.all(sf == NEVER)


@pytest.mark.parametrize("chunks", [[1] * 30, [7, 1, 13, 9], [30]])
def test_quant_cache_quantizes_what_the_rule_says(chunks):
    cfg = CacheConfig("int4:t4", "int4:8", sink=2, recent=3)
    cache = QuantMLACache(cfg, num_layers=1)
    length = 0
    for n in chunks:
        cache.update(torch.randn(1, 1, n, 16), torch.randn(1, 1, n, 8), 0)
        length += n
        layer = cache.layers[0]
        assert layer.content.n_body == quantized_end(length, 2, 3, 4) - 2
        assert layer.rope.n_body == quantized_end(length, 2, 3, 1) - 2
        assert layer.get_seq_length() == length


@pytest.mark.parametrize("block", [1, 3, 8])
@pytest.mark.parametrize("sink,recent", [(0, 0), (4, 0), (2, 5), (0, 6)])
def test_quantized_end_is_what_token_by_token_staging_gives(block, sink, recent):
    """The rule against its plain statement, simulated: tokens arrive one at a time; a token past the sink
    that drops out of the last `recent` is staged, and every `block` staged tokens are quantized together."""
    staged = quantized = 0
    for length in range(1, 60):
        if length - recent - 1 >= sink:  # position length - recent - 1 just left the window
            staged += 1
            if staged == block:
                quantized, staged = quantized + block, 0
        assert quantized_end(length, sink, recent, block) == sink + quantized, length
