"""The OpenAI-compatible server (quantmla.engine.server) over real HTTP: uvicorn on 127.0.0.1 in a background
thread, the real engine on the shipped default model on the CPU, httpx as the client.

Expected outputs come from the same LLM's `generate`, run before the server takes the engine over (greedy
outputs do not depend on the batch, which the engine's own tests check)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import torch
import uvicorn

from quantmla.engine import LLM, RequestOutput, SamplingParams
from quantmla.data import default_model_dir
from quantmla.engine.server import APIError, Server, TextStream, build_app

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 24
MAX_NUM_SEQS = 8
PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Point:\n    def __init__(self", "for i in range(",
           "# Copyright", "x = [", "    if not ", "def main():"]
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
CHAT_TEXT = "system: You write Python.\nuser: def add(a, b):\nassistant: "  # the fallback template


@dataclass
class Served:
    url: str
    llm: LLM
    server: Server
    client: httpx.Client
    expected: dict[str, RequestOutput]  # greedy, MAX_TOKENS, per prompt (and CHAT_TEXT)

    def stats(self) -> dict:
        return self.server.engine.stats()  # the engine thread's snapshot: safe from this thread

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Stats once no request holds pages any more; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["pages_used"] == 0 and s["running"] == s["waiting"] == 0:
                return s
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {s}"
            time.sleep(0.02)


def run_in_thread(server: uvicorn.Server) -> tuple[threading.Thread, socket.socket, str]:
    """Start `server` on a free local port in a daemon thread; returns (thread, socket, base url) once it serves."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return thread, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def served(one_thread):
    llm = LLM(device="cpu", kv_cache_bytes=14 << 20, max_num_seqs=MAX_NUM_SEQS)
    # a pool smaller than the model's limit, so "larger than the pool" and "longer than the model" differ
    assert 1000 < llm.capacity_tokens < llm.max_model_len - 200
    params = SamplingParams(max_tokens=MAX_TOKENS)
    expected = {p: llm.generate(p, params)[0] for p in [*PROMPTS, CHAT_TEXT]}
    app = build_app(llm)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread, sock, url = run_in_thread(server)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield Served(url, llm, app.state.server, client, expected)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def sse_events(lines) -> list[dict]:
    """The JSON events of an SSE body; checks the framing and that `data: [DONE]` comes last."""
    data = [line[len("data: "):] for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line)
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def stream(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(list(r.iter_lines()))


def streamed_text(events: list[dict], chat: bool) -> str:
    key = (lambda c: c["delta"].get("content", "")) if chat else (lambda c: c["text"])
    return "".join(key(c) for e in events for c in e["choices"])


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert err["code"] == code, err
    return err


def metrics(served: Served) -> dict[str, float]:
    r = served.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def good_request_works(served: Served):
    p = PROMPTS[0]
    r = served.client.post("/v1/completions", json={"prompt": p, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.llm.decode(
        served.expected[p].token_ids[:3])


# --------------------------------------------------------------------------------------------- basics
def test_models_health_and_metrics(served):
    r = served.client.get("/v1/models").json()
    assert r["object"] == "list" and [m["id"] for m in r["data"]] == [served.llm.model_name]
    # what one request can get: the model's limit, or the pool where that holds fewer tokens
    assert r["data"][0]["max_model_len"] == min(served.llm.max_model_len, served.llm.capacity_tokens)
    assert served.client.get("/health").json() == {"status": "ok"}
    assert served.client.head("/health").status_code == 200  # load balancers probe with HEAD
    assert served.client.get(f"/v1/models/{served.llm.model_name}").json() == r["data"][0]
    assert served.client.get("/v1/models/gpt-4").status_code == 404
    m = metrics(served)
    assert m["quantmla_kv_pages_total"] == served.stats()["pages_total"] > 0
    assert m["quantmla_kv_pages_used"] + m["quantmla_kv_pages_free"] == m["quantmla_kv_pages_total"]
    assert m["quantmla_kv_capacity_tokens"] == served.llm.capacity_tokens
    for name in ("quantmla_requests_running", "quantmla_requests_waiting", "quantmla_preemptions_total",
                 "quantmla_generation_tokens_total", "quantmla_output_tokens_per_second"):
        assert name in m


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_equals_the_engine(served, as_ids):
    p = PROMPTS[2]
    want = served.expected[p]
    prompt = want.prompt_token_ids if as_ids else p
    r = served.client.post("/v1/completions", json={"model": served.llm.model_name, "prompt": prompt,
                                                    "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == served.llm.model_name and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
    n_prompt, n_out = len(want.prompt_token_ids), len(want.token_ids)
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def test_chat_uses_the_fallback_template(served):
    assert not getattr(served.llm.tokenizer, "chat_template", None)  # else the fallback is not what runs
    want = served.expected[CHAT_TEXT]
    r = served.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(want.token_ids)


def test_chat_text_parts_are_joined_by_newlines(served):
    """A message's list of text parts reads as its texts joined by newlines, as vLLM joins them."""
    parts = [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]
    got = [served.client.post("/v1/chat/completions", json={
        "messages": [CHAT[0], {"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}).json()
        for content in (parts, "def add\n(a, b):")]
    assert got[0]["choices"][0]["message"] == got[1]["choices"][0]["message"]
    assert got[0]["usage"] == got[1]["usage"]


def test_text_prompts_get_the_tokenizers_bos_once(served, monkeypatch):
    """Text is encoded with the tokenizer's special tokens, as transformers and vLLM encode it (the default model
    was trained with its BOS first); a rendered chat template's text holds its own BOS, which is not doubled."""
    tok = served.llm.tokenizer
    p = PROMPTS[0]
    assert tok.encode(p)[0] == tok.bos_token_id != tok.encode(p, add_special_tokens=False)[0]
    assert served.expected[p].prompt_token_ids == tok.encode(p)
    r = served.client.post("/v1/completions", json={"prompt": p, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(p))
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    monkeypatch.setattr(served.server.prompt_tokenizer, "chat_template", template, raising=False)
    r = served.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(CHAT_TEXT))  # one BOS, from the template


def test_a_chat_its_template_refuses_is_a_bad_request(served, monkeypatch):
    """A chat template's raise_exception (roles it does not take, roles out of order) is the request's fault: a 400
    naming messages, not a 500 with a traceback."""
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}"
                "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")
    monkeypatch.setattr(served.server.prompt_tokenizer, "chat_template", template, raising=False)
    r = served.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert "System role not supported" in assert_openai_error(r, 400, "messages")["message"]
    r = served.client.post("/v1/chat/completions", json={"messages": CHAT[1:], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text  # the template runs where it does not refuse
    assert served.wait_idle()["pages_used"] == 0


@pytest.mark.parametrize("streaming", [False, True])
def test_a_list_of_prompts_gets_a_choice_each(served, streaming):
    """OpenAI's batch form: prompt as a list of strings or of token-id lists; choice i answers prompt i (the
    engine's greedy output of it alone), and the usage sums the prompts."""
    ps = PROMPTS[:3]
    want = [served.expected[p] for p in ps]
    for prompt in (ps, [w.prompt_token_ids for w in want]):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        if streaming:
            *chunks, last = stream(served.client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            choices = [c for e in chunks for c in e["choices"]]
            assert all(len(e["choices"]) == 1 for e in chunks) and len({e["id"] for e in chunks}) == 1
            texts = ["".join(c["text"] for c in choices if c["index"] == i) for i in range(len(ps))]
            reasons = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
            usage = last["usage"]
        else:
            r = served.client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1, 2]
            texts = [c["text"] for c in choices]
            reasons = {c["index"]: c["finish_reason"] for c in choices}
            usage = r.json()["usage"]
        assert texts == [w.text for w in want]
        assert reasons == {i: w.finish_reason for i, w in enumerate(want)}
        n_prompt, n_out = sum(len(w.prompt_token_ids) for w in want), sum(len(w.token_ids) for w in want)
        assert usage == {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    assert served.wait_idle()["pages_used"] == 0


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming(served, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": CHAT} if chat else {"prompt": PROMPTS[0]}
    body.update(max_tokens=MAX_TOKENS, temperature=0)
    whole = served.client.post(path, json=body).json()
    events = stream(served.client, path, {**body, "stream_options": {"include_usage": True}})
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(e["id"] == chunks[0]["id"] for e in events)
    assert {e["object"] for e in events} == {"chat.completion.chunk" if chat else "text_completion"}
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    reasons = [e["choices"][0]["finish_reason"] for e in chunks]
    want = whole["choices"][0]
    assert reasons[-1] == want["finish_reason"] and set(reasons[:-1]) == {None}
    assert len(chunks) >= 3  # it did stream
    assert streamed_text(chunks, chat) == (want["message"]["content"] if chat else want["text"])
    # without stream_options, no usage chunk
    assert all("usage" not in e for e in stream(served.client, path, body))


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_trims_and_frees_the_request(served, streaming):
    p = PROMPTS[0]
    text = served.expected[p].text  # 24 greedy tokens of the default model, e.g. " add(a, b)\n\n\ndef _add_args"
    # A two-character stop string from the middle of the text whose first occurrence is not at its start.
    stop = next(text[k:k + 2] for k in range(len(text) // 3, len(text) - 2) if text.index(text[k:k + 2]) > 0)
    cut = text[: text.index(stop)]
    assert 0 < len(cut) < len(text) - 2
    body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": ["never there", stop]}
    before = served.wait_idle()
    if streaming:
        events = stream(served.client, "/v1/completions", body)
        got, reason = streamed_text(events, False), events[-1]["choices"][0]["finish_reason"]
    else:
        choice = served.client.post("/v1/completions", json=body).json()["choices"][0]
        got, reason = choice["text"], choice["finish_reason"]
    assert got == cut and reason == "stop"
    after = served.wait_idle()
    assert after["tokens_generated"] - before["tokens_generated"] < MAX_TOKENS  # aborted at the stop string
    finished = {r: after["finished"].get(r, 0) - before["finished"].get(r, 0) for r in ("stop", "abort")}
    assert finished == {"stop": 1, "abort": 0}  # /metrics counts it as the client saw it


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_on_the_last_allowed_token_counts_as_stop(served, streaming):
    """The engine ends the request for its length on the very step whose token completes a stop string: the
    client gets "stop", and /metrics counts "stop", not the engine's "length"."""
    p = PROMPTS[0]
    want, tok = served.expected[p], served.llm.tokenizer
    stop = want.text[len(want.text) // 2:][:2]
    n = next(n for n in range(1, len(want.token_ids) + 1) if stop in tok.decode(want.token_ids[:n]))
    body = {"prompt": p, "max_tokens": n, "temperature": 0, "stop": [stop]}
    before = served.wait_idle()
    if streaming:
        events = stream(served.client, "/v1/completions", body)
        reason = events[-1]["choices"][0]["finish_reason"]
    else:
        reason = served.client.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"]
    after = served.wait_idle()
    assert reason == "stop" and after["tokens_generated"] - before["tokens_generated"] == n  # the engine ran out
    finished = {r: after["finished"].get(r, 0) - before["finished"].get(r, 0) for r in ("stop", "length", "abort")}
    assert finished == {"stop": 1, "length": 0, "abort": 0}


# --------------------------------------------------------------------------------------------- detokenization
def feed(stream_: TextStream, ids: list[int]) -> list[str]:
    return [stream_.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_text_stream_holds_back_split_utf8_and_stop_prefixes(served):
    tok = served.llm.tokenizer
    text = "aé€😀b = 1"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-level: characters split over tokens
    deltas = feed(TextStream(tok), ids)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert deltas[ids.index(tok.encode("€", add_special_tokens=False)[0])] == ""  # held back mid-character
    s = TextStream(tok, stop=("😀b",))
    deltas = feed(s, ids)
    assert "".join(deltas) == "aé€" and s.stopped
    # a tail that may begin a stop string waits; it goes out once it cannot
    s = TextStream(tok, stop=("= 2",))
    deltas = feed(s, ids)
    assert "".join(deltas) == text and not s.stopped
    assert deltas[-2] == "" and deltas[-1] == "= 1"


@pytest.mark.parametrize("stop", [("y",), ("y = 2\nz", "2")])
def test_text_stream_stops_at_the_same_token_in_any_chunking(served, stop):
    """The text and the token count (the usage's completion_tokens) end at the token that completes a stop
    string, however the tokens arrive: a handler that fell behind pushes several at once. They counted every
    token of the push, and a stop that a later token completes could win over one an earlier token did."""
    tok = served.llm.tokenizer
    ids = tok.encode("x = 1\ny = 2\nz = 3\n", add_special_tokens=False)
    one = TextStream(tok, stop=stop)
    text = "".join(feed(one, ids))
    assert one.stopped and 0 < len(one.token_ids) < len(ids)
    for n in (2, 5, len(ids)):
        s = TextStream(tok, stop=stop)
        assert "".join(s.push(ids[k : k + n], final=k + n >= len(ids)) for k in range(0, len(ids), n)) == text
        assert s.token_ids == one.token_ids


class CountingTokenizer:
    """A tokenizer that records the length of every id list it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def test_text_stream_matches_the_full_decode_in_any_chunking(served):
    tok = served.llm.tokenizer
    gen = torch.Generator().manual_seed(0)
    # Random ids: byte tokens that split or break UTF-8 characters included, special tokens too.
    ids = torch.randint(0, len(tok), (600,), generator=gen).tolist()
    ids += tok.encode("x = 'é€😀' \n" * 20, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    for trial in range(3):
        s, got, k = TextStream(tok), [], 0
        while k < len(ids):
            n = int(torch.randint(1, 9, (1,), generator=gen)) if trial else 1
            got.append(s.push(ids[k : k + n], final=k + n >= len(ids)))
            k += n
        assert "".join(got) == full


def test_text_stream_decodes_a_short_window_per_token(served):
    """A long output costs the same per token at its end as at its start (it was re-decoded whole per chunk)."""
    tok = CountingTokenizer(served.llm.tokenizer)
    ids = served.llm.tokenizer.encode("def f(a, b):\n    return a + b\n\n" * 150, add_special_tokens=False)
    assert len(ids) > 1000
    s = TextStream(tok, stop=("never",))
    text = "".join(s.push([t], final=False) for t in ids) + s.push([], final=True)
    assert text == served.llm.tokenizer.decode(ids, skip_special_tokens=True)
    assert max(tok.lengths) <= 8 and len(tok.lengths) <= 2 * len(ids) + 2


def test_text_stream_keeps_spaces_a_decoder_strips_at_the_start():
    """A SentencePiece-style decoder drops the first token's leading space: only at the text's start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["\u2581the", "\u2581cat", "\u2581sat", "\u2581on", "\u2581mat", "\u2581", "s", "."]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    ids = [0, 1, 6, 2, 3, 0, 4, 7, 5, 1]
    full = tok.decode(ids)
    assert full.startswith("the cats sat")  # the first space is stripped, the others are not
    s = TextStream(tok)
    assert "".join(s.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)) == full


# --------------------------------------------------------------------------------------------- bad requests
BAD = [
    ("/v1/completions", '{"prompt": "x", ', 400, None, None),  # malformed JSON
    ("/v1/completions", '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", 400, None, None),  # too deep to parse
    ("/v1/completions", "[1, 2]", 400, None, None),  # not an object
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [["a"], ["b"]]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [300]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", None),  # torch's generators take 64 bits
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),  # > 16
    ("/v1/completions", {"prompt": "x", "stop": "y" * 1025}, 400, "stop", None),  # > 1024 characters
    ("/v1/completions", '{"prompt": "a\\ud800b"}', 400, "prompt", None),  # a lone surrogate: no UTF-8
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]},
     400, "messages", None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages", None),
    # a role is text in the prompt too (it was reported as the prompt's, a field the client never sent)
    ("/v1/chat/completions", '{"messages": [{"role": "us\\ud800er", "content": "hi"}]}', 400, "messages", None),
    ("/v1/completions", {"prompt": "x", "stream": True, "n": 3}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1}, 400, "prompt", None),  # > the pool
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", None),  # > the pool
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),  # JSON types are strict
    ("/v1/completions", {"prompt": [True, False]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["x", 5]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["x"] * 257}, 400, "prompt", None),  # > MAX_PROMPTS
    ("/v1/completions", {"prompt": ["x", "x" * 5000], "max_tokens": 1}, 400, "prompt", None),  # the 1st is aborted
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 5}, 400, "logprobs", None),  # not implemented: refused
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", None),
    # True == 1 and False == 0 in Python: these were taken for the no-op values and ignored
    ("/v1/completions", {"prompt": "x", "logprobs": 0}, 400, "logprobs", None),  # the sampled tokens' logprobs
    ("/v1/completions", {"prompt": "x", "best_of": True}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "echo": 0}, 400, "echo", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", None),
    ("/v1/chat/completions", {}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", None),  # was read as ""
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n", None),
    # the errors name max_completion_tokens where the client sent that (they said max_tokens)
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", None),
    # a prompt over the model's limit is the prompt's fault, also where the server picks max_tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "prompt", None),
]


def test_error_messages_say_what_was_expected(served):
    r = served.client.post("/v1/completions", json={"prompt": [["a"], ["b"]]})
    assert "a string, a list of token ids, or a list of either" in r.json()["error"]["message"]
    r = served.client.post("/v1/completions", data={"prompt": "x"})  # a form, as `curl -d` sends
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    # a list of content parts fails both arms of content's union: the error is the part's, not "a valid string"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for part, said in ((image, "0.type: Input should be 'text'"), ({"type": "text"}, "0.text: Field required")):
        r = served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
        assert_openai_error(r, 400, "messages")
        assert said in r.json()["error"]["message"] and "valid string" not in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, status, param, code", BAD)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, path, body, status, param, code):
    if isinstance(body, str):
        r = served.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = served.client.post(path, json=body)
    assert_openai_error(r, status, param, code)
    assert served.wait_idle()["pages_used"] == 0  # nothing was queued
    good_request_works(served)


def test_no_op_values_of_unimplemented_options_are_accepted(served):
    p = PROMPTS[0]
    body = {"prompt": p, "max_tokens": 3, "temperature": 0, "logprobs": None, "echo": False, "best_of": 1,
            "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "user": "someone"}
    r = served.client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.llm.decode(
        served.expected[p].token_ids[:3])
    r = served.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "tools": [],
                                                         "tool_choice": "none", "response_format": {"type": "text"}})
    assert r.status_code == 200


def test_null_is_the_default(served):
    """OpenAI's API takes null for its optional fields (clients send it for "not set"): these were refused."""
    p = PROMPTS[0]
    nulls = dict.fromkeys(["temperature", "top_p", "top_k", "n", "stream", "stream_options", "seed", "stop",
                           "ignore_eos", "stop_token_ids", "logprobs", "echo", "presence_penalty"])
    r = served.client.post("/v1/completions", json={"prompt": p, "max_tokens": 3, **nulls, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.llm.decode(
        served.expected[p].token_ids[:3])
    r = served.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **nulls,
                                                         "max_completion_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    # a required field stays required
    assert_openai_error(served.client.post("/v1/completions", json={"prompt": None}), 400, "prompt")
    assert_openai_error(served.client.post("/v1/chat/completions", json={"messages": None}), 400, "messages")


def test_vllm_extras_stop_token_ids_and_ignore_eos(served, monkeypatch):
    """vLLM's stop_token_ids and ignore_eos (serving benchmarks send ignore_eos for a fixed output length) reach
    the engine; they were accepted and ignored."""
    p = PROMPTS[0]
    ids = served.expected[p].token_ids
    stop = ids[2]
    n = ids.index(stop) + 1  # the output ends at the first stop token, which it includes
    body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = served.client.post("/v1/completions", json={**body, "stop_token_ids": [stop]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n and r.json()["choices"][0]["finish_reason"] == "stop"
    monkeypatch.setattr(served.llm, "eos", {*served.llm.eos, stop})  # the model's eos comes at token n
    r = served.client.post("/v1/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == n
    r = served.client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS and r.json()["choices"][0]["finish_reason"] == "length"
    for bad in ({"ignore_eos": 1}, {"stop_token_ids": ["a"]}, {"min_tokens": 4}, {"repetition_penalty": 1.2}):
        assert_openai_error(served.client.post("/v1/completions", json={**body, **bad}), 400, next(iter(bad)))
    served.wait_idle()


class SlowTokenizer:
    """The server's tokenizer, but encoding a prompt that starts with "SLOW" takes `seconds`."""

    def __init__(self, tokenizer, seconds: float):
        self.tokenizer, self.seconds = tokenizer, seconds

    def encode(self, text, **kw):
        if text.startswith("SLOW"):
            time.sleep(self.seconds)
        return self.tokenizer.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_tokenizing_a_long_prompt_does_not_stall_the_server(served, monkeypatch):
    """Tokenizing happens off the asyncio loop: /health answers while a prompt takes seconds to encode."""
    monkeypatch.setattr(served.server, "prompt_tokenizer", SlowTokenizer(served.server.prompt_tokenizer, 2.0))
    slow = threading.Thread(target=lambda: served.client.post(
        "/v1/completions", json={"prompt": "SLOW x", "max_tokens": 1}))
    slow.start()
    time.sleep(0.3)  # the slow request is being tokenized now
    t0 = time.monotonic()
    assert served.client.get("/health").status_code == 200
    waited = time.monotonic() - t0
    slow.join()
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a prompt being tokenized"
    served.wait_idle()
    good_request_works(served)


def test_tokenizing_a_long_prompt_does_not_stall_other_streams(served, monkeypatch):
    """A stream running while another request's prompt takes seconds to encode keeps getting its chunks (the
    outputs are detokenized on a thread of their own, not behind the prompt). Seen with a 16 MB prompt: every
    other stream stopped for 23 s."""
    tok_class = type(served.llm.tokenizer)
    encode = tok_class.encode

    def slow_encode(self, text, *a, **kw):  # on the class: whatever copy of the tokenizer the server encodes with
        if isinstance(text, str) and text.startswith("SLOW"):
            time.sleep(2.0)
        return encode(self, text, *a, **kw)

    monkeypatch.setattr(tok_class, "encode", slow_encode)
    slow = threading.Thread(target=lambda: served.client.post(
        "/v1/completions", json={"prompt": "SLOW x", "max_tokens": 1}))
    body = {"prompt": "def main():", "max_tokens": 200, "temperature": 0, "stream": True}  # no eos: ~2 s or more
    gaps = []
    with served.client.stream("POST", "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line)
        next(lines)  # the stream runs: now a prompt starts its 2 s of tokenizing
        slow.start()
        last = time.monotonic()
        for _ in lines:
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
    slow.join()
    assert len(gaps) > 10 and max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s behind a prompt's tokenizing"
    served.wait_idle()
    good_request_works(served)


def test_pool_and_model_limits_are_told_apart(served):
    pool = {"prompt": "x" * (served.llm.capacity_tokens + 100), "max_tokens": 1}
    model = {"prompt": "x" * (served.llm.max_model_len + 1), "max_tokens": 1}
    assert "KV pool" in assert_openai_error(served.client.post("/v1/completions", json=pool), 400)["message"]
    assert "model's limit" in assert_openai_error(served.client.post("/v1/completions", json=model), 400)["message"]
    assert served.wait_idle()["pages_used"] == 0
    good_request_works(served)


def test_unknown_route_and_method_get_openai_errors(served):
    assert served.client.get("/v1/nothing").status_code == 404
    assert served.client.get("/v1/completions").status_code == 405
    assert "error" in served.client.get("/v1/nothing").json()


def test_an_engine_failure_fails_its_requests_not_the_server(served):
    llm = served.llm

    def boom():
        del llm.step  # fail once, then the class's step is back
        raise RuntimeError("injected engine failure")

    served.wait_idle()
    llm.step = boom
    r = served.client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8})
    assert r.status_code == 500 and "injected engine failure" in r.json()["error"]["message"]
    assert "step" not in vars(llm)
    served.wait_idle()
    good_request_works(served)


# --------------------------------------------------------------------------------------------- concurrency
async def _completion(client: httpx.AsyncClient, prompt: str, streaming: bool, max_tokens: int = MAX_TOKENS):
    """(text, finish_reason, completion_tokens) of one greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if not streaming:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0]["text"], j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"]
    body.update(stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        *chunks, usage = sse_events([line async for line in r.aiter_lines()])
    return streamed_text(chunks, False), chunks[-1]["choices"][0]["finish_reason"], usage["usage"]["completion_tokens"]


def test_concurrent_requests_each_get_their_own_output(served):
    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return await asyncio.gather(*(_completion(client, p, i % 2 == 1) for i, p in enumerate(PROMPTS)))

    got = asyncio.run(run())
    for p, (text, reason, n) in zip(PROMPTS, got):
        want = served.expected[p]
        assert (text, reason, n) == (want.text, want.finish_reason, len(want.token_ids)), p
    assert served.wait_idle()["peak_batch"] >= 4  # they did run together


def test_requests_that_overflow_the_pool_are_preempted_not_lost(served):
    """Eight concurrent long requests need ~1.6x the pool: the server preempts (recompute) and still answers each
    with the tokens an unlimited pool gives, and frees every page."""
    prompts = [(p + " ") * (400 // len(p) + 1) for p in PROMPTS]
    params = SamplingParams(max_tokens=160)
    free = LLM(device="cpu", max_num_seqs=MAX_NUM_SEQS)
    outs = free.generate(prompts, params)
    want = [o.text for o in outs]
    assert free.stats()["preemptions"] == 0
    need = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    assert need > 1.5 * served.llm.capacity_tokens, (need, served.llm.capacity_tokens)
    before = served.wait_idle()

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": 160, "temperature": 0}
        if i % 2:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                return streamed_text(sse_events([line async for line in r.aiter_lines()]), False)
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    assert asyncio.run(run()) == want
    after = served.wait_idle()
    assert after["preemptions"] > before["preemptions"]
    assert after["pages_used"] == 0 and after["pages_free"] == after["pages_total"]


@pytest.mark.parametrize("streaming", [True, False])
def test_client_disconnect_aborts_and_frees_pages(served, streaming):
    before, aborted = served.wait_idle(), served.stats()["finished"].get("abort", 0)
    body = {"prompt": "def main():", "max_tokens": 2000, "temperature": 0}  # greedy: 2000 tokens, no eos
    if streaming:
        with served.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert sum(line.startswith("data: ") for line, _ in zip(lines, range(12))) >= 5
            assert served.stats()["pages_used"] > 0
    else:  # the client gives up waiting: its connection closes while the request runs
        with pytest.raises(httpx.ReadTimeout):
            served.client.post("/v1/completions", json=body, timeout=1.0)
        assert served.stats()["pages_used"] > 0
    after = served.wait_idle(timeout=8)  # 2000 tokens would take far longer on a CPU
    assert after["tokens_generated"] - before["tokens_generated"] < 2000
    assert metrics(served)['quantmla_requests_finished_total{reason="abort"}'] == aborted + 1  # not run out
    good_request_works(served)


def test_load_200_requests_16_clients(served):
    n_requests, n_clients = 200, 16
    before, m0 = served.wait_idle(), metrics(served)
    results: list = [None] * n_requests

    async def client_task(client, next_index):
        while (i := next(next_index, None)) is not None:
            prompt = PROMPTS[i % len(PROMPTS)] + str(i)
            if i % 3 == 2:
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 1 + i % 4, "temperature": 0.8,
                    "seed": i})
                assert r.status_code == 200, r.text
                j = r.json()
                results[i] = (j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"])
            else:
                _, reason, n = await _completion(client, prompt, i % 3 == 1, max_tokens=1 + i % 4)
                results[i] = (reason, n)

    async def run():
        indices = iter(range(n_requests))
        limits = httpx.Limits(max_connections=n_clients)
        async with httpx.AsyncClient(base_url=served.url, timeout=60, limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*(client_task(client, indices) for _ in range(n_clients))), 120)

    t0 = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert all(r is not None for r in results)
    for i, (reason, n) in enumerate(results):
        assert (reason == "length" and n == 1 + i % 4) or (reason == "stop" and 1 <= n <= 1 + i % 4), (i, reason, n)
    after, m1 = served.wait_idle(), metrics(served)
    assert after["pages_used"] == 0 and after["pages_free"] == after["pages_total"]
    assert after["peak_batch"] == MAX_NUM_SEQS  # the batch filled up
    done = sum(m1.get(f'quantmla_requests_finished_total{{reason="{r}"}}', 0)
               - m0.get(f'quantmla_requests_finished_total{{reason="{r}"}}', 0) for r in ("stop", "length", "abort"))
    assert done == n_requests
    generated = sum(n for _, n in results)
    assert after["tokens_generated"] - before["tokens_generated"] == generated
    assert m1["quantmla_generation_tokens_total"] - m0["quantmla_generation_tokens_total"] == generated
    assert m1["quantmla_kv_pages_used"] == 0 and m1["quantmla_requests_running"] == 0
    assert m1["quantmla_output_tokens_per_second"] > 0
    print(f"load: {n_requests} requests, {generated} tokens in {elapsed:.1f} s")


# --------------------------------------------------------------------------------------------- the command
def test_serve_command_builds_the_engine_and_says_where(monkeypatch, capsys):
    import quantmla.engine.server as server_module
    from quantmla import cli
    from quantmla.cli import main

    served_with = []
    monkeypatch.setattr(cli, "check_can_listen", lambda host, port: None)  # port 8000 may be taken on this machine
    monkeypatch.setattr(server_module, "serve", lambda llm, host, port, model_names: served_with.append(
        (llm, host, port, model_names)))
    assert main(["serve", "--device", "cpu", "--content", "int2", "--kv-cache-bytes", "14e6", "--max-num-seqs", "4",
                 "--max-model-len", "1024", "--port", "8123"]) == 0
    (llm, host, port, names), = served_with
    assert (host, port, llm.max_model_len, llm.stats()["format"]) == ("127.0.0.1", 8123, 1024, "int2/int4")
    assert names == (llm.model_name,)
    out = capsys.readouterr().out
    assert "http://127.0.0.1:8123/v1" in out and f"{llm.capacity_tokens} tokens" in out
    assert main(["serve", "--device", "cpu", "--rope", "int4:t64", "--kv-cache-bytes", "14e6", "--max-num-seqs",
                 "4", "--max-model-len", "1024"]) == 0  # a token-axis (KIVI-style) RoPE path
    assert served_with[-1][0].stats()["format"] == "int4/int4:t64"
    model_dir = str(default_model_dir())
    assert main(["serve", model_dir, "--device", "cpu", "--kv-cache-bytes", "14e6", "--max-num-seqs", "4"]) == 0
    assert served_with[-1][3] == ("default_model", model_dir)  # as vLLM names it too: by the path it was given
    assert main(["serve", "--device", "cpu", "--kv-cache-bytes", "14e6", "--max-num-seqs", "4",
                 "--served-model-name", "mla", "mla-int4"]) == 0
    assert served_with[-1][3] == ("mla", "mla-int4")
    assert main(["serve", "--device", "cpu", "--kv-cache-bytes", "1000"]) == 2  # no page fits: one-line error
    assert "holds no page" in capsys.readouterr().err


def test_a_request_may_name_the_model_by_any_of_its_names(served):
    server = Server(served.llm, ("mla", "/models/mla"))
    for name in ("mla", "/models/mla", None):
        server.check_model(name)
    with pytest.raises(APIError, match="'gpt-4' does not exist; this server serves 'mla' or '/models/mla'"):
        server.check_model("gpt-4")
    assert server.model_name == "mla" and Server(served.llm).model_names == (served.llm.model_name,)


def test_serve_command_refuses_bad_options_in_one_line(capsys, tmp_path, monkeypatch):
    from quantmla import cli
    from quantmla.cli import main

    monkeypatch.setattr(cli, "check_can_listen", lambda host, port: None)  # port 8000 may be taken on this machine
    from quantmla.models.tiny import tiny_model

    for argv, says in ((["--device", "tpu"], "--device"), (["--device", "cuda:99"], "--device"),
                       (["--max-model-len", "0"], "max_model_len"), (["--max-model-len", "-5"], "max_model_len")):
        assert main(["serve", "--kv-cache-bytes", "14e6", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err, err
    for value in ("1e400", "-3", "lots"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--kv-cache-bytes", value])
        assert e.value.code == 2 and "--kv-cache-bytes" in capsys.readouterr().err
    for value in ("99999", "65536", "-1", "0", "http"):  # 99999 listened on 34463 (mod 65536), said 99999
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", value])
        assert e.value.code == 2 and "--port" in capsys.readouterr().err
    tiny_model("deepseek_v3").save_pretrained(tmp_path)  # weights and config, no tokenizer files
    assert main(["serve", str(tmp_path), "--device", "cpu", "--kv-cache-bytes", "14e6"]) == 2
    out, err = capsys.readouterr()
    assert "has no tokenizer" in err and "serving" not in out


def test_serve_command_refuses_an_address_it_cannot_listen_on_before_loading(capsys, monkeypatch):
    import quantmla.engine as engine
    from quantmla.cli import main

    monkeypatch.setattr(engine, "LLM", lambda *a, **k: pytest.fail("the model loaded before the address was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--kv-cache-bytes", "14e6"]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--host", "192.0.2.1", "--kv-cache-bytes", "14e6"]) == 2  # TEST-NET: no machine's own
    assert "cannot listen on 192.0.2.1:8000" in capsys.readouterr().err



def test_stopping_ends_requests_in_flight_instead_of_cancelling_them(caplog, monkeypatch):
    """A server stopping with requests running ends them DRAIN_MARGIN_S before uvicorn's graceful timeout: a
    503, or an error event then [DONE] in a stream; uvicorn cancels no task (no traceback logged) and the
    pages are freed."""
    from quantmla.engine.server import uvicorn_server

    monkeypatch.setattr(logging.getLogger("uvicorn"), "propagate", True)  # another uvicorn.Config may have set it off
    llm = LLM(device="cpu", kv_cache_bytes=14 << 20, max_num_seqs=4)
    app = build_app(llm)
    server = uvicorn_server(app, log_level="info", log_config=None, timeout_graceful_shutdown=1.5)
    thread, sock, url = run_in_thread(server)
    deadline = time.monotonic() + 30
    got = {}

    def client(streaming: bool):
        body = {"prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0}
        with httpx.Client(base_url=url, timeout=60) as c:
            got["stream" if streaming else "plain"] = stream(c, "/v1/completions", body) if streaming else \
                c.post("/v1/completions", json=body)

    clients = [threading.Thread(target=client, args=(s,)) for s in (False, True)]
    for c in clients:
        c.start()
    while app.state.server.engine.stats()["running"] < 2:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    with caplog.at_level(logging.INFO):
        server.should_exit = True
        thread.join(15)
        for c in clients:
            c.join(15)
    sock.close()
    assert not thread.is_alive()
    assert got["plain"].status_code == 503 and "shutting down" in got["plain"].json()["error"]["message"]
    assert got["stream"][-1]["error"]["message"] == "the server is shutting down"
    assert "timeout graceful shutdown" not in caplog.text and "Exception in ASGI application" not in caplog.text
    assert "Shutting down" in caplog.text  # uvicorn's log did reach caplog
    assert llm.stats()["pages_used"] == 0
