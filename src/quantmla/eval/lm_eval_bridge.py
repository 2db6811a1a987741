"""lm-evaluation-harness bridge: evaluate any HF MLA model with any quantmla cache method through lm-eval.

Importing this module registers the lm-eval model ``quantmla``: lm-eval's own HFLM, except that
- every loglikelihood forward attends as a server does (`quantmla.eval.serving`): each query sees the sink
  and its own last `recent` tokens as computed and every other token as the cache stores it. A query never
  sees a later token, so the right padding of lm-eval's batches changes nothing: with channel formats a row
  scores what it scores with batch_size=1, at any length;
- every `generate` call prefills the prompt under the same serving semantics and writes it to a fresh
  `QuantMLACache`, through which it decodes (`quantmla.eval.serving.served_prefill`), so every prompt and
  generated token attends as on a server.

From the shell, `quantmla lm-eval` is lm-eval's own CLI with this model registered (device, batch size and
the rest as lm-eval's flags; the cache method in --model_args):

    quantmla lm-eval run --model quantmla --device cpu --tasks hellaswag \\
        --model_args pretrained=PATH,method=rtn,content=int4,rope=int4,dtype=float32

From Python:

    import lm_eval, quantmla.eval.lm_eval_bridge  # noqa: F401 (registers "quantmla")
    lm_eval.simple_evaluate(model="quantmla", model_args="method=rtn,content=int2,rope=int2", tasks=[...])

model_args (besides HFLM's own: device, dtype, batch_size, max_length, ...):
  pretrained   local checkpoint directory; default: quantmla's shipped default model
  method       a name from quantmla.eval.methods.METHODS (bf16, fp8, fp8-content, rtn, rtn-content, ...);
               default, as `quantmla eval`'s: quantmla for a calibrated checkpoint (its own formats), else bf16
  content, rope, sink, recent   the method's options, as `quantmla eval` spells them
  budget       quantmla only: the cache as a fraction of BF16's at 128 K tokens, formats chosen per layer

Generation batches are left-padded by lm-eval; `_model_generate` tells the cache each row's padding (from
the attention mask lm-eval passes it), so each row's sink is its own first tokens and, with channel formats,
a padded row is cached as it would be with batch_size=1 (what remains is the float rounding that batching
brings to any HF model's generations). Token-axis formats (e.g. int4:t64) still count their blocks over the
pads (the `quantmla.cache.quant_cache` docstring, "Padding"): use batch_size=1 with them when exactness
matters.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from quantmla.cache.quant_cache import QuantMLACache, left_pads
from quantmla.calibrate.export import SECTION, quantmla_section
from quantmla.data import check_token_ids, default_model_dir, tokenizer_for
from quantmla.eval.methods import MethodArgs, apply_method, check_method
from quantmla.eval.serving import served_prefill, serving
from quantmla.models.adapters import (ALIASES, cache_kwargs, check_checkpoint_dir, check_not_fp8_blocks,
                                      load_config, multimodal, read_config_json, stored_names)
from quantmla.policy import check_window_fits

OPTIONS = ("pretrained", "method", "content", "rope", "sink", "recent", "budget")


def _number(name: str, value, expected: str = "a number") -> float:
    """A model_args value that must be a number (lm-eval hands over "4" as 4, "0.3" as 0.3, "true" as True),
    or an error naming the arg (float's own named only the value)."""
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"model_args {name}={value!r}: expected {expected}")


def _whole(name: str, value) -> int:
    """A model_args value that must be a whole number ("4.0" comes as 4.0)."""
    number = _number(name, value, "a whole number")
    if not number.is_integer():  # also inf and nan, which int() raised on with its own words
        raise ValueError(f"model_args {name}={value!r}: expected a whole number")
    return int(number)


def _check_names(kwargs: dict) -> None:
    """A model_arg that is neither HFLM's nor ours but close to one of ours is a typo: refuse it here, before
    it reaches from_pretrained as an unknown keyword. Others pass through to HFLM (and the model) as before."""
    hflm = set(inspect.signature(HFLM.__init__).parameters)
    for name in kwargs:
        if name not in hflm and (close := difflib.get_close_matches(name, OPTIONS, n=1, cutoff=0.7)):
            raise ValueError(f"unknown model_args {name!r}; did you mean {close[0]!r}? quantmla's: "
                             f"{', '.join(OPTIONS)}")


def _check_checkpoint(path: str, tokenizer) -> None:
    """What lm-eval would fail on only later, or say unclearly: a model of another family (refused after it
    loaded), or a directory without a tokenizer (a multi-line error about sentencepiece and slow tokenizers)."""
    load_config(path)  # raises naming the model_type of a non-MLA checkpoint
    check_not_fp8_blocks(path)
    if tokenizer is None and tokenizer_for(path) is None:
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json), which lm-eval needs: "
                         "save the model's tokenizer there, or name one with model_args tokenizer=PATH")


def _own_config(pretrained) -> bool:
    """Whether `pretrained` is a checkpoint directory quantmla reads with a config of its choosing (`load_config`):
    an `ALIASES` model_type, or a multimodal checkpoint read as its language model (`adapters.Multimodal`)."""
    return (isinstance(pretrained, str) and (Path(pretrained) / "config.json").is_file()
            and (read_config_json(pretrained).get("model_type") in ALIASES or multimodal(pretrained) is not None))


def _calibrated(pretrained) -> bool:
    """Whether `pretrained` (a checkpoint directory or a loaded model) carries a quantmla section."""
    if isinstance(pretrained, str):
        return quantmla_section(pretrained) is not None
    return getattr(getattr(pretrained, "config", None), SECTION, None) is not None


@register_model("quantmla")
class QuantMLALM(HFLM):
    """HFLM whose loglikelihood forwards and generations attend under serving semantics for cache_config."""

    def __init__(self, pretrained=None, method: str | None = None, content: str | None = None,
                 rope: str | None = None, sink: int | None = None, recent: int | None = None,
                 budget: float | None = None, **kwargs):
        _check_names(kwargs)
        if pretrained is None:
            pretrained = str(default_model_dir())
        if isinstance(pretrained, str):
            check_checkpoint_dir(pretrained)  # a local directory: no machine here reaches a model hub
            _check_checkpoint(pretrained, kwargs.get("tokenizer"))
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        if method is None:
            method = "quantmla" if _calibrated(pretrained) else "bf16"
        # lm-eval parses model_args values itself: "int4" stays a string, "4" becomes an int.
        args = MethodArgs(None if content is None else str(content), None if rope is None else str(rope),
                          None if sink is None else _whole("sink", sink),
                          None if recent is None else _whole("recent", recent),
                          None if budget is None else _number("budget", budget))
        check_method(method, args)  # before the model loads: a bad option costs nothing
        # A sink + recent BF16 window over every position of the model quantizes nothing: the method scored as BF16
        # under its own name. `quantmla eval` refuses that window; so does this, with the values given.
        config = load_config(pretrained) if isinstance(pretrained, str) else pretrained.config
        check_window_fits(getattr(config.get_text_config(), "max_position_embeddings", None), args.sink or 0,
                          args.recent or 0)
        # Causal: lm-eval guesses it from AutoModelForCausalLM's own table, which lacks mistral4 (quantmla
        # registers it: `adapters.register_causal_lms`), and warns that the guess may be wrong.
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained=pretrained, **kwargs)
        self._model, self.cache_config = apply_method(method, self._model, args)
        self.method = method

    # A checkpoint of an aliased model_type (Kimi K2's kimi_k2, `adapters.ALIASES`) names code of its own, which
    # lm-eval's loaders refuse to run (trust_remote_code): read it with its family's classes, as quantmla does;
    # a multimodal one (Kimi K2.5, Mistral Small 4) as its language model, whose weights `key_mapping` names.
    def _get_config(self, pretrained, **kwargs) -> None:
        if not _own_config(pretrained):
            return super()._get_config(pretrained, **kwargs)
        self._config = load_config(pretrained)

    def _create_tokenizer(self, pretrained, tokenizer, **kwargs) -> None:
        if tokenizer is None and _own_config(pretrained):
            tokenizer = tokenizer_for(pretrained)
        super()._create_tokenizer(pretrained, tokenizer, **kwargs)

    def _create_model(self, pretrained, **kwargs) -> None:
        if _own_config(pretrained):
            kwargs["config"] = self._config
            if (mm := multimodal(pretrained)) is not None:
                kwargs["key_mapping"] = mm.key_mapping(mm.text_names(stored_names(pretrained)))
        super()._create_model(pretrained, **kwargs)

    # A tokenizer that is not the weights' own (model_args tokenizer=...) gives ids past the vocabulary, which
    # the forward fails on as 'index out of range in self': say so where the ids are made.
    def tok_encode(self, string: str, *args, **kwargs) -> list[int]:
        return check_token_ids(super().tok_encode(string, *args, **kwargs), self.model.config.vocab_size)

    def tok_batch_encode(self, strings: list[str], *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = super().tok_batch_encode(strings, *args, **kwargs)
        check_token_ids(ids.flatten(), self.model.config.vocab_size)  # the pad id goes through the embedding too
        return ids, mask

    def _cache_kwargs(self, left_padding=None) -> dict:
        return cache_kwargs(self.model, QuantMLACache(self.cache_config, left_padding=left_padding))

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits [batch, seq, vocab] of inps [batch, seq] (windows from position 0, right-padded) under serving
        semantics for the method's cache config (causal models only)."""
        if attn_mask is not None or labels is not None:
            raise ValueError("the quantmla lm-eval model supports decoder-only (causal) models only")
        with torch.no_grad(), serving(self.model, self.cache_config):
            return self.model(input_ids=inps, use_cache=False).logits

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """HFLM's, with a fresh cache told each row's left padding: context [batch, tokens] is left-padded, and
        generation_kwargs["attention_mask"] (as generate_until passes it) says where."""
        mask = generation_kwargs.get("attention_mask")
        # generate repeats each row before the first forward (beam search, several sequences): so do the counts.
        pads = None if mask is None else left_pads(mask).repeat_interleave(self._rows_per_context(generation_kwargs))
        with served_prefill(self.model, self.cache_config):
            return super()._model_generate(context, max_length, stop, **generation_kwargs,
                                           **self._cache_kwargs(pads))

    def _rows_per_context(self, generation_kwargs: dict) -> int:
        """Rows generate makes of each context: max(num_beams, num_return_sequences), as generate counts them,
        from the call's kwargs else the model's generation config."""
        config = self.model.generation_config
        return max(generation_kwargs.get(k, getattr(config, k, None)) or 1
                   for k in ("num_beams", "num_return_sequences"))

