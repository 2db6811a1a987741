"""One MLA layer's decode step over the paged, packed cache: the call an engine makes per layer per step.

    out = decode_step(attn, layer, hidden, position_embeddings, cache, block_tables, seq_lens, slots)

`attn` is the model's own attention module (any family `quantmla.models.adapters.describe` knows) and
`layer` its `MLALayer`; `hidden` [B, 1, hidden] is the attention's input for the new token of each sequence
and `position_embeddings` what the model passes its attention for that token, whose position is seq_lens (the
cache holds positions 0..seq_lens-1; it also gives a Mistral 4 query its position factor). The step
  1. projects the new token's cache entry (c, k_pe) exactly as the model would cache it and appends it to
     `cache` (`PagedMLACache.append_decode`: quantized as tokens leave the BF16 window, a token-axis
     path's block once all of it has),
  2. projects the queries, absorbs W_uk into them (q~ = W_uk^T q_nope),
  3. attends over the grown cache: the Triton kernel (`mla_decode`: dequantization inside) on CUDA, the
     plain-torch `mla_decode_reference` elsewhere (`kernel="triton"` forces the kernel, e.g. under
     TRITON_INTERPRET=1 on the CPU; `kernel="reference"` the oracle),
  4. applies W_uv and o_proj,
and returns the attention output [B, 1, hidden], i.e. what `attn(...)[0]` returns for that token.
With checked=False and max_seq_len given nothing reads device data on the host: the step can be captured
in a CUDA graph. The plain-torch oracle is `quantmla.mla.attention_from_cache` on `cache.gather(...)`.
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.cache.paged import PagedMLACache
from quantmla.kernels.cache_write import append_decode_fused
from quantmla.kernels.mla_decode import mla_decode, mla_decode_reference
from quantmla.mla import absorb_queries, project_cache, project_queries, split_kv_b
from quantmla.models.adapters import MLALayer


@torch.no_grad()
def decode_step(
    attn: nn.Module,
    layer: MLALayer,
    hidden: torch.Tensor,
    position_embeddings,
    cache: PagedMLACache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    checked: bool = True,
    kernel: str = "auto",
) -> torch.Tensor:
    """Append the new token of each sequence to `cache` and return the attention output [B, 1, hidden].

    seq_lens [B] int32: tokens cached *before* this step (the kernel then sees seq_lens + 1); block_tables
    [B, max_blocks] int32 must already cover the new token. max_seq_len bounds seq_lens + 1 (None: read on
    the host). checked=False skips the writer's NaN/range checks (see `quantmla.quant.formats.quantize`).
    kernel: "auto" (`mla_decode` on CUDA tensors, which runs the Triton, CUDA or many-heads kernel,
    `decode_kernel_name`; the torch reference otherwise), "triton" (`mla_decode` anywhere, e.g. under
    TRITON_INTERPRET=1) or "reference".
    """
    if kernel not in ("auto", "triton", "reference"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'reference', got {kernel!r}")
    if hidden.dim() != 3 or hidden.shape[1] != 1:
        raise ValueError(f"decode_step takes one new token per sequence: hidden [B, 1, hidden], "
                         f"got {tuple(hidden.shape)}")
    c, k_pe = project_cache(attn, layer, hidden, position_embeddings)
    use_triton = kernel == "triton" or (kernel == "auto" and hidden.is_cuda)
    # The fused writer (one Triton launch, byte-identical to the torch writer) when unchecked; checked writes
    # read the data on the host anyway and go through PagedMLACache.append_decode.
    write = append_decode_fused if use_triton else PagedMLACache.append_decode
    write(cache, slots, block_tables, seq_lens, c[:, 0], k_pe[:, 0], checked=checked)
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings, seq_lens[:, None])
    w_uk, w_uv = split_kv_b(attn, layer)
    # In the weights' own dtype: no per-step fp32 copies of W_uk / W_uv (the kernel rounds q to bf16 anyway).
    q_abs = absorb_queries(q_nope, w_uk)[:, :, 0]
    if use_triton:
        latent, _ = mla_decode(q_abs, q_pe[:, :, 0], cache, block_tables, seq_lens + 1, slots,
                               layer.softmax_scale, max_seq_len=max_seq_len)  # fmt: skip
    else:
        latent, _ = mla_decode_reference(q_abs, q_pe[:, :, 0], cache, block_tables, seq_lens + 1, slots,
                                         layer.softmax_scale, dtype=torch.float32)  # fmt: skip
    heads = torch.einsum("bhc,hvc->bhv", latent.to(w_uv.dtype), w_uv).flatten(1).to(hidden.dtype)
    return attn.o_proj(heads)[:, None]
