"""Concurrency and disconnects: many streams at once all answered; a client that leaves stops its work."""

from __future__ import annotations

import asyncio
import time

import httpx

from .live import CHAT_MODEL


def test_sixteen_concurrent_streams_all_answered(live_app):
    client = live_app.async_openai()
    questions = [f"Name one fact about the number {i}." for i in range(16)]

    async def one(question: str) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0,
            stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        try:
            return await asyncio.gather(*(one(q) for q in questions))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert len(results) == 16
    for text, finish in results:
        assert text.strip() and finish in ("stop", "length")


def _unfinished(live_app) -> int:
    return live_app.model_handle(CHAT_MODEL).stats.remote().result()["unfinished_requests"]


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_client_disconnect_mid_stream_aborts_the_engine_request(live_app):
    assert _wait_for(lambda: _unfinished(live_app) == 0, 30), "engine busy before the test"
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Write a very long story about ships."}],
            "max_tokens": 1500, "temperature": 0.8, "stream": True,
            # keep generating to max_tokens so only an abort can end it early
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{live_app.v1}/chat/completions",
                                                           json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(5):
            next(lines)
        assert _unfinished(live_app) == 1, "the stream should be running in the engine"
    # leaving the `with` closed the connection mid-stream; the engine must drop the request quickly,
    # long before 1500 tokens (about 30 s on this hardware) could have been generated
    assert _wait_for(lambda: _unfinished(live_app) == 0, 10), "engine kept generating for a gone client"
