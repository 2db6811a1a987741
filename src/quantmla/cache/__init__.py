"""The transformers Cache adapter: stores the two MLA cache paths in their formats and returns them."""

from quantmla.cache.quant_cache import PathStore, QuantMLACache, QuantMLALayer, left_pads

__all__ = ["PathStore", "QuantMLACache", "QuantMLALayer", "left_pads"]
