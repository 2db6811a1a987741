"""Needle retrieval accuracy (RULER-style single / multi-key / multi-value) under serving semantics.

Samples come from `quantmla.eval.needles.make_sample` with a random generator seeded from (seed, task,
length, index) alone, so every method sees the very same prompts. Scoring is teacher-forced: prompt +
answer (all but its last token) go through one `serving.serving_logits` forward with the cache under test,
and a sample is correct iff the argmax at every answer position is the answer's token (at the answer's final
newline an EOS counts too). That is exactly whether greedy generation under serving semantics (the engine,
or a `QuantMLACache` fed one token per call) writes the answer: each greedy step is the argmax given the
tokens before it, and as long as those are the answer's, its prefixes are the teacher-forced ones.
The one way it can differ from matching the generated *text*: a tokenizer that can spell the same text with
other ids (e.g. "48" as one token where the answer is "4", "8", or a newline merged into the next token)
would be counted correct by text matching and wrong here; the byte-level tokenizers of the shipped models
spell every text one way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from quantmla.config import CacheConfig
from quantmla.data import check_token_ids
from quantmla.eval.needles import TASKS, NeedleSample, make_sample
from quantmla.eval.serving import serving_logits


@dataclass
class Codec:
    """Text <-> token ids: the checkpoint's tokenizer, or raw bytes modulo the vocabulary (test models)."""

    tokenizer: object | None
    vocab_size: int

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt, with the tokenizer's special tokens (the default model's BOS) as in training."""
        if self.tokenizer is None:
            return [b % self.vocab_size for b in text.encode("utf-8")]
        return check_token_ids(list(self.tokenizer(text, add_special_tokens=True)["input_ids"]), self.vocab_size)

    def encode_answer(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [b % self.vocab_size for b in text.encode("utf-8")]
        return check_token_ids(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), self.vocab_size)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def samples_for(task: str, length: int, count: int, seed: int = 0, filler: str | None = None) -> list[NeedleSample]:
    """`count` samples whose prompt + answer is `length` bytes; identical for every method and run."""
    return [make_sample(task, length, random.Random(f"{seed}/{task}/{length}/{i}"), filler) for i in range(count)]


def eos_ids(model) -> set[int]:
    """Token ids that end a greedy generation: the generation config's EOS (what `generate` stops on), else
    the model config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def answer_correct(predicted: list[int], answer: list[int], eos: set[int], final_newline: bool) -> bool:
    """predicted[i]: the argmax after prompt + answer[:i]. All must be the answer's tokens, except that the
    last may be an EOS where the answer's last token is its final newline."""
    if predicted[:-1] != answer[:-1]:
        return False
    return predicted[-1] == answer[-1] or (final_newline and predicted[-1] in eos)


def outcomes(model, config: CacheConfig, codec: Codec, samples: list[NeedleSample], batch: int = 8,
             progress: bool = False, desc: str = "niah") -> list[bool]:
    """Per sample, in the order given: answered exactly (teacher-forced, see the module docstring). Samples
    are batched only with others fed as many tokens, so no padding enters any window."""
    eos = eos_ids(model)
    groups: dict[int, list[tuple[int, list[int], list[int], NeedleSample]]] = {}
    for i, s in enumerate(samples):
        prompt, answer = codec.encode_prompt(s.prompt), codec.encode_answer(s.answer)
        groups.setdefault(len(prompt) + len(answer) - 1, []).append((i, prompt, answer, s))
    batches = [g[i:i + batch] for g in groups.values() for i in range(0, len(g), batch)]
    correct = [False] * len(samples)
    for chunk in tqdm(batches, desc=desc, disable=not progress, leave=False):
        ids = torch.tensor([prompt + answer[:-1] for _, prompt, answer, _ in chunk])
        keep = max(len(answer) for _, _, answer, _ in chunk)
        predicted = serving_logits(model, ids, config, keep).argmax(-1).tolist()  # [B, keep]
        for row, (i, _, answer, s) in zip(predicted, chunk):
            newline = s.answer.endswith("\n") and codec.decode(answer[-1:]) == "\n"
            correct[i] = bool(answer_correct(row[keep - len(answer):], answer, eos, newline))
    return correct


def accuracy(model, config: CacheConfig, codec: Codec, samples: list[NeedleSample], batch: int = 8,
             progress: bool = False, desc: str = "niah") -> float:
    """Fraction of samples answered exactly (`outcomes`)."""
    return sum(outcomes(model, config, codec, samples, batch, progress, desc)) / len(samples)


def niah(model, config: CacheConfig, codec: Codec, lengths: list[int], count: int, seed: int = 0,
         filler: str | None = None, batch: int = 8, progress: bool = True) -> dict[str, dict[int, list[bool]]]:
    """Per task per length, each sample's outcome under serving semantics for `config` (`outcomes`; the same
    samples for every config, so two configs compare sample by sample): {task: {length: [bool] * count}}."""
    out: dict[str, dict[int, list[bool]]] = {}
    for task in TASKS:
        out[task] = {}
        for length in lengths:
            samples = samples_for(task, length, count, seed, filler)
            out[task][length] = outcomes(model, config, codec, samples, batch, progress, f"niah {task} {length}")
    return out
