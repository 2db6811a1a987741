"""quantmla: path-aware quantization of the Multi-head Latent Attention KV cache.

The cache of an MLA layer holds, per token, a content latent `c` (kv_lora_rank dims) and a post-RoPE key
`k_pe` (qk_rope_head_dim dims). quantmla stores both in low precision, each with its own transform and format.
"""

from quantmla.config import CacheConfig, QuantFormat

__version__ = "0.1.0"
__all__ = ["CacheConfig", "QuantFormat", "__version__"]
