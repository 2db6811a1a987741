"""Triton kernels, each a @triton.jit + a thin launcher with its plain-torch reference beside it.

`mla_decode` (alias `decode`): absorbed-MLA decode over a `quantmla.cache.paged.PagedMLACache`; a whole
layer's decode step around it (projections, cache write, o_proj) is `quantmla.decode_step.decode_step`.
"""

from quantmla.kernels.mla_decode import KernelConfig, decode, default_config, mla_decode, mla_decode_reference

__all__ = ["KernelConfig", "decode", "default_config", "mla_decode", "mla_decode_reference"]
