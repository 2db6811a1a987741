"""Runs the model for the engine: the checkpoint's own transformers modules, with attention on the paged pool.

The runner allocates one `PagedMLACache` per MLA attention (all with the same number of pages and slots),
puts a `PagedAttention` in place of each attention module, and runs two kinds of forward through the model's
own `forward` (embeddings, norms, MLP/MoE, lm_head and any family-specific scaling stay the model's):
  - prefill: one sequence at a time, `prefill_chunk` tokens per forward, only the last position's logits;
  - decode: one token per running sequence, [B, 1]. On CUDA each batch size of `graph_batch_sizes` is captured
    once as a CUDA graph (the batch is padded to the next captured size; padded rows write to the scratch
    page and slot); models whose forward cannot be captured (data-dependent MoE routing) run eagerly.
The model's attention implementation is set to a name transformers builds no mask for: masks are the
runner's business (the pool's positions), and none of [T, T] size is ever materialised.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quantmla.cache.paged import PagedMLACache
from quantmla.config import CacheConfig
from quantmla.engine.attention import Decode, PagedAttention, Prefill, StepContext
from quantmla.engine.sequence import Sequence
from quantmla.kernels.mla_decode import unsupported_reason
from quantmla.models.adapters import MLALayer, attention_module, register_module_attention

log = logging.getLogger("quantmla.engine")

ATTENTION_NAME = register_module_attention("quantmla_paged", "PagedAttention")


def storage_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """dtype of the pool's unquantized rows: bfloat16 (what the kernel reads), except that an fp32 model on the
    CPU keeps fp32, so that a bf16-format cache there is exactly the model's own cache."""
    return torch.float32 if model_dtype == torch.float32 and torch.device(device).type == "cpu" else torch.bfloat16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)] if b <= max_num_seqs} | {max_num_seqs})


class PerRequestLongRope(nn.Module):
    """Stands in for a longrope rotary embedding (MiniCPM3's type) whose original_max_position_embeddings is
    below max_model_len. transformers' rotary picks the long or the short factors by the largest position of
    the whole forward, so in a batched decode one long sequence switched every other one to the long
    factors, and a chunked prefill split one prompt between the two. `generate`, per request, uses the long
    factors for every prompt position when the prompt is longer than original_max_position_embeddings, and
    for a generated token when its position + 1 is. Here each position gets that choice from its
    sequence's prompt length (`prompt_lens`, set by the runner per forward), whatever else is in the batch,
    however the prompt is chunked and after a recompute."""

    def __init__(self, rope: nn.Module, original_max: int):
        super().__init__()
        self.rope, self.original_max = rope, original_max
        self.prompt_lens: list[int] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        lens = torch.tensor(self.prompt_lens, device=position_ids.device)[:, None]
        use_long = torch.where(position_ids < lens, lens, position_ids + 1) > self.original_max  # [B, T]
        # Two calls for the whole batch: the short factors where every position stays below original_max (the
        # long ones zeroed, not used); the long ones by adding to every row a position that crosses it.
        short = self.rope(x, torch.where(use_long, 0, position_ids))
        crossed = self.rope(x, torch.cat([position_ids, position_ids.new_full((len(position_ids), 1),
                                                                             self.original_max)], 1))
        if isinstance(short, tuple):  # (cos, sin); DeepSeek-V2's rotary returns one complex tensor
            return tuple(_pick(use_long, s, c) for s, c in zip(short, crossed))
        return _pick(use_long, short, crossed)


def _pick(long: torch.Tensor, short: torch.Tensor, crossed: torch.Tensor) -> torch.Tensor:
    """Per position ([B, T], dims 0-1), crossed's value (its extra last position dropped) where `long`, else
    short's."""
    return torch.where(long.view(*long.shape, *[1] * (short.dim() - 2)), crossed[:, :-1], short)


def wrap_longrope(model: nn.Module, max_model_len: int) -> list[tuple[str, PerRequestLongRope]]:
    """Put a `PerRequestLongRope` in place of each longrope rotary embedding that would switch factors within
    max_model_len; (module name, wrapper) of each."""
    wrapped = []
    for name, module in list(model.named_modules()):
        params = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
        if getattr(module, "rope_type", None) == "longrope" and hasattr(module, "original_inv_freq"):
            original_max = int(params.get("original_max_position_embeddings") or max_model_len)
            if original_max < max_model_len:
                wrapped.append((name, PerRequestLongRope(module, original_max)))
                model.set_submodule(name, wrapped[-1][1])
    return wrapped


def layer_kernel(cache: PagedMLACache, device: torch.device) -> str:
    """decode_step's kernel for a layer's cache: "auto" (the GPU kernels on CUDA, the torch reference
    elsewhere), or "reference" on CUDA where the Triton kernel cannot run the cache (`unsupported_reason`)."""
    if device.type == "cuda" and unsupported_reason(cache) is not None:
        return "reference"
    return "auto"


class ModelRunner:
    def __init__(self, model: nn.Module, layers: list[MLALayer], config: CacheConfig, num_blocks: int,
                 max_num_seqs: int, block_size: int, max_model_len: int, prefill_chunk: int,
                 cuda_graphs: bool = True):
        self.model, self.layers = model, layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size, self.max_model_len, self.prefill_chunk = block_size, max_model_len, prefill_chunk
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_block, self.scratch_slot = num_blocks, max_num_seqs
        self.max_num_seqs = max_num_seqs
        self.step = StepContext()
        store_dtype = storage_dtype(next(model.parameters()).dtype, self.device)
        self.caches: list[PagedMLACache] = []
        fallbacks = []
        for layer in layers:
            cache = PagedMLACache.allocate(config.at(layer.cache_idx).fit(layer.kv_lora_rank, layer.rope_dim),
                                           layer.kv_lora_rank, layer.rope_dim, num_blocks + 1, max_num_seqs + 1,
                                           block_size, self.device, dtype=store_dtype)  # fmt: skip
            kernel = layer_kernel(cache, self.device)
            if kernel == "reference":  # only on CUDA
                fallbacks.append(f"{layer.module}: {unsupported_reason(cache)}")
            model.set_submodule(layer.module, PagedAttention(attention_module(model, layer), layer, cache, self.step,
                                                             kernel))  # fmt: skip
            self.caches.append(cache)
        self._attn_implementation = model.config._attn_implementation
        model.config._attn_implementation = ATTENTION_NAME
        self.ropes = wrap_longrope(model, max_model_len)
        # One block-table row per slot (the scratch slot's row points at the scratch page everywhere).
        self.slot_tables = torch.full((max_num_seqs + 1, self.max_blocks), num_blocks, dtype=torch.int32,
                                      device=self.device)  # fmt: skip
        self._slot_len = [0] * (max_num_seqs + 1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if fallbacks:  # the reference reads sequence lengths on the host: no graphs either
            log.warning("the GPU decode kernels cannot run %d layer(s) (%s): they decode with the torch reference, "
                        "eagerly and slowly", len(fallbacks), fallbacks[0])
        elif cuda_graphs and self.device.type == "cuda" and self.ropes:  # its factors are chosen on the host
            log.warning("decode runs eagerly: longrope switches factors by position, which a graph cannot capture")
        elif cuda_graphs and self.device.type == "cuda":
            self._capture(graph_batch_sizes(max_num_seqs))

    def decode_kernels(self) -> list[str]:
        """Per MLA layer, the kernel a decode step runs: on a GPU `mla_decode`'s choice ("cuda", "heads", "triton"
        or "gluon", `decode_kernel_name`; "reference" where none can run the cache), or where that depends on the
        batch size, e.g. "cuda (batch <= 2) / triton"; on the CPU "reference" (the torch oracle)."""
        if self.device.type != "cuda":
            return ["reference"] * len(self.caches)
        from quantmla.kernels.mla_decode_cuda import auto_cuda_max_batch, decode_kernel_name

        names = []
        for c, layer in zip(self.caches, self.layers):
            if layer_kernel(c, self.device) == "reference":
                names.append("reference")
                continue
            one, most = (decode_kernel_name(c, layer.num_heads, self.device, batch=b) for b in (1, self.max_num_seqs))
            limit = auto_cuda_max_batch(layer.num_heads, many_heads=most == "heads")
            names.append(one if one == most else f"{one} (batch <= {limit}) / {most}")
        return names

    def restore(self) -> None:
        """Put the model's own attention modules (and attention implementation) back; drop graphs and pools."""
        for layer in self.layers:
            wrapper = self.model.get_submodule(layer.module)
            if isinstance(wrapper, PagedAttention):
                self.model.set_submodule(layer.module, wrapper.attn)
        self.model.config._attn_implementation = self._attn_implementation
        for name, rope in self.ropes:
            self.model.set_submodule(name, rope.rope)
        self.graphs.clear()
        self.caches.clear()

    def _prompt_lens(self, seqs: list[Sequence], pad: int = 0) -> None:
        for _, rope in self.ropes:
            rope.prompt_lens = [s.num_prompt_tokens for s in seqs] + [1] * pad

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=logits_to_keep)
        return out.logits[:, -1]

    def _sync_table(self, seq: Sequence, whole: bool = False) -> None:
        """Copy seq's new block-table entries (all of them when `whole`) into its slot's row on the device."""
        have = 0 if whole else self._slot_len[seq.slot]
        if len(seq.block_table) > have:
            new = torch.tensor(seq.block_table[have:], dtype=torch.int32)
            self.slot_tables[seq.slot, have : len(seq.block_table)] = new.to(self.device, non_blocking=True)
            self._slot_len[seq.slot] = len(seq.block_table)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Cache all tokens of each (newly admitted) sequence; logits of each one's last position [N, V]."""
        rows = []
        for seq in seqs:
            self._sync_table(seq, whole=True)
            self._prompt_lens([seq])
            table = self.slot_tables[seq.slot]
            ids = torch.tensor(seq.token_ids, dtype=torch.long).to(self.device, non_blocking=True)
            for start in range(0, len(seq), self.prefill_chunk):
                end = min(start + self.prefill_chunk, len(seq))
                self.step.current = Prefill.plan(self.caches, seq.slot, table, start, end - start, self.dtype)
                pos = torch.arange(start, end, device=self.device)
                logits = self._forward(ids[None, start:end], pos[None])
            rows.append(logits[0])
        self.step.current = None
        return torch.stack(rows)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's last token (cached during the step); next-token logits [B, V].

        Per step the host sends one [3, bs] tensor (token, position = tokens cached before, slot); block
        tables live on the device, one row per slot, and only new entries are copied."""
        B = len(seqs)
        bs = next((b for b in sorted(self.graphs) if b >= B), B)
        pad = bs - B
        meta = torch.tensor([[s.token_ids[-1] for s in seqs] + [0] * pad, [len(s) - 1 for s in seqs] + [0] * pad,
                             [s.slot for s in seqs] + [self.scratch_slot] * pad])  # fmt: skip
        for s in seqs:
            self._sync_table(s)
        self._prompt_lens(seqs, pad)
        if bs in self.graphs:
            graph, out = self.graphs[bs]
            self._meta[:, :bs].copy_(meta, non_blocking=True)
            graph.replay()
            return out[:B]
        # max_model_len bounds the kernel's split as in the graphs: the same summation order with and without
        # them, so outputs do not depend on which batch sizes were captured.
        return self._decode_forward(meta.to(self.device), self.max_model_len, checked=True)

    def _decode_forward(self, meta: torch.Tensor, max_seq_len: int, checked: bool) -> torch.Tensor:
        slots = meta[2]
        self.step.current = Decode(self.slot_tables[slots], meta[1].int(), slots.int(), max_seq_len, checked)
        try:
            return self._forward(meta[0, :, None], meta[1, :, None])
        finally:
            self.step.current = None

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        self._meta = torch.zeros(3, max(sizes), dtype=torch.long, device=self.device)
        self._meta[2] = self.scratch_slot
        pool = None
        try:
            for bs in sorted(sizes, reverse=True):  # largest first: the others reuse its memory pool
                meta = self._meta[:, :bs]
                self._decode_forward(meta, self.max_model_len, checked=False)  # warm up: compile, settle memory
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._decode_forward(meta, self.max_model_len, checked=False)
                pool = graph.pool()
                self.graphs[bs] = (graph, out)
        except RuntimeError as e:  # e.g. MoE routing that reads device data on the host
            log.warning("decode runs eagerly: the model's forward cannot be captured in a CUDA graph (%s)",
                        str(e).splitlines()[0])
            self.graphs.clear()
        torch.cuda.synchronize(self.device)
