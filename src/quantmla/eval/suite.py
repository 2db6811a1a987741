"""The evaluation suite: one cache method on one model -> bytes per token, perplexity, KL to BF16, needles.

    model = load_model(model_dir)
    result = evaluate(model, tokenizer_for(model_dir), "rtn", MethodArgs(content="int4", rope="int4"))
    result.to_dict()   # {"method", "content", "rope", "bytes_per_token", "ppl", "kl", "niah": {...}, ...}

Tasks: "ppl" and "kl" share one pass (windows of the longest length from the held-out text, the last
`scored` tokens of each scored; see `perplexity`), "niah" is `retrieval.niah` at every length. Both run the
model under serving semantics (`serving`: every query sees the sink and its last `recent` keys in BF16, the
rest as stored), one forward per batch of windows or needle samples. The reference for the KL is a plain
forward (no cache) of the unmodified model over the same windows, batch by batch; pass `reference_model`
when the model under test is a calibrated checkpoint of another (the original then judges the fold's
rounding too).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from quantmla.cache.quant_cache import QuantMLACache
from quantmla.calibrate.export import SECTION
from quantmla.config import CacheConfig
from quantmla.data import encode, read_text, token_windows
from quantmla.eval import perplexity, retrieval
from quantmla.eval.baselines import BUDGETED, RECENT, SINK, method_info
from quantmla.eval.methods import MethodArgs, apply_method, label
from quantmla.models.adapters import describe
from quantmla.policy import block_of
from quantmla.quant.formats import bytes_per_token

TASK_NAMES = ("ppl", "kl", "niah")


@dataclass(frozen=True)
class EvalSettings:
    """What to measure. lengths: needle lengths (bytes of prompt + answer); ppl/kl windows use the longest.

    samples: needle samples per task and length, and ppl/kl windows unless `windows` is given. scored:
    continuation tokens scored per window. batch: windows (or needle samples) per forward. A mean KL over few
    tokens is carried by its largest terms (a handful of tokens whose prediction flips), so ppl/kl may need
    more windows than the needles need samples.
    """

    tasks: tuple[str, ...] = TASK_NAMES
    lengths: tuple[int, ...] = (512, 1024, 2048)
    samples: int = 8
    scored: int = 256
    seed: int = 0
    batch: int = 8
    progress: bool = True
    windows: int | None = None  # ppl/kl windows (default: samples)

    def __post_init__(self):
        bad = [t for t in self.tasks if t not in TASK_NAMES]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {', '.join(bad) or '(none given)'}; known: {', '.join(TASK_NAMES)}")
        if not self.lengths or min(self.lengths) < 64:
            raise ValueError(f"lengths must be >= 64 tokens, got {list(self.lengths)}")
        if self.samples < 1 or self.batch < 1 or (self.windows is not None and self.windows < 1):
            raise ValueError(f"samples, windows and batch must be >= 1, got {self.samples}, {self.windows}, "
                             f"{self.batch}")
        if {"ppl", "kl"} & set(self.tasks) and not 0 < self.scored < max(self.lengths):
            raise ValueError(f"scored tokens (--scored) must be in [1, {max(self.lengths) - 1}] for windows of "
                             f"{max(self.lengths)} tokens, got {self.scored}")


@dataclass
class EvalResult:
    method: str  # the name, with " b=F" where a byte budget chose the formats (`methods.label`)
    content: str
    rope: str
    sink: int
    recent: int
    bytes_per_token: float  # measured, per layer, at `bytes_length` tokens (protected tokens included)
    bytes_per_token_body: float  # formula: one quantized token, content + rope, per layer (mean over layers)
    bytes_per_token_bf16: int
    bytes_length: int
    bytes_per_token_long: float = 0.0  # measured as bytes_per_token, at LONG_CONTEXT tokens
    ppl: float | None = None
    ppl_bf16: float | None = None
    kl: float | None = None
    niah: dict[str, dict[int, float]] = field(default_factory=dict)
    # Each needle sample's outcome, "1" right / "0" wrong, in sample order (the same samples for every method,
    # so rows compare sample by sample: `paired_changes`).
    niah_samples: dict[str, dict[int, str]] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    costs: dict = field(default_factory=dict)  # run-time work besides cache bytes (e.g. an online rotation)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["percent_of_bf16"] = 100 * self.bytes_per_token / self.bytes_per_token_bf16
        d["percent_of_bf16_long"] = 100 * self.bytes_per_token_long / self.bytes_per_token_bf16
        return d


LONG_CONTEXT = 131072  # the context at which tables also give the bytes (what a quantized cache saves)


def measure_bytes_per_token(config: CacheConfig, kv_lora_rank: int, rope_dim: int, length: int) -> float:
    """Bytes per token per layer that QuantMLACache really holds after `length` BF16 tokens (the serving
    dtype; the evaluation itself may run in fp32), read from memory_bytes(): sink + body + staging + recent;
    with per-layer formats the mean over layers (each distinct format pair measured once)."""
    pairs = config.per_layer
    measured = {}
    for pair in dict.fromkeys(pairs):
        cache = QuantMLACache(CacheConfig(*pair, config.sink, config.recent, config.rope_rotation))
        # The bytes do not depend on the values: zeros are quicker to make than random tokens at 128 K.
        cache.update(torch.zeros(1, 1, length, kv_lora_rank, dtype=torch.bfloat16),
                     torch.zeros(1, 1, length, rope_dim, dtype=torch.bfloat16), 0)
        measured[pair] = cache.memory_bytes() / length
    return sum(measured[p] for p in pairs) / len(pairs)


def body_bytes_per_token(config: CacheConfig, kv_lora_rank: int, rope_dim: int) -> float:
    """One quantized token, content + rope, per layer by the formula (mean over layers)."""
    pairs = config.per_layer
    return sum(bytes_per_token(c, kv_lora_rank) + bytes_per_token(r, rope_dim) for c, r in pairs) / len(pairs)


def _formats(config: CacheConfig, path: int) -> str:
    """A path's format, or its per-layer formats joined by '|' where the layers differ."""
    names = [str(pair[path]) for pair in config.per_layer]
    return names[0] if len(set(names)) == 1 else "|".join(names)


# Needle prompts gain a BOS token; prompt + answer (fed teacher-forced) is `length` bytes, + this much slack.
LENGTH_SLACK = 32


def length_slack(settings: EvalSettings) -> int:
    """Tokens a window may need beyond its length: LENGTH_SLACK with needles, else none."""
    return LENGTH_SLACK if "niah" in settings.tasks else 0


def check_lengths(model, settings: EvalSettings) -> None:
    """Raise where a window outgrows the model's positions: ppl/kl's are the longest length, the needles' up
    to LENGTH_SLACK tokens more (so without needles a model's full context can be measured)."""
    max_pos = getattr(model.config, "max_position_embeddings", None)
    slack = length_slack(settings)
    if max_pos and max(settings.lengths) + slack > max_pos:
        needles = f" (+ up to {slack} tokens of BOS and answer)" if slack else ""
        raise ValueError(f"length {max(settings.lengths)}{needles} exceeds the model's max_position_embeddings "
                         f"{max_pos}: use --lengths up to {max_pos - slack}")


def check_something_quantized(model, config: CacheConfig, longest: int, method: str, slack: int = 0) -> None:
    """Raise where no scored query of `longest`-token windows would see a quantized key, so that `method`
    would measure as BF16 (KL 0). The first query that sees one is at sink + recent + block - 1 (`policy`:
    a token-axis format quantizes whole blocks); the last scored one, ppl/kl's, at longest - 2 (position
    longest - 1 predicts no token of the window). `slack`: tokens a window needs beyond its length
    (length_slack), counted where the error suggests longer lengths."""
    blocks = [block_of(f) for pair in config.per_layer for f in pair if f.kind != "bf16"]
    if not blocks:
        return
    bf16 = config.sink + config.recent + min(blocks)  # windows this long or shorter score no quantized key
    if longest > bf16:
        return
    max_pos = getattr(model.config, "max_position_embeddings", None)
    recent = longest - config.sink - min(blocks) - 1
    fix = (f"use lengths above {bf16}, or a smaller --recent" if not max_pos or bf16 + 1 + slack <= max_pos
           else f"use --recent {recent} or less (the model's {max_pos} positions allow no lengths that long)"
           if recent >= 0 else f"use a token block smaller than {min(blocks)} (the model's {max_pos} positions "
                                "allow no lengths that long)")
    block = f" + a block of {min(blocks)} tokens waiting to fill" if min(blocks) > 1 else ""
    raise ValueError(f"at {longest} tokens no scored token sees a quantized key (sink {config.sink} + recent "
                     f"{config.recent}{block} stay BF16), so {method} would measure as BF16: {fix}")


def heldout_windows(tokenizer, vocab_size: int, length: int, count: int, path=None) -> torch.Tensor:
    """Up to `count` non-overlapping windows [N, length] of the held-out text (shipped heldout.txt)."""
    ids = encode(read_text(path, "heldout.txt"), tokenizer, vocab_size, length * count)
    return token_windows(ids, length, count)


def evaluate(model, tokenizer, method: str, args: MethodArgs = MethodArgs(),
             settings: EvalSettings = EvalSettings(), reference_model=None, text_path=None) -> EvalResult:
    """Run `settings.tasks` for one method on `model` (eval mode; methods that fold transforms work on a
    copy). The KL's reference is a plain forward of `reference_model`, default `model`."""
    t0 = time.perf_counter()
    longest = max(settings.lengths)
    if method in BUDGETED and getattr(model.config, SECTION, None) is None:
        # quantmla calibrates an uncalibrated model first, for minutes: check the lengths before. Its formats
        # exist only after the calibration, its window before: check that with the least block.
        check_lengths(model, settings)
        window = CacheConfig("int4", "int4", SINK if args.sink is None else args.sink,
                             RECENT if args.recent is None else args.recent)
        check_something_quantized(model, window, longest, label(method, args), length_slack(settings))
    test_model, config = apply_method(method, model, args)
    check_lengths(model, settings)
    layer = describe(model)[0]
    dc, dr = layer.kv_lora_rank, layer.rope_dim
    check_something_quantized(model, config, longest, label(method, args), length_slack(settings))
    result = EvalResult(
        method=label(method, args), content=_formats(config, 0), rope=_formats(config, 1), sink=config.sink,
        recent=config.recent,
        bytes_per_token=measure_bytes_per_token(config, dc, dr, longest),
        bytes_per_token_body=body_bytes_per_token(config, dc, dr),
        bytes_per_token_bf16=2 * (dc + dr), bytes_length=longest,
        bytes_per_token_long=measure_bytes_per_token(config, dc, dr, LONG_CONTEXT),
        settings={**asdict(settings), "cache": config.to_dict()},
        costs=method_info(test_model, config),
    )
    if "ppl" in settings.tasks or "kl" in settings.tasks:
        count = settings.samples if settings.windows is None else settings.windows
        windows = heldout_windows(tokenizer, model.config.vocab_size, longest, count, text_path)
        per_window = perplexity.window_stats(test_model, windows, settings.scored, config,
                                             model if reference_model is None else reference_model,
                                             settings.batch, f"ppl/kl {method}", settings.progress)
        stats = perplexity.ppl_kl(per_window)
        result.ppl, result.ppl_bf16, result.kl = stats["ppl"], stats["ppl_bf16"], stats["kl"]
        result.settings["windows"] = list(windows.shape)
    if "niah" in settings.tasks:
        codec = retrieval.Codec(tokenizer, model.config.vocab_size)
        filler = read_text(text_path, "heldout.txt")  # held-out text, as the trainer's own needle evaluation
        per_sample = retrieval.niah(test_model, config, codec, list(settings.lengths), settings.samples,
                                    settings.seed, filler, settings.batch, settings.progress)
        result.niah = {t: {n: sum(o) / len(o) for n, o in by_n.items()} for t, by_n in per_sample.items()}
        result.niah_samples = {t: {n: "".join("01"[x] for x in o) for n, o in by_n.items()}
                               for t, by_n in per_sample.items()}
    result.seconds = time.perf_counter() - t0
    return result


def paired_changes(reference: str, other: str) -> tuple[int, int, float]:
    """Two methods' needle outcomes on the same samples ("1"/"0" strings, `EvalResult.niah_samples`):
    (lost: right in `reference`, wrong in `other`; gained: the reverse; p: exact two-sided McNemar p-value,
    the chance of a split at least this uneven among lost + gained changes if either direction were as
    likely)."""
    if len(reference) != len(other):
        raise ValueError(f"outcomes of {len(reference)} and {len(other)} samples: not the same samples")
    lost = sum(a == "1" and b == "0" for a, b in zip(reference, other))
    gained = sum(a == "0" and b == "1" for a, b in zip(reference, other))
    n, k = lost + gained, min(lost, gained)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return lost, gained, p
