"""Triton kernels, each a @triton.jit + a thin launcher with its plain-torch reference beside it.

`mla_decode` (alias `decode`): absorbed-MLA decode over a `quantmla.cache.paged.PagedMLACache`.
"""

from quantmla.kernels.mla_decode import KernelConfig, decode, default_config, mla_decode, mla_decode_reference

__all__ = ["KernelConfig", "decode", "default_config", "mla_decode", "mla_decode_reference"]
