"""The quantizer part of quantmla's search space: which cache formats calibration may choose, per path and
layer, besides the transform.

Calibration fits each path's transform for the requested format, then scores every (transform, format)
point below with real quantization on the selection sequences and keeps the best. The transforms scored
are the identity (with the requested format: plain RTN; with a token-axis format: KIVI), SmoothQuant's
migration and the fitted one, so RTN, SmoothQuant and KIVI are points of the space and on the selection
data the choice is never worse than any of them.

Servable: every point is a format the paged cache (`cache/paged.py`), its writers and the decode kernel
serve: channel-grouped integer formats (a clipping ratio changes only how the writers pick scale and zero)
and, with `token_axis=True` (`quantmla calibrate --token-axis`), token-axis (KIVI-style) ones, whose
blocks of `kivi_tokens` tokens must divide the engine's page (`PAGE`, its default block size). Those are
opt-in: on the GPU the decode kernel serves only a token-axis RoPE path at few heads (see SearchSpace).
vLLM's plugin stores one packed row per token and so serves channel formats only.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.cache.paged import PAGED_KINDS
from quantmla.config import CLIPS, CacheConfig, QuantFormat
from quantmla.policy import quantized_end
from quantmla.quant.formats import bytes_per_token

KIVI_TOKENS = 64
PAGE = 64  # the engine's default page (`LLM(block_size=...)`): token-axis blocks must divide it


@dataclass(frozen=True)
class SearchSpace:
    """clips: clipping ratios tried per path and layer (1.0: none). token_axis: also KIVI-style blocks of
    `kivi_tokens` tokens at the same bits (opt-in: the engine serves them on the CPU and, at few heads, a
    token-axis RoPE path on the GPU, slowly; the GPU decode kernel runs out of shared memory on a
    token-axis content path and at 128 heads (benchmarks/results/decode_kernel_formats.md); not the vLLM
    plugin)."""

    clips: tuple[float, ...] = CLIPS
    token_axis: bool = False
    kivi_tokens: int = KIVI_TOKENS

    def formats(self, base: QuantFormat, dim: int, first_query: int | None = None,
                cfg: CacheConfig | None = None) -> list[QuantFormat]:
        """The formats tried for a path of `dim` channels asked to be stored as `base`: base itself first,
        then base with every clipping ratio, then (token_axis) the token-axis format of the same bits with
        every ratio, kept only where it takes no more bytes per token than base and, given the first scored
        query position and cfg's window, where that query already sees a quantized block (in shorter
        calibration sequences a token-axis point would score 0 for quantizing nothing). Non-integer
        formats: base."""
        if not base.is_integer:
            return [base]
        out = [QuantFormat(base.kind, base.group, base.axis, c) for c in (base.clip, *self.clips)]
        seen = first_query is None or quantized_end(first_query + 1, cfg.sink, cfg.recent, self.kivi_tokens) > cfg.sink
        if self.token_axis and base.axis == "channel" and seen:
            token = [QuantFormat(base.kind, self.kivi_tokens, "token", c) for c in (1.0, *self.clips)]
            out += [f for f in token if bytes_per_token(f, dim) <= bytes_per_token(base, dim)]
        return list(dict.fromkeys(out))  # unique, in order

    @staticmethod
    def servable(fmt: QuantFormat, page: int = PAGE) -> bool:
        """Whether the paged engine (cache/paged.py, its writers, the decode kernel) serves fmt with pages of
        `page` tokens."""
        return fmt.kind in PAGED_KINDS and (fmt.axis == "channel" or page % fmt.group == 0)
