"""quantmla's MLA attention backend for vLLM, the platform-independent part (the classes vLLM loads are in
`cpu` and `cuda`, each mixing this into vLLM's MLA backend of its platform): the packed cache of `layout`, the serving policy of
`quantmla.cache.paged` (sink + recent tokens in BF16, each token quantized exactly when it leaves the recent
window), decode over it, prefill over BF16.

What runs where, per layer and step (vLLM's `MLAAttention.forward` calls these in this order):
  do_kv_cache_update  the step's new tokens (c, k_pe) go into the cache: decode rows through
                      `PagedMLACache.append_decode`, each prefill through `PagedMLACache.append`;
  forward_mha         prefill: vLLM's own attention over the prompt's BF16 c/k_pe (no cache read; a
                      prefill that continues cached context, i.e. chunked prefill or a prefix-cache hit,
                      is refused: it would need vLLM's BF16 gather);
  forward_mqa         decode: absorbed queries (vLLM computes them) against the cache, through
                      `mla_decode_reference` (torch, the kernel's oracle) on the CPU and `mla_decode` (the
                      Triton kernel `decode_step` uses) on CUDA.
The metadata builder adds `quantmla_slots` (int32 [num_reqs], each request's protected-row slot from
`slots.SlotTable`) and the per-request host lists the writers need.

vLLM's kv_cache_dtype stays "auto": the formats come from `settings.cache_config_for` (checkpoint section
or QUANTMLA_VLLM_CACHE), so vLLM's CacheDType literal needs no patch. The KV cache spec's per-token size is
set through the backend's `customize_spec` hook to `layout.row_bytes`, which is what vLLM's capacity
accounting divides by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend, MLACommonMetadataBuilder

from quantmla.cache.paged import PagedMLACache
from quantmla.config import CacheConfig
from quantmla.integrations.vllm import layout, settings
from quantmla.integrations.vllm.slots import SlotTable
from quantmla.kernels.mla_decode import mla_decode, mla_decode_reference

logger = init_logger("vllm.quantmla")  # under "vllm" so vLLM's log handler prints it


# The model's resolved cache config, per process. vLLM asks the backend for its KV cache spec
# (customize_spec) outside the config context, after the model (and so every impl) was built.
_RESOLVED: tuple[CacheConfig, int, int, str] | None = None


def _model_cache_config() -> tuple[CacheConfig, int, int, str]:
    """(cache config fitted to the model, kv_lora_rank, rope dims, where the config came from)."""
    global _RESOLVED
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        if _RESOLVED is None:
            raise RuntimeError("quantmla's vLLM backend was used outside a vLLM engine (no current vLLM config)")
        return _RESOLVED
    hf = vllm_config.model_config.hf_text_config
    dc, dr = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if not dc or not dr:
        raise ValueError(f"quantmla serves MLA models (kv_lora_rank + qk_rope_head_dim); "
                         f"{vllm_config.model_config.model} has none")
    cfg, source = settings.cache_config_for(vllm_config.model_config.hf_config)
    _RESOLVED = cfg.fit(dc, dr), dc, dr, source
    return _RESOLVED


@dataclass
class StepPlan:
    """Per step, shared by all layers: request i's protected slot, tokens cached before this step, and
    its query's token range [qsl[i], qsl[i+1]). slots is on the model's device, the lists on the host."""

    slots: torch.Tensor  # int32 [num_reqs]
    slot_list: list[int]
    starts: list[int]
    qsl: list[int]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]


class QuantMLAMetadataBuilder(MLACommonMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.slot_table = SlotTable(vllm_config.scheduler_config.max_num_seqs)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m, n = common_attn_metadata, common_attn_metadata.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].cpu().tolist()  # no sync on the CPU; one on CUDA
        starts = [s - (b - a) for s, a, b in zip(seq_lens, qsl, qsl[1:])]
        first = m.block_table_tensor[:n, 0].cpu().tolist()
        if len(set(first)) < n:
            # Only vLLM's dummy batches (warm-up, profiling) share a first block: give them throwaway slots.
            slot_list = [i % self.slot_table.num_slots for i in range(n)]
        else:
            slot_list = self.slot_table.assign(first, starts)
        meta.quantmla = StepPlan(torch.tensor(slot_list, dtype=torch.int32, device=self.device), slot_list, starts,
                                 qsl, m.block_table_tensor[:n].to(torch.int32))
        return meta


def _step_plan() -> tuple[StepPlan, int] | None:
    """This step's plan and number of decode requests, from vLLM's forward context (do_kv_cache_update is
    not handed the metadata); None outside a real step (profiling runs have no metadata)."""
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # speculative decoding: [0] is the base model's
        meta = meta[0] if meta else None
    metas = meta.values() if isinstance(meta, dict) else [meta]
    for m in metas:
        if getattr(m, "quantmla", None) is not None:
            return m.quantmla, m.num_decodes
    return None


def _cache_index(impl, cfg: CacheConfig, vllm_config) -> int:
    """The cache index whose per-layer formats this attention serves, read from the prefix of its kv_b_proj:
    its decoder layer ("model.layers.3.self_attn.kv_b_proj"), or for LongCat-Flash, which has two MLA
    attentions per decoder layer ("model.layers.3.self_attn.1.kv_b_proj"), 2 * layer + attention, the
    layer_idx transformers gives it and so the index of its formats in the section; 0 without per-layer
    formats."""
    if not cfg.layers:
        return 0
    from vllm.model_executor.models.utils import extract_layer_index

    hf = vllm_config.model_config.hf_text_config
    layers = getattr(hf, "num_hidden_layers", None)  # LongCat-Flash: 2 * num_layers, one per MLA attention
    prefix = getattr(getattr(impl, "kv_b_proj", None), "prefix", "")
    if layers != len(cfg.layers) or not prefix:
        raise ValueError(f"quantmla: the checkpoint's section has formats for {len(cfg.layers)} layers; this "
                         f"model has {layers} MLA layers{'' if prefix else ' and its attention no layer prefix'}"
                         ": quantmla's vLLM backend maps one MLA attention per cache index (serve it with "
                         "`quantmla serve`, or set QUANTMLA_VLLM_CACHE to one format pair)")
    # vLLM binds LongCat's KV caches to layers the same way (worker/gpu/attn_utils.py: num_attn_module).
    per_layer = 2 if getattr(hf, "model_type", None) == "longcat_flash" else 1
    return extract_layer_index(prefix, per_layer)


def check_kv_cache_dtype(cache_dtype: str) -> None:
    """Refuse a --kv-cache-dtype other than "auto": the formats are quantmla's (QUANTMLA_VLLM_CACHE or the
    checkpoint's section), and vLLM would log a cache it does not hold (fp8 with INT4 rows: it ran, silently
    INT4) or size its tensor for it (fp8 with BF16 rows: it failed at the first step with a row-size error)."""
    if cache_dtype != "auto":
        raise ValueError(f"quantmla's vLLM backend takes its cache formats from {settings.ENV} or the checkpoint's "
                         f"quantmla section (e.g. {settings.ENV}=fp8,fp8), not --kv-cache-dtype: leave it at auto "
                         f"(got {cache_dtype!r})")


def check_head_size(model_config, kv_lora_rank: int, rope_dim: int) -> None:
    """Refuse at start what vLLM's MLA metadata refuses at every step: it checks the head size of the model's
    config (`get_head_size`), the latent width only for the model types vLLM lists as DeepSeek-style MLA.
    Others that it runs as MLA through its Transformers backend (Mistral 4, Youtu) started, then failed their
    first request with 'Head dimension 80 is not supported by MLA'."""
    head = model_config.get_head_size()
    if not MLACommonBackend.supports_head_size(head):
        model_type = getattr(model_config.hf_text_config, "model_type", None)
        raise ValueError(f"vLLM cannot run {model_config.model} (model_type {model_type}) as MLA: its MLA attention "
                         f"takes the config's head size, {head}, not the latent's (kv_lora_rank {kv_lora_rank} + "
                         f"rope {rope_dim}), and refuses it at the first request. Serve it with `quantmla serve`.")


class QuantMLAImplMixin:
    """forward_mqa / forward_mha / do_kv_cache_update over quantmla's cache; mixed into vLLM's MLA impl of
    the platform (which supplies __init__, the prefill attention and the weight absorption)."""

    def _quantmla_setup(self) -> None:
        cfg, dc, dr, source = _model_cache_config()
        if (dc, dr) != (self.kv_lora_rank, self.qk_rope_head_dim):
            raise ValueError(f"quantmla: layer dims {self.kv_lora_rank}/{self.qk_rope_head_dim} differ from the "
                             f"model's {dc}/{dr}")
        layout.row_bytes(cfg, dc, dr)  # refuses what one row per token cannot hold (token-axis formats)
        vllm_config = get_current_vllm_config_or_none()
        check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
        check_head_size(vllm_config.model_config, dc, dr)
        self.quantmla_layer = _cache_index(self, cfg, vllm_config)
        # refuses what the paged cache cannot store
        PagedMLACache.allocate(cfg.at(self.quantmla_layer), dc, dr, num_blocks=1, max_seqs=1, block_size=1)
        self.quantmla_config = cfg
        self.quantmla_max_seqs = vllm_config.scheduler_config.max_num_seqs
        self._quantmla_cache: PagedMLACache | None = None
        self._quantmla_key = None
        logger.info_once("quantmla cache %s/%s sink=%d recent=%d (%s): %d bytes per token, BF16 %d",
                         cfg.content, cfg.rope, cfg.sink, cfg.recent, source, layout.row_bytes(cfg, dc, dr),
                         2 * (dc + dr))
        if cfg.layers:
            logger.info_once("quantmla per-layer formats (content/rope): %s",
                             ", ".join(f"{c}/{r}" for c, r in cfg.layers))

    def quantmla_cache(self, kv_cache: torch.Tensor) -> PagedMLACache:
        """The `PagedMLACache` over this layer's vLLM tensor (rebuilt if vLLM rebinds the tensor)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if key != self._quantmla_key:
            self._quantmla_cache = layout.attach(kv_cache, self.quantmla_config, self.kv_lora_rank,
                                                 self.qk_rope_head_dim, self.quantmla_max_seqs, self.quantmla_layer)
            self._quantmla_key = key
        return self._quantmla_cache

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        """Write the step's new tokens: kv_c_normed [T, dc], k_pe [T, 1, dr] (decode tokens first, as vLLM's
        MLA builders order them; T may include padding past the last request)."""
        plan = _step_plan()
        if kv_cache.numel() == 0 or plan is None:
            return
        plan, nd = plan
        cache = self.quantmla_cache(kv_cache)
        c, r = kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)
        if nd:
            if plan.qsl[nd] != nd:
                raise NotImplementedError("quantmla's vLLM backend decodes one token per request (no speculative "
                                          "decoding)")
            starts = torch.tensor(plan.starts[:nd], dtype=torch.int32, device=c.device)
            cache.append_decode(plan.slots[:nd], plan.block_table[:nd], starts, c[:nd], r[:nd])
        for i in range(nd, len(plan.starts)):
            a, b = plan.qsl[i], plan.qsl[i + 1]
            cache.append(plan.slot_list[i], plan.block_table[i], plan.starts[i], c[a:b], r[a:b])

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None):
        if attn_metadata.prefill is not None and attn_metadata.prefill.chunked_context is not None:
            raise NotImplementedError("quantmla's vLLM backend prefills whole prompts only: turn off chunked "
                                      "prefill and prefix caching (--no-enable-chunked-prefill "
                                      "--no-enable-prefix-caching)")
        return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                                   output_scale)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """q: (absorbed q_nope [B, H, dc], q_pe [B, H, dr]) or their concatenation; B = decode requests.
        Returns (latent output [B, H, dc] in q's dtype, None)."""
        q_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        cache = self.quantmla_cache(kv_c_and_k_pe_cache)
        dec, nd = attn_metadata.decode, q_nope.shape[0]
        slots = attn_metadata.quantmla.slots[:nd]
        lens = dec.seq_lens[:nd].to(torch.int32)  # lengths after this step's token
        if q_nope.is_cuda:
            out, _ = mla_decode(q_nope.contiguous(), q_pe.contiguous(), cache, dec.block_table[:nd].to(torch.int32),
                                lens, slots, self.scale, out_dtype=torch.bfloat16)
        else:
            out, _ = mla_decode_reference(q_nope, q_pe, cache, dec.block_table[:nd], lens, slots, self.scale,
                                          dtype=torch.float32)
        return out.to(q_nope.dtype), None


def _quantmla_spec(spec):
    """The KV cache spec with quantmla's row size, in bytes whatever vLLM's cache dtype: BF16 rows too are
    1152 bytes at 512 + 64 (a float32 model's vLLM row is 2304, which `layout.attach` refused at the first step)."""
    cfg, dc, dr, _ = _model_cache_config()
    if spec.head_size != dc + dr:
        raise ValueError(f"quantmla: MLA head size {spec.head_size} != kv_lora_rank {dc} + rope {dr}")
    return replace(spec, state_content_bytes=layout.row_bytes(cfg, dc, dr))


class QuantMLABackendMixin:
    """Mixed into vLLM's MLA backend of the platform: quantmla's row size and metadata builder (the impl is
    the platform's, see `cpu` and `cuda`)."""

    @classmethod
    def customize_spec(cls, spec):
        return _quantmla_spec(super().customize_spec(spec))

    @staticmethod
    def get_builder_cls():
        return QuantMLAMetadataBuilder
