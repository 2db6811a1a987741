"""RULER-style synthetic retrieval ("needle in a haystack") tasks.

Used to train the shipped default model and by the evaluation suite. Pure Python, deterministic given the
``random.Random`` passed in.

A sample is a haystack of filler lines with ``key: value`` needle lines hidden at random depths, followed by a
question; the model must continue ``prompt`` greedily with ``answer`` (short, ends with ``"\\n"``).

Format (all ASCII, so bytes == characters == tokens of the byte-level tokenizer)::

    <filler line>\\n ... qzkfmrb: 482913\\n <filler line>\\n ...
    Q: What is the value of qzkfmrb?\\nA: 482913\\n                       (single, multikey)
    Q: What are all the values of qzkfmrb, in order?\\nA: 482913 100374\\n  (multivalue)

Tasks:

- ``single``: one needle.
- ``multikey``: 3-5 needles with distinct keys; one of them is asked.
- ``multivalue``: one key occurring 2-4 times with different values; all are to be returned, in order of
  appearance, separated by single spaces.

``length`` is the total length of ``prompt + answer`` in bytes; it is met exactly whenever it is at least
the length of the needles, question and answer (otherwise the sample has no filler and is longer).
The byte-level tokenizer of the default model adds one BOS token in front of the prompt.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

TASKS = ("single", "multikey", "multivalue")

_KEY_ALPHABET = string.ascii_lowercase
_NON_PRINTABLE = re.compile(r"[^\x20-\x7e\n\t]")


@dataclass(frozen=True)
class NeedleSample:
    task: str
    prompt: str
    answer: str  # the model must continue `prompt` greedily with `answer`


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_KEY_ALPHABET) for _ in range(rng.randint(6, 7)))


def _value(rng: random.Random) -> str:
    return str(rng.randint(100000, 999999))


def question_for(task: str, key: str) -> str:
    """The question line(s) that end a prompt (the answer follows directly after ``"A: "``)."""
    if task == "multivalue":
        return f"Q: What are all the values of {key}, in order?\nA: "
    return f"Q: What is the value of {key}?\nA: "


# ----------------------------------------------------------------------------------------------------------
# built-in filler: plausible prose and code lines
_NOUNS = (
    "system", "model", "layer", "cache", "buffer", "request", "server", "token", "matrix", "vector", "record",
    "policy", "report", "window", "engine", "signal", "market", "river", "garden", "city", "winter", "teacher",
    "student", "library", "kernel", "thread", "budget", "result", "process", "network", "message", "channel",
)
_VERBS = (
    "updates", "reads", "writes", "stores", "returns", "computes", "checks", "sends", "builds", "loads",
    "moves", "keeps", "finds", "opens", "closes", "follows", "measures", "changes", "holds", "describes",
)
_ADJS = (
    "small", "large", "quiet", "fast", "slow", "early", "late", "stable", "recent", "simple", "careful", "open",
    "shared", "local", "remote", "empty", "full", "bright", "old", "new", "second", "final", "main", "short",
)
_ADVS = ("quickly", "rarely", "often", "again", "slowly", "always", "never", "carefully", "later", "today")
_IDENTS = ("x", "y", "n", "idx", "count", "total", "value", "item", "data", "state", "out", "buf", "size", "step")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(("The", "A", "Every", "This", "One")), rng.choice(_ADJS), rng.choice(_NOUNS),
             rng.choice(_VERBS), rng.choice(("the", "a", "each", "its")), rng.choice(_ADJS), rng.choice(_NOUNS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADVS))
    if rng.random() < 0.3:
        words += [rng.choice(("when", "because", "after", "while")), "the", rng.choice(_NOUNS),
                  rng.choice(_VERBS), "it"]
    return " ".join(words) + "."


def _code_line(rng: random.Random) -> str:
    a, b, c = rng.choice(_IDENTS), rng.choice(_IDENTS), rng.choice(_IDENTS)
    indent = " " * (4 * rng.randint(0, 3))
    form = rng.randrange(6)
    if form == 0:
        return f"{indent}{a} = {b} + {rng.randint(0, 99)}"
    if form == 1:
        return f"{indent}for {a} in range({b}):"
    if form == 2:
        return f"{indent}if {a} > {b}:"
    if form == 3:
        return f"{indent}return {a}.{rng.choice(_VERBS)[:-1]}({c})"
    if form == 4:
        return f"{indent}def {rng.choice(_VERBS)[:-1]}_{rng.choice(_NOUNS)}({a}, {b}):"
    return f"{indent}# {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {c}"


def _builtin_filler(n: int, rng: random.Random) -> str:
    parts: list[str] = []
    total = 0
    while total < n:
        if rng.random() < 0.6:
            line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        else:
            line = "\n".join(_code_line(rng) for _ in range(rng.randint(1, 5)))
        parts.append(line + "\n")
        total += len(parts[-1])
    return "".join(parts)


def _text_filler(text: str, n: int, rng: random.Random) -> str:
    """About ``n`` (>= n unless text is unusable) printable-ASCII characters from ``text``, starting at a random
    line boundary and wrapping around; only a slice of ``text`` is touched (O(n), not O(len(text)))."""
    size = len(text)
    start = rng.randrange(size)
    nl = text.find("\n", start)
    start = nl + 1 if 0 <= nl < size - 1 else 0
    parts: list[str] = []
    total = 0
    pos = start
    empty_rounds = 0
    while total < n:
        take = n - total + 64
        chunk = _NON_PRINTABLE.sub("", text[pos:pos + take])
        pos += take
        if pos >= size:
            pos = 0
        if chunk:
            parts.append(chunk)
            total += len(chunk)
            empty_rounds = 0
        else:
            empty_rounds += 1
            if empty_rounds > 2 + size // max(take, 1):
                return _builtin_filler(n, rng)
    return "".join(parts)


def _filler_lines(n: int, rng: random.Random, filler: str | None) -> list[str]:
    """Exactly ``n`` characters of filler, as lines each ending with ``"\\n"``."""
    if n <= 0:
        return []
    if filler is not None and filler.strip():
        s = _text_filler(filler, n, rng)
    else:
        s = _builtin_filler(n, rng)
    s = s[:n]
    if not s.endswith("\n"):
        s = s[:-1] + "\n"
    return s.splitlines(keepends=True)


# ----------------------------------------------------------------------------------------------------------
def make_sample(task: str, length: int, rng: random.Random, filler: str | None = None) -> NeedleSample:
    """One sample of ``task`` whose ``prompt + answer`` is ``length`` bytes long (see the module docstring).

    ``filler``: text to draw the haystack from (a random slice of it, non-printable/non-ASCII characters
    removed); ``None`` uses a built-in generator of prose and code lines.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if task == "single":
        key = _key(rng)
        value = _value(rng)
        needles = [f"{key}: {value}\n"]
        answer = value + "\n"
    elif task == "multikey":
        n_keys = rng.randint(3, 5)
        keys: list[str] = []
        while len(keys) < n_keys:
            k = _key(rng)
            if all(k != o and not k.startswith(o) and not o.startswith(k) for o in keys):
                keys.append(k)
        values = [_value(rng) for _ in keys]
        needles = [f"{k}: {v}\n" for k, v in zip(keys, values)]
        target = rng.randrange(n_keys)
        key, answer = keys[target], values[target] + "\n"
    else:  # multivalue
        key = _key(rng)
        n_values = rng.randint(2, 4)
        values: list[str] = []
        while len(values) < n_values:
            v = _value(rng)
            if v not in values:
                values.append(v)
        needles = [f"{key}: {v}\n" for v in values]
        answer = " ".join(values) + "\n"
    question = question_for(task, key)

    fixed = sum(len(x) for x in needles) + len(question) + len(answer)
    lines = _filler_lines(length - fixed, rng, filler)
    # random depths (line boundaries); needles keep their order (matters for multivalue)
    slots = sorted(rng.randint(0, len(lines)) for _ in needles)
    if task == "multikey":
        rng.shuffle(needles)
    out: list[str] = []
    j = 0
    for i in range(len(lines) + 1):
        while j < len(needles) and slots[j] == i:
            out.append(needles[j])
            j += 1
        if i < len(lines):
            out.append(lines[i])
    out.append(question)
    return NeedleSample(task=task, prompt="".join(out), answer=answer)
