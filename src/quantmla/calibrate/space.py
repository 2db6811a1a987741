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
vLLM's plugin stores one packed row per token and so serves channel formats only (ranked ones included).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from quantmla.cache.paged import PAGED_KINDS
from quantmla.config import CLIPS, CacheConfig, QuantFormat
from quantmla.policy import quantized_end
from quantmla.quant.formats import bytes_per_token

KIVI_TOKENS = 64
PAGE = 64  # the engine's default page (`LLM(block_size=...)`): token-axis blocks must divide it


def ranked_formats(base: QuantFormat, dim: int) -> list[QuantFormat]:
    """For each integer kind with at least base's bits, the ranked format (base's group) of the most channels
    whose bytes per token do not exceed base's, where that is fewer than `dim`: e.g. for int2 over 512
    channels int8r128 (136 B) and int4r256 (144 B) against int2's 160 B. More stored channels at the same bits
    are never worse, so the widest that fits is the one to try."""
    out, limit = [], bytes_per_token(base, dim)
    for kind in ("int8", "int4", "int2"):
        fmt = QuantFormat(kind, base.group)
        if fmt.bits < base.bits or fmt.bits == base.bits and not base.rank:
            continue
        fits = [r for r in range(base.group, dim, base.group)  # whole bytes of codes: int4/int2 pack 2/4 a byte
                if r * fmt.bits % 8 == 0 and bytes_per_token(replace(fmt, rank=r), dim) <= limit]
        if fits:
            out.append(replace(fmt, rank=fits[-1]))
    return out


@dataclass(frozen=True)
class SearchSpace:
    """clips: clipping ratios tried per path and layer (1.0: none). token_axis: also KIVI-style blocks of
    `kivi_tokens` tokens at the same bits (opt-in: the engine serves them on the CPU and GPU, but the GPU
    kernel reads them slowly, benchmarks/results/decode_kernel_token_axis.md; not the vLLM plugin).
    ranked: on the content path also ranked formats of no more bytes (`ranked_formats`; channel formats,
    served everywhere; on the GPU only the Triton decode kernel reads them).
    rope_judge: what the RoPE path's points are scored on, "output" (the attention output, as the content
    path) or "qk" (the positional QK error it is fitted on; see `calibrate.rope`)."""

    clips: tuple[float, ...] = CLIPS
    token_axis: bool = False
    kivi_tokens: int = KIVI_TOKENS
    ranked: bool = True
    rope_judge: str = "output"

    def __post_init__(self):
        if self.rope_judge not in ("output", "qk"):
            raise ValueError(f"rope_judge must be 'output' or 'qk', got {self.rope_judge!r}")
        for clip in self.clips:  # here, not first at layer 0's search (after the model load)
            if not 0 < clip <= 1:
                raise ValueError(f"clipping ratio must be in (0, 1], got {clip}")

    def formats(self, base: QuantFormat, dim: int, first_query: int | None = None,
                cfg: CacheConfig | None = None, ranked: bool = False) -> list[QuantFormat]:
        """The formats tried for a path of `dim` channels asked to be stored as `base`: base itself first,
        then base with every clipping ratio, then (token_axis) the token-axis format of the same bits with
        every ratio, kept only where it takes no more bytes per token than base and, given the first scored
        query position and cfg's window, where that query already sees a quantized block (in shorter
        calibration sequences a token-axis point would score 0 for quantizing nothing); then, where the
        caller's path can drop channels (`ranked`: the content path, whose rotation is free) and self.ranked,
        `ranked_formats` with every ratio. Non-integer formats: base."""
        if not base.is_integer:
            return [base]
        out = [replace(base, clip=c) for c in (base.clip, *self.clips)]
        seen = first_query is None or quantized_end(first_query + 1, cfg.sink, cfg.recent, self.kivi_tokens) > cfg.sink
        if self.token_axis and base.axis == "channel" and seen:
            token = [QuantFormat(base.kind, self.kivi_tokens, "token", c) for c in (1.0, *self.clips)]
            out += [f for f in token if bytes_per_token(f, dim) <= bytes_per_token(base, dim)]
        if ranked and self.ranked and base.axis == "channel":
            out += [replace(f, clip=c) for f in ranked_formats(base, dim) for c in (1.0, *self.clips)]
        return list(dict.fromkeys(out))  # unique, in order

    @staticmethod
    def servable(fmt: QuantFormat, page: int = PAGE) -> bool:
        """Whether the paged engine (cache/paged.py, its writers, the decode kernel) serves fmt with pages of
        `page` tokens."""
        return fmt.kind in PAGED_KINDS and (fmt.axis == "channel" or page % fmt.group == 0)
