"""The quantizer part of quantmla's search space: which cache formats calibration may choose, per path and
layer, besides the transform.

Calibration fits each path's transform for the requested format, then scores every (transform, format)
point below with real quantization on the selection sequences and keeps the best. The transforms scored
are the identity (with the requested format: plain RTN; with a token-axis format: KIVI), SmoothQuant's
migration and the fitted one, so RTN, SmoothQuant and (with `token_axis`) KIVI are points of the space and
on the selection data the choice is never worse than any of them.

Servable: every point except token-axis ones is a channel-grouped integer format that the paged cache
(`cache/paged.py`), its fused writer and the decode kernel serve (a clipping ratio changes only how the
writers pick scale and zero). Token-axis (KIVI-style) points need per-channel scales per page and BF16
staging there, which is not built: they are tried only when asked (`token_axis=True`) and the paged cache
refuses them with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.cache.paged import PAGED_KINDS
from quantmla.config import CLIPS, QuantFormat
from quantmla.quant.formats import bytes_per_token

KIVI_TOKENS = 64


@dataclass(frozen=True)
class SearchSpace:
    """clips: clipping ratios tried per path and layer (1.0: none). token_axis: also KIVI-style blocks of
    `kivi_tokens` tokens at the same bits (not servable by the paged engine)."""

    clips: tuple[float, ...] = CLIPS
    token_axis: bool = False
    kivi_tokens: int = KIVI_TOKENS

    def formats(self, base: QuantFormat, dim: int) -> list[QuantFormat]:
        """The formats tried for a path of `dim` channels asked to be stored as `base`: base itself first,
        then base with every clipping ratio, then (token_axis) the token-axis format of the same bits with
        every ratio, kept only where it takes no more bytes per token than base. Non-integer formats: base."""
        if not base.is_integer:
            return [base]
        out = [QuantFormat(base.kind, base.group, base.axis, c) for c in (base.clip, *self.clips)]
        if self.token_axis and base.axis == "channel":
            token = [QuantFormat(base.kind, self.kivi_tokens, "token", c) for c in (1.0, *self.clips)]
            out += [f for f in token if bytes_per_token(f, dim) <= bytes_per_token(base, dim)]
        return list(dict.fromkeys(out))  # unique, in order

    @staticmethod
    def servable(fmt: QuantFormat) -> bool:
        """Whether the paged engine (cache/paged.py, the fused writer, the decode kernel) serves fmt."""
        return fmt.axis == "channel" and fmt.kind in PAGED_KINDS
