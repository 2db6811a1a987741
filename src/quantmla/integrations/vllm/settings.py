"""Which cache a model served by vLLM gets: the one switch the plugin reads.

Precedence (first that applies):
  1. the environment variable QUANTMLA_VLLM_CACHE, for uncalibrated models (RTN formats) or to override:
       "bf16"                          no quantization (quantmla's backend, BF16 pool)
       "int4,int4"                     content, rope formats (any `QuantFormat` spelling: int2, int4:32, fp8)
       "int2,int4,sink=4,recent=128"   with the window spelled out (defaults: sink 4, recent 128)
  2. the `quantmla` section of the checkpoint's config.json (what `quantmla calibrate` writes), read from the
     model's Hugging Face config, so a calibrated checkpoint needs no flag at all;
  3. otherwise bf16.
"""

from __future__ import annotations

import os

from quantmla.config import CacheConfig

ENV = "QUANTMLA_VLLM_CACHE"


def parse_spec(spec: str) -> CacheConfig:
    """QUANTMLA_VLLM_CACHE's value -> CacheConfig. Raises ValueError with the expected spelling."""
    # Case and spaces as the formats take them (QuantFormat.parse): "BF16" and "sink = 8" were refused.
    parts = [p.strip().lower() for p in spec.split(",") if p.strip()]
    formats = [p for p in parts if "=" not in p]
    options = {k.strip(): v.strip() for k, v in (p.split("=", 1) for p in parts if "=" in p)}
    if formats == ["bf16"] and not options:
        return CacheConfig.bf16()
    unknown = set(options) - {"sink", "recent"}
    if len(formats) != 2 or unknown or not all(v.isdigit() for v in options.values()):
        raise ValueError(f"{ENV}={spec!r}: expected 'bf16' or 'CONTENT,ROPE[,sink=N,recent=N]', "
                         f"e.g. 'int4,int4' or 'int2,int4,sink=4,recent=128'")
    return CacheConfig(formats[0], formats[1], int(options.get("sink", 4)), int(options.get("recent", 128)))


def cache_config_for(hf_config) -> tuple[CacheConfig, str]:
    """(the cache config, where it came from) for a model whose Hugging Face config is `hf_config`."""
    spec = os.environ.get(ENV, "").strip()
    if spec:
        return parse_spec(spec), f"{ENV}={spec}"
    section = getattr(hf_config, "quantmla", None)
    if isinstance(section, dict):
        return CacheConfig.from_dict(section), "the checkpoint's quantmla section"
    return CacheConfig.bf16(), "default (no quantmla section, no " + ENV + ")"


def quantization_asked(hf_config) -> str | None:
    """Who asked for a quantized cache (so that a model vLLM does not run as MLA is an error rather than
    served in BF16 unnoticed): QUANTMLA_VLLM_CACHE other than "bf16", else the checkpoint's quantmla
    section; None if nobody did."""
    spec = os.environ.get(ENV, "").strip()
    if spec:
        return None if parse_spec(spec) == CacheConfig.bf16() else f"{ENV}={spec}"
    section = getattr(hf_config, "quantmla", None)
    if isinstance(section, dict) and CacheConfig.from_dict(section).per_layer != CacheConfig.bf16().per_layer:
        return "the checkpoint's quantmla section"
    return None
