"""Cache methods under evaluation: a name -> a small function giving (model, CacheConfig).

A method decides the formats of the two cache paths, which tokens stay in BF16, and, for methods that fold
transforms into the weights (later issues), the model to run. Adding a method is one function and one line
in `METHODS`. A method function must not modify the model it is given (the evaluator keeps that one as the
BF16 reference); one that changes weights returns a new model.

Methods available now (the baselines the README lists under "Quality"):
  bf16         no quantization (the reference)
  fp8          vLLM's plain FP8 KV cache: the whole 576-wide row in e4m3 with one fixed per-tensor scale
               (`fp8:0` on both paths), no protected tokens
  fp8-content  FlashMLA's 656-byte row: content e4m3 with an fp32 scale per 128 values, RoPE BF16,
               no protected tokens
  rtn          round-to-nearest on both paths (default int4/int4, group 64), sink 4 + recent 128 in BF16
  rtn-content  round-to-nearest content, RoPE left BF16, same protected tokens
and the methods of `eval/baselines.py` (BASELINES).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from quantmla.calibrate.budget import check_budget
from quantmla.config import CacheConfig, QuantFormat
from quantmla.eval.baselines import BASELINES, BUDGETED, RECENT, SINK
from quantmla.models.adapters import describe


@dataclass(frozen=True)
class MethodArgs:
    """The user's choices; None leaves the method's default. Formats are spelled as on the command line.

    budget: the cache as a fraction of BF16's at 128 K tokens (`calibrate.budget.CONTEXT`), in (0, 1]; the
    method then chooses the formats per path and layer (only `BUDGETED` methods take one), so it excludes
    content and rope."""

    content: str | None = None
    rope: str | None = None
    sink: int | None = None
    recent: int | None = None
    budget: float | None = None

    def __post_init__(self):
        for spec in (self.content, self.rope):
            if spec is not None:
                QuantFormat.parse(spec)  # fail early, with the format's own message
        for name in ("sink", "recent"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.budget is not None:
            check_budget(self.budget)
            if self.content is not None or self.rope is not None:
                raise ValueError(f"a byte budget ({self.budget}) chooses the formats per layer; it cannot be given "
                                 f"with content/rope formats ({self.content}/{self.rope})")


def _pick(value, default):
    return default if value is None else value


def _fixed_formats(name: str, args: MethodArgs, content: str, rope: str) -> None:
    """Methods defined by their formats refuse other formats rather than silently ignoring them."""
    for path, given, fixed in (("content", args.content, content), ("rope", args.rope, rope)):
        if given is not None and QuantFormat.parse(given) != QuantFormat.parse(fixed):
            other = "'rtn'" if name == "rtn-content" else "'rtn' or 'rtn-content'"
            raise ValueError(f"method {name!r} stores {path} as {fixed}; --{path} {given} is not allowed "
                             f"(use method {other} to choose formats)")


def _fixed(name: str, content: str, rope: str) -> Callable:
    def method(model: nn.Module, args: MethodArgs) -> tuple[nn.Module, CacheConfig]:
        _fixed_formats(name, args, content, rope)
        return model, CacheConfig(content, rope, _pick(args.sink, 0), _pick(args.recent, 0))

    return method


def rtn(model: nn.Module, args: MethodArgs) -> tuple[nn.Module, CacheConfig]:
    return model, CacheConfig(_pick(args.content, "int4"), _pick(args.rope, "int4"),
                              _pick(args.sink, SINK), _pick(args.recent, RECENT))


def rtn_content(model: nn.Module, args: MethodArgs) -> tuple[nn.Module, CacheConfig]:
    _fixed_formats("rtn-content", args, args.content or "int4", "bf16")
    return model, CacheConfig(_pick(args.content, "int4"), "bf16", _pick(args.sink, SINK), _pick(args.recent, RECENT))


METHODS: dict[str, Callable[[nn.Module, MethodArgs], tuple[nn.Module, CacheConfig]]] = {
    "bf16": _fixed("bf16", "bf16", "bf16"),
    "fp8": _fixed("fp8", "fp8:0", "fp8:0"),
    "fp8-content": _fixed("fp8-content", "fp8:128", "bf16"),
    "rtn": rtn,
    "rtn-content": rtn_content,
    **BASELINES,
}


def check_method(name: str, args: MethodArgs) -> None:
    """Raises ValueError on an unknown method, or on a budget for a method that would ignore it."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    if args.budget is not None and name not in BUDGETED:
        raise ValueError(f"method {name!r} takes no byte budget; the methods that do: {', '.join(BUDGETED)} "
                         f"(e.g. quantmla@budget={args.budget})")


def label(name: str, args: MethodArgs) -> str:
    """A results row's method column: the name, and the budget where one chose the formats."""
    return name if args.budget is None else f"{name} b={args.budget:g}"


def apply_method(name: str, model: nn.Module, args: MethodArgs = MethodArgs()) -> tuple[nn.Module, CacheConfig]:
    """(model to run, cache config fitted to the model's dims). Raises ValueError as `check_method` does, or on
    a format that does not fit the model (e.g. a group that does not divide the path)."""
    check_method(name, args)
    model, config = METHODS[name](model, args)
    layer = describe(model)[0]
    return model, config.fit(layer.kv_lora_rank, layer.rope_dim)
