"""Async load against an OpenAI-compatible endpoint, streaming, measured at the byte level.

Arrivals: a fixed number of concurrent sessions, or sessions starting at Poisson times (a session
rate). Stops after a request count or a duration, whichever is given, and waits for what is in flight:
every request issued is accounted for in the records, answered or not.

Each request streams (`stream: true`, `stream_options.include_usage`); TTFT is the first non-empty
content chunk, inter-token latencies are the gaps between content chunks, output tokens come from the
server's usage (the chunk count when a server gives none). `ignore_eos` (a vLLM extension, on by
default) makes output lengths follow the workload; turn it off for endpoints that reject it.

Besides chat and completions, the agent APIs: `responses` (OpenAI's Responses API: typed events, the
usage in `response.completed`) and `messages` (Anthropic's Messages API: typed events, the output tokens
in `message_delta`; it has no `ignore_eos`, so answers may end early, alike for every server measured).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from shunter.bench.records import RequestRecord
from shunter.bench.workloads import Session, Turn


@dataclass
class LoadConfig:
    base_url: str  # up to and including /v1
    model: str
    endpoint: str = "chat"  # chat | completions | responses | messages
    concurrency: int | None = 8  # sessions in flight at once (fixed-concurrency mode)
    rate: float | None = None  # sessions started per second, Poisson arrivals (rate mode)
    max_requests: int | None = None
    duration_s: float | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    seed: int = 0
    api_key: str | None = None
    progress: bool = True
    # Called with each request's index and body just before it is sent (what a benchmark replays, e.g.
    # the oracle of shunter.bench.kv_oracle: a multi-turn body holds the server's real answers).
    on_send: Callable[[int, dict[str, Any]], None] | None = None
    # Each session at most once (a run that is one pass over the workload): without it the sessions
    # repeat in order, and a worker or an arrival that finds budget left starts a session over again,
    # sending prompts the engines already cached.
    one_pass: bool = False
    burst: int = 1  # rate mode: sessions started together at each arrival (arrivals come at rate / burst)
    # Several tenants' keys: a session sends with key `tenant_keys[u % len]`, u its user within its group
    # (shared-prefix) or else its index, in place of `api_key` (what prompt-cache isolation costs).
    tenant_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.endpoint not in _PATHS:
            raise ValueError(f"endpoint must be one of {', '.join(_PATHS)}")
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency or rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("rate must be positive")
        if self.burst < 1 or (self.burst > 1 and self.rate is None):
            raise ValueError("burst must be at least 1, and more than 1 only with a rate")
        if self.max_requests is None and self.duration_s is None:
            raise ValueError("give a request count, a duration, or both")


class _Budget:
    """Who may still start a request: the count and the deadline, checked before each one."""

    def __init__(self, cfg: LoadConfig, start: float):
        self.left = cfg.max_requests
        self.deadline = start + cfg.duration_s if cfg.duration_s else None
        self.issued = 0

    def take(self) -> int | None:
        if self.left is not None and self.left <= 0:
            return None
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        if self.left is not None:
            self.left -= 1
        self.issued += 1
        return self.issued - 1


async def run_load(sessions: list[Session], cfg: LoadConfig) -> tuple[list[RequestRecord], float]:
    """Send the workload; return one record per request issued and the run's wall time."""
    if not sessions:
        raise ValueError("the workload is empty")
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=(cfg.concurrency or 256) + 8, max_keepalive_connections=64)
    records: list[RequestRecord] = []
    pool = iter(sessions) if cfg.one_pass else itertools.cycle(sessions)  # else reused in order
    bar = tqdm(total=cfg.max_requests, desc="requests", unit="req", disable=not cfg.progress)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=30)) as client:
        start = time.perf_counter()
        budget = _Budget(cfg, start)

        async def run_session(session: Session) -> None:
            history: list[tuple[Turn, str]] = []
            for turn in session.turns:
                index = budget.take()
                if index is None:
                    return
                record, answer = await _one_request(client, cfg, session, history, turn, index, start)
                records.append(record)
                bar.update()
                if not record.ok:
                    return  # a conversation does not go on past a failed turn
                history.append((turn, answer))

        if cfg.concurrency is not None:
            async def worker() -> None:
                while budget.left is None or budget.left > 0:
                    if budget.deadline is not None and time.perf_counter() >= budget.deadline:
                        return
                    session = next(pool, None)
                    if session is None:
                        return
                    await run_session(session)

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        else:
            rng = random.Random(cfg.seed)
            tasks = []
            next_at = start
            while True:
                next_at += rng.expovariate(cfg.rate / cfg.burst)
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if (budget.left is not None and budget.left <= 0) or (
                        budget.deadline is not None and time.perf_counter() >= budget.deadline):
                    break
                burst = list(itertools.islice(pool, cfg.burst))
                if not burst:
                    break
                tasks += [asyncio.create_task(run_session(s)) for s in burst]
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    bar.close()
    records.sort(key=lambda r: r.index)
    return records, wall


_PATHS = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses",
          "messages": "/messages"}


def _payload(cfg: LoadConfig, session: Session, history: list[tuple[Turn, str]], turn: Turn) -> dict[str, Any]:
    if cfg.endpoint in ("responses", "messages"):
        return _agent_payload(cfg, session, history, turn)
    body: dict[str, Any] = {"model": session.model or cfg.model, "max_tokens": turn.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        messages = [{"role": "system", "content": session.system}] if session.system else []
        for past, answer in history:
            messages += [{"role": "user", "content": past.text}, {"role": "assistant", "content": answer}]
        body["messages"] = messages + [{"role": "user", "content": turn.text}]
    else:
        parts = [session.system] if session.system else []
        for past, answer in history:
            parts += [past.text, answer]
        body["prompt"] = "\n\n".join(parts + [turn.text])
    return body


def _agent_payload(cfg: LoadConfig, session: Session, history: list[tuple[Turn, str]], turn: Turn) -> dict[str, Any]:
    """The same conversation as a Responses or a Messages request."""
    messages = []
    for past, answer in history:
        messages += [{"role": "user", "content": past.text}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": turn.text})
    body: dict[str, Any] = {"model": session.model or cfg.model, "stream": True, "temperature": 0}
    if cfg.endpoint == "responses":
        body.update(input=messages, max_output_tokens=turn.max_tokens)
        if session.system:
            body["instructions"] = session.system
        if cfg.ignore_eos:
            body["ignore_eos"] = True
    else:
        body.update(messages=messages, max_tokens=turn.max_tokens)
        if session.system:
            body["system"] = session.system
    return body


def _read_event(endpoint: str, event: dict[str, Any], record: RequestRecord) -> tuple[str | None, bool]:
    """(the text this event adds, whether it ends the stream) for chat-completion chunks and the agent
    APIs' typed events; usage goes into `record`. Raises ValueError for an error event."""
    if endpoint in ("chat", "completions"):
        if "error" in event:
            raise ValueError(json.dumps(event))
        if event.get("usage"):
            record.output_tokens = int(event["usage"].get("completion_tokens") or 0)
            record.prompt_tokens = int(event["usage"].get("prompt_tokens") or record.prompt_tokens)
        texts = [(c.get("delta") or {}).get("content") if endpoint == "chat" else c.get("text")
                 for c in event.get("choices") or []]
        return "".join(t for t in texts if t) or None, False
    kind = event.get("type")
    if kind == "error":
        raise ValueError(json.dumps(event))
    if kind in ("response.output_text.delta", "content_block_delta"):
        delta = event.get("delta")
        return (delta.get("text") if isinstance(delta, dict) else delta) or None, False
    usage = (event.get("response") or {}).get("usage") if endpoint == "responses" else event.get("usage")
    if isinstance(usage, dict) and usage.get("output_tokens"):
        record.output_tokens = int(usage["output_tokens"])
        record.prompt_tokens = int(usage.get("input_tokens") or record.prompt_tokens)
    return None, kind in ("response.completed", "response.incomplete", "message_stop")


def _tenant(cfg: LoadConfig, session: Session) -> dict[str, str] | None:
    """The Authorization header of the session's tenant, when the run has several (else the client's own)."""
    if not cfg.tenant_keys:
        return None
    who = session.meta.get("user", session.index)
    return {"Authorization": f"Bearer {cfg.tenant_keys[int(who) % len(cfg.tenant_keys)]}"}


async def _one_request(client: httpx.AsyncClient, cfg: LoadConfig, session: Session,
                       history: list[tuple[Turn, str]], turn: Turn, index: int,
                       start: float) -> tuple[RequestRecord, str]:
    path = _PATHS[cfg.endpoint]
    sent = time.perf_counter()
    record = RequestRecord(index=index, start_s=sent - start, ok=False, status=None,
                           prompt_tokens=turn.prompt_tokens)
    pieces: list[str] = []
    last_chunk_at: float | None = None
    chunks = 0
    try:
        body = _payload(cfg, session, history, turn)
        if cfg.on_send is not None:
            cfg.on_send(index, body)
        async def trace(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_body.complete":
                record.written_s = time.perf_counter() - sent

        async with client.stream("POST", path, json=body, headers=_tenant(cfg, session),
                                 extensions={"trace": trace}) as resp:
            record.status = resp.status_code
            record.head_s = time.perf_counter() - sent
            record.replica = resp.headers.get("x-shunter-replica")
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error = _error_message(body)
                return record, ""
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                try:
                    text, done = _read_event(cfg.endpoint, event, record)
                except ValueError:
                    record.error = f"error event: {_error_message(data)}"
                    return record, "".join(pieces)
                if text:
                    now = time.perf_counter()
                    if last_chunk_at is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last_chunk_at)
                    last_chunk_at = now
                    pieces.append(text)
                    chunks += 1
                if done:
                    break
            if not done:
                record.error = "stream ended without its end event"
                return record, "".join(pieces)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record, "".join(pieces)
    record.e2e_s = time.perf_counter() - sent
    record.output_tokens = record.output_tokens or chunks
    record.ok = True
    return record, "".join(pieces)


def _error_message(body: str) -> str:
    try:
        error = json.loads(body)
        error = error.get("error", error)  # OpenAI's and Anthropic's shapes; a Responses error event
        return str(error["message"])[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:300]
