"""`LLM`: the engine's front — vLLM's offline API over quantmla's paged quantized cache.

    from quantmla.engine import LLM, SamplingParams
    llm = LLM()                                   # the shipped default model, INT4/INT4 cache
    outs = llm.generate(["def main():"], SamplingParams(max_tokens=32))
    print(outs[0].text, llm.stats())

`model` is a checkpoint directory (None: the shipped default model) or an already built transformers MLA
model (e.g. random weights for a benchmark; it is modified in place: its attention modules are replaced).
Formats: `content`/`rope` (and `sink`/`recent`) as everywhere in quantmla; left None they come from a
calibrated checkpoint's `quantmla` config section, or default to int4/int4, sink 4, recent 128.

The KV pool is sized from a byte budget: `kv_cache_bytes`, or on CUDA `gpu_memory_utilization` of the card
minus what is already allocated and a reserve for activations; on the CPU, by default, room for
`max_num_seqs` sequences of `max_model_len` tokens, at most half of the memory available (with a warning).
`capacity_tokens` is what the chosen formats fit in it.

Serving loop (one thread owns the object): `add_request` queues a request (refused with ValueError, nothing
queued, when it can never run), `step` runs one prefill or decode step and returns what each request got,
`abort` drops a request and frees its pages, `stats` reports the pool and the counters.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantmla.config import CacheConfig
from quantmla.engine.attention import PagedAttention
from quantmla.engine.block_manager import BlockManager, PoolLayout
from quantmla.engine.model_runner import ModelRunner, storage_dtype
from quantmla.engine.sampler import SamplingParams, sample
from quantmla.engine.scheduler import Scheduler
from quantmla.engine.sequence import Sequence
from quantmla.models.adapters import describe

log = logging.getLogger("quantmla.engine")

ACTIVATION_RESERVE = 2 << 30  # bytes kept free on CUDA for activations and graphs when sizing from utilization


def _available_memory() -> int | None:
    """Bytes of memory the OS reports available now (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


def _load(model, dtype, device):
    from quantmla.calibrate.export import cache_config_of
    from quantmla.data import resolve_model_dir, tokenizer_for
    from quantmla.models.adapters import load_model

    path = resolve_model_dir(model)
    module = load_model(path, dtype=dtype).to(device)
    return module, tokenizer_for(path), cache_config_of(path), path.resolve().name


def _cache_config(section: CacheConfig | None, content, rope, sink, recent) -> CacheConfig:
    base = section or CacheConfig()
    layers = base.layers if content is None and rope is None else ()  # a calibration's per-layer choice
    return CacheConfig(content or base.content, rope or base.rope, base.sink if sink is None else sink,
                       base.recent if recent is None else recent, layers=layers)


def eos_token_ids(model: nn.Module) -> set[int]:
    """The ids that end a request: the model config's eos_token_id and its generation config's, which is what
    transformers' `generate` stops at (and vLLM adds to its stop ids). Checkpoints differ there: Kimi K2's
    generation_config.json ends a chat turn at <|im_end|>, its config.json names only [EOS]."""
    ids = set()
    for config in (model.config.get_text_config(), getattr(model, "generation_config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return {int(t) for t in ids}


class TooLong(ValueError):
    """A request the model's limit or the whole pool cannot hold; `param` is whose fault: "prompt" when the
    prompt alone leaves no room for output, else "max_tokens"."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class LLM:
    def __init__(self, model: str | Path | nn.Module | None = None, content: str | None = None,
                 rope: str | None = None, sink: int | None = None, recent: int | None = None,
                 device: str | torch.device | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 64, max_model_len: int | None = None,
                 block_size: int = 64, prefill_chunk: int = 8192, cuda_graphs: bool = True,
                 dtype: torch.dtype | None = None, tokenizer=None):
        if isinstance(model, nn.Module) and device is None:
            device = next(model.parameters()).device
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if max_num_seqs < 1 or block_size < 1 or prefill_chunk < 1:
            raise ValueError("max_num_seqs, block_size and prefill_chunk must be >= 1")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None: the model's limit), got {max_model_len}")
        if isinstance(model, nn.Module):
            if any(isinstance(m, PagedAttention) for m in model.modules()):
                raise ValueError("this model is already served by another LLM (its attention modules are that "
                                 "LLM's); call close() on it first, or pass another copy of the model")
            section, self.model_name = None, getattr(model.config, "name_or_path", "") or type(model).__name__
            self.tokenizer, model = tokenizer, model.to(device)
        else:
            model, tok, section, self.model_name = _load(model, dtype, device)
            self.tokenizer = tokenizer or tok
        self.model = model.eval()
        layers = describe(model)
        self.cache_config = _cache_config(section, content, rope, sink, recent)
        limit = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0)
        self.max_model_len = int(max_model_len or limit or 4096)
        if limit and self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit "
                             f"(max_position_embeddings {limit})")
        self.layout = layout = PoolLayout.of(self.cache_config, layers, block_size,
                               storage_dtype(next(model.parameters()).dtype, device))
        if kv_cache_bytes is None:
            kv_cache_bytes = self._default_budget(layout, device, max_num_seqs, gpu_memory_utilization)
        num_blocks = layout.num_blocks(int(kv_cache_bytes), max_num_seqs)
        self.kv_cache_bytes = layout.bytes_for(num_blocks, max_num_seqs)
        self.blocks = BlockManager(num_blocks, block_size, max_num_seqs)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max(prefill_chunk, self.max_model_len))
        self.runner = ModelRunner(model, layers, self.cache_config, num_blocks, max_num_seqs, block_size,
                                  self.max_model_len, prefill_chunk, cuda_graphs)  # fmt: skip
        self.eos = eos_token_ids(model)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._shared_gen = torch.Generator().manual_seed(0)
        self.counters = dict(steps=0, prefill_steps=0, decode_steps=0, tokens_generated=0, prompt_tokens=0,
                             prefill_tokens=0, peak_batch=0, time_prefill_s=0.0, time_decode_s=0.0)
        kernels = self.runner.decode_kernels()  # what each layer's decode runs (fixed by formats and device)
        self.decode_kernel = " | ".join(kernels) if len(set(kernels)) > 1 else (kernels[0] if kernels else "")
        log.info("KV pool: %d pages of %d tokens = %d tokens (%s), %.1f MiB; decode kernel: %s", num_blocks,
                 block_size, self.capacity_tokens, self.format_name, self.kv_cache_bytes / 2**20, self.decode_kernel)

    @property
    def format_name(self) -> str:
        """"content/rope", or each layer's where a calibration chose them per layer ("a/b | c/d | ...")."""
        return " | ".join(f"{c}/{r}" for c, r in self.cache_config.per_layer)

    def _default_budget(self, layout: PoolLayout, device, max_num_seqs: int, utilization: float) -> int:
        if device.type == "cuda":
            if not 0 < utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
            total = torch.cuda.get_device_properties(device).total_memory
            return int(total * utilization) - torch.cuda.memory_allocated(device) - ACTIVATION_RESERVE
        blocks = max_num_seqs * -(-self.max_model_len // layout.block_size)
        room = layout.bytes_for(blocks, max_num_seqs) + layout.page_bytes  # rounding slack
        free = _available_memory()
        if free is not None and room > free // 2:  # e.g. 64 x 160 K tokens of a 61-layer model: hundreds of GB
            log.warning("a pool for %d sequences of %d tokens (%.1f GiB) would not fit in memory: using half of "
                        "the available %.1f GiB (set kv_cache_bytes / --kv-cache-bytes, max_model_len or "
                        "max_num_seqs to choose)", max_num_seqs, self.max_model_len, room / 2**30, free / 2**30)
            return free // 2
        return room

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    # --- requests ------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; its id. ValueError for a request it cannot run (`TooLong`: the model's limit or
        the whole pool), nothing queued then."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:  # (it would be the BOS alone)
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as a list of token ids")
            # with the tokenizer's special tokens (its BOS), as transformers and vLLM encode a prompt
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.get_text_config().vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        n, total = len(ids), len(ids) + params.max_tokens
        for limit, what in ((self.max_model_len, "the model's limit of"), (self.capacity_tokens,
                                                                           "the whole KV pool of")):
            if n >= limit:
                raise TooLong(f"the prompt ({n} tokens) leaves no room for output within {what} {limit} tokens",
                              "prompt")
            if total > limit:
                raise TooLong(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds {what} "
                              f"{limit} tokens", "max_tokens")
        if request_id is None:  # the next number no request in flight has (a caller may have chosen one)
            request_id = next(r for r in map(str, self._ids) if r not in self.requests)
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, text)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(ids)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(str(request_id), None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        dev = self.runner.device
        t0 = time.perf_counter()
        logits = self.runner.prefill(seqs) if is_prefill else self.runner.decode(seqs)
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self._shared_gen)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.perf_counter()
        c = self.counters
        c["steps"] += 1
        c["prefill_steps" if is_prefill else "decode_steps"] += 1
        c["time_prefill_s" if is_prefill else "time_decode_s"] += now - t0
        if is_prefill:
            c["prefill_tokens"] += sum(len(s) for s in seqs)
        else:
            c["peak_batch"] = max(c["peak_batch"], len(seqs))
        outputs = []
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            seq.first_token_time = seq.first_token_time or now
            c["tokens_generated"] += 1
            reason = self._finish_reason(seq, tok)
            if reason:
                self.scheduler.finish(seq, reason)
                seq.finish_time = now
                self.requests.pop(seq.request_id, None)
            outputs.append(StepOutput(seq.request_id, [tok], reason is not None, reason))
        return outputs

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            return "stop"
        if seq.num_completion_tokens >= p.max_tokens:
            return "length"
        return None

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams | list | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. One SamplingParams for all or one per prompt. If
        a prompt is refused (ValueError), none of them runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        seqs = []
        try:
            for prompt, p in zip(prompts, params):
                seqs.append(self.requests[self.add_request(prompt, p)])
        except BaseException:  # one is refused: take back the ones already queued
            for s in seqs:
                self.abort(s.request_id)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        while any(not s.is_finished for s in seqs):
            for out in self.step():
                if out.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [RequestOutput(s.request_id, s.prompt, s.prompt_token_ids, s.completion_token_ids,
                              self.decode(s.completion_token_ids), s.finish_reason) for s in seqs]

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def close(self) -> None:
        """Give the model its own attention modules back and free the pools; the object is unusable after.
        A model passed in as a module can then serve another LLM (e.g. one per cache format)."""
        for rid in list(self.requests):
            self.abort(rid)
        self.runner.restore()

    def stats(self) -> dict:
        b = self.blocks
        return {
            "preemptions": self.scheduler.preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_total": b.num_blocks,
            "pages_used": b.num_used,
            "pages_free": b.num_free,
            "capacity_tokens": self.capacity_tokens,
            "kv_cache_bytes": self.kv_cache_bytes,
            "cuda_graphs": sorted(self.runner.graphs),
            "format": self.format_name,
            "decode_kernel": self.decode_kernel,
            **self.counters,
        }
