"""Where models and text come from when the user names none, and how text becomes token ids.

The default model is the small trained MLA checkpoint shipped in `quantmla/default_model/`; the default
texts are `quantmla/data/calibration.txt` (from its training split) and `heldout.txt` (its held-out split).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = PACKAGE_DIR / "default_model"
DATA_DIR = PACKAGE_DIR / "data"


def default_model_dir() -> Path:
    """The shipped default model; if a checkout lacks it, a tiny random deepseek_v3 written to a temp dir."""
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR
    from quantmla.models.tiny import save_tiny_model

    path = Path(tempfile.gettempdir()) / "quantmla-tiny-deepseek_v3"
    if not (path / "config.json").is_file():
        save_tiny_model("deepseek_v3", path)
    return path


def resolve_model_dir(model: str | Path | None) -> Path:
    return default_model_dir() if model is None else Path(model)


def read_text(path: str | Path | None, default: str = "calibration.txt") -> str:
    """The user's text file, or the shipped sample `default` (quantmla/data/). Raises FileNotFoundError when
    the file is missing: a silent substitute would calibrate or evaluate on text nobody chose."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # use it, but say so: the replaced bytes change what is tokenized
            text = raw.decode("utf-8", errors="replace")
            warnings.warn(f"{path} is not UTF-8 (first bad byte at offset {e.start}): {text.count(chr(0xFFFD))} "
                          "characters were replaced with U+FFFD; convert it to UTF-8 to use its text as written",
                          stacklevel=2)
        if not text.strip():
            raise ValueError(f"text file is empty: {path}")
        return text
    shipped = DATA_DIR / default
    if not shipped.is_file():
        raise FileNotFoundError(f"shipped text {shipped} is missing (an incomplete install?); reinstall quantmla "
                                "or pass a text file of your own (--data)")
    return shipped.read_text(encoding="utf-8")


def _alias_config(model_dir: Path) -> dict:
    """{"config": ...} for a checkpoint of an aliased model_type (Kimi K2's kimi_k2, `ALIASES`): AutoTokenizer
    reads config.json, which transformers cannot build without the checkpoint's own code, and fails on the
    half-built config it falls back to (an AttributeError), even beside a plain tokenizer.json."""
    from quantmla.models.adapters import ALIASES, load_config, read_config_json

    if (model_dir / "config.json").is_file() and read_config_json(model_dir).get("model_type") in ALIASES:
        return {"config": load_config(model_dir)}
    return {}


def tokenizer_for(model_dir: str | Path):
    """The checkpoint's own tokenizer, or None when it ships none (the tiny test models). The checkpoint's
    own tokenizer code (an `auto_map` in tokenizer_config.json, as Kimi K2's) is never run; where
    transformers cannot build a tokenizer from the files without it (an empty vocabulary), this says so."""
    model_dir = Path(model_dir)
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    remedy = ("save the tokenizer there as a tokenizer.json (e.g. with `tokenizer.save_pretrained` where its code "
              "may run)")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False,
                                            **_alias_config(model_dir))
    except ValueError as e:
        if "custom code" not in str(e):
            raise ValueError(f"transformers could not read the tokenizer files in {model_dir} ({e}); fix or replace "
                             "its tokenizer.json / tokenizer_config.json") from None
        raise ValueError(f"transformers could not build a tokenizer from the files in {model_dir} without the "
                         f"checkpoint's own code, which quantmla does not run: {remedy}") from None
    except Exception as e:  # e.g. KeyError from a tokenizer.json of another schema
        raise ValueError(f"transformers could not read the tokenizer files in {model_dir} ({type(e).__name__}: "
                         f"{e}); fix or replace its tokenizer.json / tokenizer_config.json") from None
    if len(tok) <= 1:  # transformers 5 builds an empty tokenizer rather than fail
        raise ValueError(f"transformers could not build a tokenizer from the files in {model_dir} (a vocabulary of "
                         f"{len(tok)}; a tokenizer that needs its own code is not run): {remedy}")
    return tok


# A token rarely spans more characters than this: a prefix this many times the tokens needed is enough.
CHARS_PER_TOKEN_BOUND = 64


def encode(text: str, tokenizer, vocab_size: int, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids [N]. Without a tokenizer, bytes modulo the vocabulary (good enough for random test models;
    warned about where the vocabulary is larger than a byte-level one's). max_tokens: only the first that many
    are needed (`token_windows` takes windows from the start), so a long text is tokenized from a prefix."""
    if max_tokens is not None and len(text) > max_tokens * CHARS_PER_TOKEN_BOUND:
        ids = encode(text[: max_tokens * CHARS_PER_TOKEN_BOUND], tokenizer, vocab_size)
        if ids.numel() >= max_tokens:
            return ids[:max_tokens]
    if tokenizer is None:
        if vocab_size > 512:
            warnings.warn(f"the checkpoint has no tokenizer: text goes in as raw bytes modulo its {vocab_size}-token "
                          "vocabulary, which only suits byte-level models; add its tokenizer.json", stacklevel=2)
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % vocab_size
    return check_token_ids(torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"],
                                        dtype=torch.long), vocab_size)


def check_token_ids(ids, vocab_size: int):
    """`ids` (a tensor or list), or ValueError where the tokenizer gave an id past the model's vocabulary: a
    tokenizer that is not the weights' own, which the forward would fail on as 'index out of range in self'."""
    top = int(torch.as_tensor(ids).max()) if len(ids) else -1
    if top >= vocab_size:
        raise ValueError(f"the checkpoint's tokenizer gives token id {top}, but the model's vocabulary has "
                         f"{vocab_size} tokens: the tokenizer does not belong to these weights")
    return ids


def token_windows(ids: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """`count` consecutive, non-overlapping windows of `length` tokens: [count, length]."""
    if ids.numel() < length:
        raise ValueError(f"text too short: {ids.numel()} tokens, fewer than one window of {length}; give a longer "
                         "text file (--data) or shorter windows")
    count = min(count, ids.numel() // length)
    return ids[: count * length].view(count, length)
