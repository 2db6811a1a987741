"""An OpenAI-compatible HTTP server on top of `quantmla.engine.LLM` (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as server-sent events,
`data: {...}` chunks then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
/v1/completions also takes OpenAI's batch form, a list of prompts (strings or token-id lists, at most
`MAX_PROMPTS`): each runs as its own engine request and answers in the choice of its index (a streamed chunk
carries one choice); the usage sums them.

Threads: the LLM is not thread-safe, so one thread (`EngineLoop`) owns it. Handlers on the asyncio loop hand
it add/abort commands through a thread-safe queue; it runs `llm.step()` while any request is unfinished and
sends each request's StepOutputs back to that request's asyncio queue with `loop.call_soon_threadsafe`. Text
has two threads of its own: prompts are tokenized (and chats templated) on `Server.prompts`, with a copy of
the tokenizer, and outputs are detokenized on `Server.text`, with the original; so the engine thread only sees
token ids, each tokenizer object is used from one thread, and the asyncio loop and the other streams keep going
while a long prompt is tokenized.

Errors come back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: malformed JSON, missing
or invalid fields (JSON types are taken strictly: `true` is not a number; null is an optional field's default,
as in OpenAI's API), bad sampling values and OpenAI options this server does not implement (`UNSUPPORTED`,
when set to anything but their no-op value) are 400; an unknown model is 404 (`model_not_found`); a prompt the
engine cannot hold (longer than the model's limit or than the whole KV pool) is 400 with the engine's message.
Of vLLM's extra fields, `ignore_eos` and `stop_token_ids` are honoured (serving benchmarks send `ignore_eos`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import queue
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantmla.engine.sampler import SamplingParams

log = logging.getLogger("quantmla.server")

RATE_WINDOW_S = 10.0  # the output tokens/s gauge averages over this many recent seconds
DISCONNECT_POLL_S = 0.5  # how often a request waiting for tokens checks whether its client went away


# ---------------------------------------------------------------------------------------------- engine thread
@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    accepted: concurrent.futures.Future  # the request id, or the exception add_request raised


_STOP = object()
_DRAIN = object()


class ShuttingDown(RuntimeError):
    """What a request still running when the server stops gets (a 503, or an error event in its stream)."""


class EngineLoop:
    """The one thread that touches the LLM.

    `submit` adds a request and returns the asyncio queue its StepOutputs arrive on (an Exception instead
    if the engine fails); `abort` frees a request's pages (unknown or finished ids are ignored); `count_finished`
    counts a request's end as its client saw it; `stats` is the engine's stats as of the last step or command,
    plus those counts and the output rate, safe from any thread.
    """

    def __init__(self, llm):
        self.llm = llm
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the three below, written by the engine thread
        self._stats = dict(llm.stats())
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of each step in the rate window
        self._finished: Counter[str] = Counter()  # ended requests by the finish_reason their client got
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="quantmla-engine", daemon=True)

    # -- any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    def drain(self) -> None:
        """End every request in flight with `ShuttingDown` (their pages freed); the engine keeps serving."""
        self._commands.put(_DRAIN)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; raises what llm.add_request raised (ValueError: the request is invalid)."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt_ids, params, asyncio.get_running_loop(), outputs, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:  # the caller went away; the engine may have taken it already
            self.abort(request_id)
            raise
        return outputs

    def abort(self, request_id: str) -> None:
        self._commands.put(request_id)

    def count_finished(self, reason: str) -> None:
        with self._lock:
            self._finished[reason] += 1

    def stats(self) -> dict:
        now = time.monotonic()
        with self._lock:
            stats = dict(self._stats)
            window = min(RATE_WINDOW_S, max(now - self._started, 1e-3))
            recent = sum(n for t, n in self._recent if t >= now - window)
            stats["finished"] = dict(self._finished)
        stats["output_tokens_per_s"] = recent / window
        return stats

    # -- engine thread
    def _run(self) -> None:
        try:
            self._serve_commands()
        except BaseException as e:  # noqa: BLE001  (no handler may wait forever on a dead thread; /health says 503)
            log.exception("the engine thread died")
            self._fail_all(RuntimeError(f"the engine thread died: {e!r}"))

    def _serve_commands(self) -> None:
        while True:
            # Block while idle; while requests run, take whatever arrived and step.
            commands = [] if self.llm.has_unfinished() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd is _STOP or cmd is _DRAIN:
                    self._fail_all(ShuttingDown("the server is shutting down"))
                    if cmd is _STOP:
                        return
                    continue
                self._add(cmd) if isinstance(cmd, _Add) else self._abort(cmd)
            if self.llm.has_unfinished():
                self._step()
            self._publish()

    def _add(self, cmd: _Add) -> None:
        if not cmd.accepted.set_running_or_notify_cancel():  # the handler gave up before we got here
            return
        try:
            self.llm.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id)
        except Exception as e:  # noqa: BLE001  (ValueError: a bad request; anything else is still its error)
            cmd.accepted.set_exception(e)
            return
        self._sinks[cmd.request_id] = (cmd.loop, cmd.outputs)
        cmd.accepted.set_result(cmd.request_id)

    def _abort(self, request_id: str) -> None:
        self.llm.abort(request_id)
        self._sinks.pop(request_id, None)

    def _step(self) -> None:
        try:
            outs = self.llm.step()
        except Exception as e:  # noqa: BLE001  (an engine bug: fail the requests in flight, keep serving)
            log.exception("engine step failed; failing %d requests", len(self._sinks))
            self._fail_all(e)
            return
        tokens = 0
        for out in outs:
            tokens += len(out.new_token_ids)
            self._deliver(out.request_id, out)
            if out.finished:
                self._sinks.pop(out.request_id, None)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._sinks):
            self._deliver(request_id, error)
            try:
                self._abort(request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", request_id)

    def _deliver(self, request_id: str, item) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        loop, outputs = sink
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass

    def _publish(self) -> None:
        stats = self.llm.stats()
        with self._lock:
            self._stats = dict(stats)


# ---------------------------------------------------------------------------------------------- text
@dataclass
class TextStream:
    """Incremental detokenization of one output, with stop strings.

    `push(new_ids, final)` returns the text to emit now. Each token is decoded in a short window that starts
    at the previous commit point (as vLLM does): the window's text minus the text of its older tokens is the
    new text, so a token costs the same at 30 K tokens as at 3 and a decoder that strips a leading space
    strips it from the window's context, not from the new text. Held back until more tokens come (or the
    output ends): a window ending in U+FFFD (a byte-level tokenizer split a UTF-8 character) and a tail that
    could be the start of a stop string. When a stop string appears, the text ends just before it, `stopped`
    turns True and `token_ids` ends at the token that completed it (the usage's count). Tokens are committed
    one at a time, so the concatenation of what `push` returns and `token_ids` are the same whatever the
    chunking, and streamed and non-streamed outputs agree.
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the committed text: the decode of token_ids[:read]
    prefix: int = 0  # where the decode window starts (the commit point before the last one)
    read: int = 0  # tokens whose text is in `text`
    sent: int = 0  # characters of `text` already returned
    stopped: bool = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _commit(self, window: str) -> int | None:
        """Append the text of the tokens past `read` (`window`: the decode of token_ids[prefix:]); where the first
        stop string that the new text completes starts, if one does."""
        old_len = len(self.text)
        self.text += window[len(self._decode(self.token_ids[self.prefix:self.read])):]
        self.prefix, self.read = self.read, len(self.token_ids)
        # A stop string not found before ends in the new text: search from where it could start.
        start = max(0, old_len - max(map(len, self.stop), default=0) + 1)
        return min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=None)

    def push(self, new_ids: list[int], final: bool) -> str:
        if self.stopped:
            return ""
        hit = None
        for t in new_ids:  # the first token that completes a stop string ends the output: the rest are dropped
            self.token_ids.append(t)
            window = self._decode(self.token_ids[self.prefix:])
            if not window.endswith("\ufffd"):  # else a character split over tokens: wait for its other bytes
                if (hit := self._commit(window)) is not None:
                    break
        if hit is None and final and self.read < len(self.token_ids):  # the output ends: what was held back goes
            hit = self._commit(self._decode(self.token_ids[self.prefix:]))  # out as it is
        text = self.text
        if hit is not None:
            end, self.stopped = hit, True
        elif final:
            end = len(text)
        else:
            end = len(text) - max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                                  default=0)
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


@dataclass
class Chunk:
    """A piece of one output: new text, and the finish reason on the last piece."""

    text: str
    finish_reason: str | None


# ---------------------------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# OpenAI options this server does not implement, with the values that change nothing: any other value is
# refused (400) rather than silently ignored. Other unknown fields (e.g. "user") are ignored. logprobs 0 is not
# a no-op: on /v1/completions it asks for the sampled tokens' own logprobs.
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    # vLLM's extras that this engine does not implement (ignore_eos and stop_token_ids it does)
    "min_tokens": (None, 0), "repetition_penalty": (None, 1), "min_p": (None, 0),
}


class _SamplingRequest(BaseModel):
    """The fields both endpoints share (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="allow")  # unknown fields land in model_extra: see UNSUPPORTED

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat = 1.0
    top_p: StrictFloat = 1.0
    top_k: StrictInt = 0  # 0 or -1 (vLLM's spelling): off
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    # vLLM's extras, which serving benchmarks send (ignore_eos: a fixed output length)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's API takes null for every optional field, meaning its default (clients send it for "not set");
        typed strictly, `temperature: null` (or top_p, n, stream, ...) was refused. Required fields keep theirs."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(_same(value, ok) for ok in UNSUPPORTED[name]):
                raise APIError(400, f"{name} is not supported by this server (got {value!r})", name)


def _same(value, ok) -> bool:
    """value == ok with JSON's types kept apart: in Python True == 1 and False == 0, so without the check
    `best_of: true`, `echo: 0` or `logprobs: 0` passed as no-op values and were ignored."""
    return value == ok and isinstance(value, bool) == isinstance(ok, bool)


MAX_PROMPTS = 256  # prompts in one /v1/completions request (OpenAI's batch form)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one for a string or a list of token ids, else each item of the list (each
        gets its own choice, index = its place)."""
        one = isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int)
        prompts = [self.prompt] if one else self.prompt
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"] = "text"  # images and audio: a 400, not their caption read as text
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        check_text(self.role, "messages")  # the role is prompt text too (the template's or "role: content")
        if self.content is None and self.role != "assistant":  # OpenAI: only an assistant's (tool call) may lack it
            raise APIError(400, f"a {self.role!r} message needs content", "messages")
        if isinstance(self.content, list):
            return check_text("\n".join(p.text for p in self.content), "messages")  # as vLLM joins them
        return check_text(self.content or "", "messages")


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


class APIError(Exception):
    """A request the server refuses; becomes an OpenAI error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status)


def server_error(e: Exception) -> JSONResponse:
    """A 500 for an unexpected failure (an engine bug): this request fails, the server goes on. A 503 for a
    request the server ended because it is stopping."""
    if isinstance(e, ShuttingDown):
        return error_response(APIError(503, str(e), type="server_error"))
    log.error("request failed", exc_info=e)
    return error_response(APIError(500, f"{type(e).__name__}: {e}", type="server_error"))


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> tuple[str, bool]:
    """The prompt text of a chat, and whether it still needs the tokenizer's special tokens: the tokenizer's
    chat template (with the generation prompt; its text holds them) when it has one; otherwise one "role:
    content" line per message, then "assistant: " for the model to continue."""
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        try:
            return tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False), False
        except TemplateSyntaxError:  # the checkpoint's template is broken: a server error
            raise
        except TemplateError as e:  # its raise_exception, e.g. "roles must alternate": the request's fault
            raise APIError(400, f"the model's chat template refused these messages: {e}", "messages") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant: ", True


MAX_STOPS, MAX_STOP_CHARS = 16, 1024  # every chunk of every request scans its stops on the one text thread


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", "stop")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each "
                            f"(got {len(stop)}, the longest {max(map(len, stop))})", "stop")
    for s in stop:
        check_text(s, "stop")
    return tuple(stop)


def check_text(text: str, param: str) -> str:
    """text if it is valid Unicode (JSON's \ud800 escapes can carry lone surrogates, which no tokenizer
    encodes); else a 400 naming the first bad character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                            f"{e.start}", param) from None
    return text


def sampling_params(req: _SamplingRequest, max_tokens: int) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, f"only n=1 is supported, got n={req.n}", "n")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=0 if req.top_k == -1 else req.top_k, seed=req.seed,
                              stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split()[0]) from None


# ---------------------------------------------------------------------------------------------- the app
@dataclass
class _Job:
    """One accepted request: what the handler needs to stream or collect it."""

    request_id: str
    prompt_tokens: int
    outputs: asyncio.Queue
    text: TextStream
    counted: bool = False  # its end is in /metrics' finished requests


class Server:
    """The handlers' shared state: the LLM's fixed facts and the engine thread. model_names: what a request's
    "model" may say (default: the LLM's model_name); the first is the name responses and /v1/models give."""

    def __init__(self, llm, model_names: tuple[str, ...] = ()):
        if llm.tokenizer is None:
            raise ValueError("the server needs a tokenizer (the LLM has none: pass tokenizer=...)")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_names = tuple(model_names) or (llm.model_name,)
        self.model_name = self.model_names[0]
        self.request_limit = min(llm.max_model_len, llm.capacity_tokens)  # prompt + output one request can get
        self.engine = EngineLoop(llm)
        self.text = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quantmla-text")
        # Prompts get their own thread and tokenizer: on the text thread a 16 MB prompt stopped every stream for
        # 23 s, and one tokenizer object used from two threads at once can fail ("Already borrowed").
        self.prompt_tokenizer = copy.deepcopy(self.tokenizer)
        self.prompts = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quantmla-prompts")
        self.created = int(time.time())

    async def on_text_thread(self, fn, *args):
        """fn(*args) on the text thread (outputs' detokenizing), awaited without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.text, fn, *args)

    async def on_prompt_thread(self, fn, *args):
        """fn(*args) on the prompt thread (every use of `prompt_tokenizer`), awaited without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prompts, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            names = " or ".join(map(repr, self.model_names))
            raise APIError(404, f"the model {model!r} does not exist; this server serves {names}", "model",
                           "model_not_found")

    async def encode(self, prompt: str | list[int], special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (the engine checks them): ids as given; text as llm.add_request encodes it, with
        the tokenizer's special tokens (its BOS), or without them for text that already holds them (a rendered
        chat template), as vLLM does."""
        if not isinstance(prompt, str):
            return prompt
        if not prompt:  # (it would be the BOS alone)
            raise APIError(400, "the prompt is empty", "prompt")
        check_text(prompt, "prompt")
        return await self.on_prompt_thread(
            lambda: self.prompt_tokenizer.encode(prompt, add_special_tokens=special_tokens))

    async def start(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...],
                    prefix: str) -> _Job:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            outputs = await self.engine.submit(request_id, prompt_ids, params)
        except ValueError as e:  # the engine's own checks: too long for the model, larger than the pool, ...
            raise APIError(400, str(e), getattr(e, "param", "prompt")) from None
        return _Job(request_id, len(prompt_ids), outputs, TextStream(self.tokenizer, stop))

    async def start_all(self, prompts: list[list[int]], params: SamplingParams, stop: tuple[str, ...],
                        prefix: str) -> list[_Job]:
        """`start` for each prompt, in order; if one is refused, the ones already accepted are aborted."""
        jobs: list[_Job] = []
        try:
            for ids in prompts:
                jobs.append(await self.start(ids, params, stop, prefix))
        except BaseException:
            self.abort_all(jobs)
            raise
        return jobs

    def abort_all(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self.engine.abort(job.request_id)
            self.count_finished(job, "abort")

    def count_finished(self, job: _Job, reason: str) -> None:
        """Count a job's end once, by the finish_reason its client got ("abort": it got none)."""
        if not job.counted:
            job.counted = True
            self.engine.count_finished(reason)

    async def merged(self, jobs: list[_Job], request: Request) -> AsyncIterator[tuple[int, Chunk]]:
        """(index, chunk) of each job's `chunks` as they come. An exception from any job ends the whole with
        that exception; ending early (or failing) cancels the rest, whose `chunks` then abort them."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, job: _Job):
            try:
                async for c in self.chunks(job, request):
                    await queue.put((i, c))
            except Exception as e:  # noqa: BLE001  (handed to the consumer)
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def chunks(self, job: _Job, request: Request) -> AsyncIterator[Chunk]:
        """The output of an accepted request, piece by piece. Aborts it in the engine when it stops early
        (a stop string, the client going away, cancellation), so its pages are freed at once."""
        engine_done, sent, next_check = False, None, time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    out = await asyncio.wait_for(job.outputs.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    out = None
                if time.monotonic() >= next_check:  # tokens may come faster than the poll: go by the clock
                    if await request.is_disconnected():
                        return
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                if out is None:
                    continue
                batch = [out]  # take all that arrived: one decode for them, fewer chunks when we fall behind
                while not job.outputs.empty():
                    batch.append(job.outputs.get_nowait())
                for item in batch:
                    if isinstance(item, Exception):
                        raise item
                last = batch[-1]  # a request's finishing output is its last one
                engine_done = last.finished
                delta = await self.on_text_thread(job.text.push, [t for o in batch for t in o.new_token_ids],
                                                  last.finished)
                reason = "stop" if job.text.stopped else last.finish_reason if last.finished else None
                if delta or reason:
                    yield Chunk(delta, reason)
                if reason:
                    sent = reason
                    return
        finally:
            if not engine_done:
                self.engine.abort(job.request_id)
            self.count_finished(job, sent or "abort")

    def usage(self, jobs: list[_Job]) -> dict:
        prompt = sum(job.prompt_tokens for job in jobs)
        completion = sum(len(job.text.token_ids) for job in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _choice(index: int, text: str, reason: str | None, chat: bool, stream: bool) -> dict:
    if not chat:
        body = {"text": text}
    elif stream:
        body = {"delta": {"content": text} if text else {}}
    else:
        body = {"message": {"role": "assistant", "content": text}}
    return {"index": index, **body, "logprobs": None, "finish_reason": reason}


async def _respond(server: Server, req: _SamplingRequest, jobs: list[_Job], request: Request, chat: bool):
    """The OpenAI response for accepted jobs (one per prompt; choice i is job i): a JSON body, or an SSE
    stream when req.stream. The response's id is the first job's."""
    head = {"id": jobs[0].request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": server.model_name}
    if not req.stream:
        texts: list[list[str]] = [[] for _ in jobs]
        reasons: list[str | None] = [None] * len(jobs)
        try:
            async for i, c in server.merged(jobs, request):
                texts[i].append(c.text)
                reasons[i] = c.finish_reason
        except Exception as e:  # noqa: BLE001  (the engine failed: this request fails, the server goes on)
            return server_error(e)
        choices = [_choice(i, "".join(t), r, chat, False) for i, (t, r) in enumerate(zip(texts, reasons))]
        return JSONResponse({**head, "choices": choices, "usage": server.usage(jobs)})

    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    async def events():
        if chat:  # OpenAI opens a chat stream with the role
            yield _sse({**chunk_head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
        try:
            async for i, c in server.merged(jobs, request):
                yield _sse({**chunk_head, "choices": [_choice(i, c.text, c.finish_reason, chat, True)]})
        except Exception as e:  # noqa: BLE001  (the status line is sent already: report in the stream)
            if not isinstance(e, ShuttingDown):
                log.error("request %s failed", head["id"], exc_info=e)
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        else:
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({**chunk_head, "choices": [], "usage": server.usage(jobs)})
        yield "data: [DONE]\n\n"

    # The abort in the background also covers a client that leaves while a chunk is being sent (the
    # generator is then suspended at a yield and its `finally` would wait for garbage collection).
    return StreamingResponse(events(), media_type="text/event-stream",
                             background=BackgroundTask(server.abort_all, jobs))


def metrics_text(stats: dict) -> str:
    """Prometheus text exposition of the engine's state."""
    rows = [
        ("quantmla_requests_running", "gauge", "Requests in the running batch.", stats["running"]),
        ("quantmla_requests_waiting", "gauge", "Requests queued for a prefill.", stats["waiting"]),
        ("quantmla_preemptions_total", "counter", "Requests preempted (pages reclaimed, recomputed later).",
         stats["preemptions"]),
        ("quantmla_kv_pages_total", "gauge", "Pages in the KV pool.", stats["pages_total"]),
        ("quantmla_kv_pages_used", "gauge", "KV pages held by requests.", stats["pages_used"]),
        ("quantmla_kv_pages_free", "gauge", "Free KV pages.", stats["pages_free"]),
        ("quantmla_kv_capacity_tokens", "gauge", "Tokens the KV pool holds.", stats["capacity_tokens"]),
        ("quantmla_prompt_tokens_total", "counter", "Prompt tokens prefilled.", stats["prompt_tokens"]),
        ("quantmla_generation_tokens_total", "counter", "Tokens generated.", stats["tokens_generated"]),
        ("quantmla_engine_steps_total", "counter", "Engine steps (prefill or decode).", stats["steps"]),
        ("quantmla_output_tokens_per_second", "gauge",
         f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", stats["output_tokens_per_s"]),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    name = "quantmla_requests_finished_total"
    lines += [f"# HELP {name} Requests finished, by reason (stop: eos or a stop string; abort: the client went "
              "away or the server failed it).",
              f"# TYPE {name} counter"]
    lines += [f'{name}{{reason="{r}"}} {n}' for r, n in sorted(stats["finished"].items())]
    return "\n".join(lines) + "\n"


def build_app(llm, model_names: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app serving `llm` under `model_names` (see `Server`). Its lifespan starts and stops the engine
    thread; `app.state.server` is the `Server` (its `engine.stats()` is safe to read from any thread)."""
    server = Server(llm, model_names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        server.engine.stop()
        server.text.shutdown(wait=False)
        server.prompts.shutdown(wait=False)

    app = FastAPI(title="quantmla", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        # A union fails once per arm, the first arm first: the deepest error is the arm the client meant (a chat
        # content part's own fault, not "content: Input should be a valid string" for a list of parts).
        err = max(e.errors(), key=lambda x: len(x.get("loc", ())))
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return error_response(APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', '')}"))
        where = ".".join(loc)
        if loc and loc[0] == "prompt":  # pydantic names each arm of the union; say what a prompt may be
            return error_response(APIError(400, "prompt must be a string, a list of token ids, or a list of "
                                                "either (one choice per prompt)", "prompt"))
        if not loc and "json" not in request.headers.get("content-type", ""):  # e.g. a form, as `curl -d` sends
            return error_response(APIError(400, "send the body as JSON (Content-Type: application/json)"))
        return error_response(APIError(400, f"{where or 'body'}: {err.get('msg')}", loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 400:  # FastAPI's for a body json.loads raised on other than bad syntax (too deep)
            return error_response(APIError(400, f"malformed JSON body: {e.detail}"))
        return error_response(APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        return server_error(e)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        server.check_model(req.model)
        req.refuse_unsupported()
        prompts = [await server.encode(p) for p in req.prompts()]
        params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens)  # OpenAI's default
        jobs = await server.start_all(prompts, params, stop_strings(req.stop), "cmpl")
        return await _respond(server, req, jobs, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        server.check_model(req.model)
        req.refuse_unsupported()
        text, special = await server.on_prompt_thread(chat_prompt, server.prompt_tokenizer, req.messages)
        prompt_ids = await server.encode(text, special_tokens=special)
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        if max_tokens is None:  # OpenAI's default: as much as the context (and the whole pool) leaves
            max_tokens = max(server.request_limit - len(prompt_ids), 1)
        try:
            job = await server.start(prompt_ids, sampling_params(req, max_tokens), stop_strings(req.stop),
                                     "chatcmpl")
        except APIError as e:  # name the field the client set: it may never have sent a max_tokens
            if e.param == "max_tokens" and req.max_completion_tokens is not None:
                e.param, e.message = "max_completion_tokens", e.message.replace("max_tokens", "max_completion_tokens")
            raise
        return await _respond(server, req, [job], request, chat=True)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "quantmla",
                "max_model_len": server.request_limit}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not server.engine.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(server.engine.stats()), media_type="text/plain; version=0.0.4")

    return app


GRACEFUL_SHUTDOWN_S = 5
DRAIN_MARGIN_S = 1.0  # the engine ends the requests still running this long before uvicorn would cancel them


def uvicorn_server(app: FastAPI, **config):
    """A uvicorn server of `build_app`'s app (config: uvicorn.Config's arguments). When it stops, requests in
    flight get `timeout_graceful_shutdown` seconds to finish; DRAIN_MARGIN_S before that the engine ends the
    rest, so they answer a 503 (an error event when streaming) instead of being cancelled by uvicorn, which
    logs a traceback per request."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            grace = self.config.timeout_graceful_shutdown
            drain = None
            if grace is not None:
                drain = asyncio.get_running_loop().call_later(max(grace - DRAIN_MARGIN_S, 0.0),
                                                              app.state.server.engine.drain)
            try:
                await super().shutdown(sockets)
            finally:
                if drain is not None:
                    drain.cancel()

    return _Server(uvicorn.Config(app, **config))


def serve(llm, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          model_names: tuple[str, ...] = ()) -> None:
    """Serve `llm` under `model_names` (see `Server`) until interrupted (Ctrl-C: requests in flight get
    GRACEFUL_SHUTDOWN_S to finish, instead of holding the process until every generation ends)."""
    uvicorn_server(build_app(llm, model_names), host=host, port=port, log_level=log_level,
                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S).run()
