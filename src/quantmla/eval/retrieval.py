"""Needle retrieval accuracy (RULER-style single / multi-key / multi-value) through `model.generate`.

Samples come from `quantmla.eval.needles.make_sample` with a random generator seeded from (seed, task,
length, index) alone, so every method sees the very same prompts. Generation is greedy with the cache under
test; a sample counts as correct when the text generated before the first newline equals the answer
(the answer's trailing newline, an EOS, or padding after it do not matter).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from quantmla.cache.quant_cache import QuantMLACache
from quantmla.config import CacheConfig
from quantmla.eval.needles import TASKS, NeedleSample, make_sample
from quantmla.models.adapters import cache_kwargs


@dataclass
class Codec:
    """Text <-> token ids: the checkpoint's tokenizer, or raw bytes modulo the vocabulary (test models)."""

    tokenizer: object | None
    vocab_size: int

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt, with the tokenizer's special tokens (the default model's BOS) as in training."""
        if self.tokenizer is None:
            return [b % self.vocab_size for b in text.encode("utf-8")]
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_answer(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [b % self.vocab_size for b in text.encode("utf-8")]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def samples_for(task: str, length: int, count: int, seed: int = 0, filler: str | None = None) -> list[NeedleSample]:
    """`count` samples whose prompt + answer is `length` bytes; identical for every method and run."""
    return [make_sample(task, length, random.Random(f"{seed}/{task}/{length}/{i}"), filler) for i in range(count)]


def is_correct(generated: str, answer: str) -> bool:
    """Exact match of the text before the first newline with the answer (its trailing newline stripped)."""
    return generated.split("\n", 1)[0] == answer.rstrip("\n")


# (prompt ids [B, P], max new tokens) -> generated ids [B, <= max new]; the real one wraps model.generate.
GenerateFn = Callable[[torch.Tensor, int], torch.Tensor]


def cache_generate(model, config: CacheConfig, pad_token_id: int | None = None) -> GenerateFn:
    """Greedy generation with a fresh QuantMLACache(config) per call; returns only the new tokens."""

    @torch.no_grad()
    def generate(ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        cache = QuantMLACache(config)
        ids = ids.to(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_token_id, **cache_kwargs(model, cache))
        return out[:, ids.shape[1]:].cpu()

    return generate


def accuracy(generate: GenerateFn, codec: Codec, samples: list[NeedleSample], batch: int = 8,
             progress: bool = False, desc: str = "niah") -> float:
    """Fraction of samples answered exactly. Samples are batched only with others of the same prompt
    length, so no padding ever enters the cache (padding would land in the sink and shift the window)."""
    groups: dict[int, list[tuple[list[int], NeedleSample]]] = {}
    for s in samples:
        ids = codec.encode_prompt(s.prompt)
        groups.setdefault(len(ids), []).append((ids, s))
    batches = [g[i:i + batch] for g in groups.values() for i in range(0, len(g), batch)]
    correct = 0
    for chunk in tqdm(batches, desc=desc, disable=not progress, leave=False):
        ids = torch.tensor([ids for ids, _ in chunk])
        # One token more than the longest answer, so an answer that runs on is caught.
        new = max(len(codec.encode_answer(s.answer)) for _, s in chunk) + 1
        out = generate(ids, new)
        correct += sum(is_correct(codec.decode(row.tolist()), s.answer) for row, (_, s) in zip(out, chunk))
    return correct / len(samples)


def niah(generate: GenerateFn, codec: Codec, lengths: list[int], count: int, seed: int = 0,
         filler: str | None = None, batch: int = 8, progress: bool = True) -> dict[str, dict[int, float]]:
    """Accuracy per task per length: {task: {length: accuracy}}."""
    out: dict[str, dict[int, float]] = {}
    for task in TASKS:
        out[task] = {}
        for length in lengths:
            samples = samples_for(task, length, count, seed, filler)
            out[task][length] = accuracy(generate, codec, samples, batch, progress, f"niah {task} {length}")
    return out
