"""The OpenAI API of configs/local.yaml, through the official client, against real engines."""

from __future__ import annotations

import json
import math

import httpx

from .live import CAPITAL_QUESTION, CHAT_MODEL, EMBED_MODEL, assert_capital

FRANCE = [{"role": "user", "content": CAPITAL_QUESTION}]


def test_models_lists_both(live_app):
    ids = {m.id for m in live_app.openai().models.list().data}
    assert ids == {CHAT_MODEL, EMBED_MODEL}
    assert live_app.openai().models.retrieve("minilm").id == EMBED_MODEL


def test_chat_answers_paris(live_app):
    resp = live_app.openai().chat.completions.create(model=CHAT_MODEL, messages=FRANCE, max_tokens=30,
                                                     temperature=0)
    choice = resp.choices[0]
    assert_capital(choice.message.content, live_app.base_url)
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert resp.model == CHAT_MODEL
    assert resp.usage.prompt_tokens > 0 and 0 < resp.usage.completion_tokens <= 30
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_alias_resolves_to_the_model(live_app):
    resp = live_app.openai().chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=30,
                                                     temperature=0)
    assert resp.model == CHAT_MODEL
    assert_capital(resp.choices[0].message.content, live_app.base_url)


def test_max_tokens_gives_length_finish(live_app):
    resp = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Count from 1 to 100."}], max_tokens=5,
        temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5


def test_stop_sequence_ends_the_answer(live_app):
    """The stopped answer is the greedy answer cut where the stop word begins: compared with the same
    engine's answer without `stop`, so an answer that merely lacks the word does not pass."""
    client = live_app.openai()
    whole = client.chat.completions.create(model=CHAT_MODEL, messages=FRANCE, max_tokens=30,
                                           temperature=0).choices[0].message.content
    words = whole.split()
    stop = next((w for w in ("Paris", "France", "capital") if w in whole[1:]), words[len(words) // 2])  # inside it
    choice = client.chat.completions.create(model=CHAT_MODEL, messages=FRANCE, max_tokens=30,
                                            temperature=0, stop=[stop]).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == whole[:whole.index(stop)], (whole, choice.message.content)


def test_seed_makes_sampling_reproducible(live_app):
    client = live_app.openai()
    prompt = [{"role": "user", "content": "Tell me a one-line story about a cat."}]
    outs = [client.chat.completions.create(model=CHAT_MODEL, messages=prompt, max_tokens=20, temperature=1.0,
                                           seed=1234).choices[0].message.content for _ in range(2)]
    assert outs[0] == outs[1] and outs[0]


def test_completions_endpoint(live_app):
    resp = live_app.openai().completions.create(model=CHAT_MODEL, prompt="The capital of France is",
                                                max_tokens=8, temperature=0)
    assert_capital(resp.choices[0].text, live_app.base_url, max_tokens=8, completion_prompt="The capital of France is")
    assert resp.choices[0].finish_reason in ("length", "stop") and resp.usage.completion_tokens > 0


def test_streaming_chat_with_usage(live_app):
    stream = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=FRANCE, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    # Tokens the engine made while the reader was busy arrive merged in one chunk (vLLM merges them too),
    # so how many content chunks there are depends on the machine: the shape does not.
    assert chunks[0].choices[0].delta.role == "assistant" and finishes == ["stop"], chunks
    usage = chunks[-1].usage  # include_usage: a last chunk with the usage and no choices
    assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1]), chunks[-2:]
    assert_capital(text, live_app.base_url)
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0


def test_streaming_completions_end_with_done(live_app):
    with httpx.stream("POST", f"{live_app.v1}/completions", timeout=60, json={
            "model": CHAT_MODEL, "prompt": "The capital of France is", "max_tokens": 8, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    # Tokens made while the reader was busy arrive merged (a fast engine may send all 8 in one chunk): the
    # stream's shape is asserted, not its chunk count.
    assert events[-1] == "data: [DONE]" and len(events) >= 2, events
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1, chunks
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks
    assert "".join(c["choices"][0]["text"] for c in chunks).strip(), chunks


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_embeddings_are_384_dim_and_meaningful(live_app):
    resp = live_app.openai().embeddings.create(model=EMBED_MODEL, input=[
        "The cat sits on the mat.", "A cat is sitting on a mat.", "Quarterly revenue grew by eight percent."])
    vectors = [d.embedding for d in resp.data]
    assert [len(v) for v in vectors] == [384, 384, 384]
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert _cosine(vectors[0], vectors[1]) > 0.8 > 0.3 > _cosine(vectors[0], vectors[2])
    assert resp.usage.prompt_tokens > 0 and resp.model == EMBED_MODEL


def test_health_and_ready(live_app):
    assert httpx.get(f"{live_app.base_url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{live_app.base_url}/ready", timeout=30)
    body = ready.json()
    assert ready.status_code == 200 and body["ready"] is True
    assert set(body["models"]) == {CHAT_MODEL, EMBED_MODEL}
    assert all(m["ready"] for m in body["models"].values())


def test_each_cpu_replica_owns_its_cores(live_app):
    """Two engines on two cores: one core each, never the same one."""
    models = httpx.get(f"{live_app.base_url}/ready", timeout=30).json()["models"]
    cores = [tuple(m["cpu_cores"]) for m in models.values()]
    assert all(len(c) == 1 for c in cores) and len(set(cores)) == 2
