"""Model adapters: turn a Hugging Face MLA model into one `MLALayer` description per attention."""

from quantmla.models.adapters import (
    FAMILIES,
    MLALayer,
    UnsupportedModelError,
    attention_module,
    describe,
    load_model,
    query_weight,
)

__all__ = ["FAMILIES", "MLALayer", "UnsupportedModelError", "attention_module", "describe", "load_model",
           "query_weight"]
