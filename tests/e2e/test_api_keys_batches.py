"""OpenAI's Batch API on the keyed app, driven with the official `openai` client: a batch's lines answer as
the interactive endpoint answers them (greedy chats word for word, embeddings to float precision), a bad line
is an error line and not a failed batch, every input line has exactly one result line however the batch
ends (completed or cancelled), a key's batches are its own, and every malformed request gets a clear
OpenAI-shaped error."""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import time

import httpx
import openai
import pytest

from shunter.auth import key_id

from .keyed_app import (
    ADMIN,
    APP,
    CHAT_ONLY,
    FULL,
    GATEWAYS,
    MAX_TOKENS,
    TIMEOUT_S,
    redeploy_batch,
    usage_ledger,
)
from .live import CHAT_MODEL, EMBED_MODEL

pytestmark = pytest.mark.own_app

CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.",
             "What is two plus two?"]
BATCH_WAIT_S = 600  # a batch of a few hundred short lines on two cores: minutes at most


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


def _client(app: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def _jsonl(items: list[dict]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def _request(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _chat(question: str, **extra) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}


def _submit(client: openai.OpenAI, lines: list[dict], endpoint: str):
    uploaded = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"suite": "e2e"})


def _wait(client: openai.OpenAI, batch_id: str, until=("completed", "failed", "expired", "cancelled")):
    deadline = time.monotonic() + BATCH_WAIT_S
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until or time.monotonic() > deadline:
            return batch
        time.sleep(0.5)


def _answers_as_interactive(answers: dict[int, str], interactive: dict[str, str]) -> None:
    """Line i asked QUESTIONS[i % 5]. The CPU engine is not batch-invariant: at temperature 0 a prompt batched
    with a hundred others can take another token late in its answer (CI: "Hello there, welcome to my world!"
    against a lone request's "Hello! I'm here to help with"). So every line starts as the interactive answer
    does (its first word) and nearly all (9 in 10) are that answer exactly; a line answered for another
    question, or none, still fails."""
    exact = 0
    for i, answer in answers.items():
        expected = interactive[QUESTIONS[i % len(QUESTIONS)]]
        assert re.findall(r"\w+", answer)[:1] == re.findall(r"\w+", expected)[:1], (i, answer, expected)
        exact += answer == expected
    assert exact >= 0.9 * len(answers), (exact, len(answers))


def _results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    """custom_id -> result line; every custom_id once."""
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).read().splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a custom_id has two result lines"
    return by_id


def test_a_batch_answers_each_line_as_the_interactive_endpoint_and_bad_lines_are_error_lines(app):
    client = _client(app, FULL)
    interactive = {q: client.chat.completions.create(**_chat(q)).choices[0].message.content for q in QUESTIONS}
    good = [_request(f"chat-{i}", CHAT, _chat(QUESTIONS[i % len(QUESTIONS)])) for i in range(150)]
    bad = [
        _request("unknown-model", CHAT, {**_chat("hi"), "model": "no-such-model"}),
        _request("too-many-tokens", CHAT, _chat("hi", max_tokens=MAX_TOKENS + 1)),
        _request("streamed", CHAT, _chat("hi", stream=True)),
        _request("no-messages", CHAT, {"model": CHAT_MODEL, "max_tokens": 2}),
        _request("engine-priority", CHAT, _chat("hi", priority=-5)),
        {"custom_id": "wrong-url", "method": "POST", "url": EMBED, "body": _chat("hi")},
    ]
    batch = _submit(client, good[:75] + bad + good[75:], CHAT)
    assert batch.status == "validating" and batch.endpoint == CHAT and batch.metadata == {"suite": "e2e"}
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (156, 150, 6)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output, errors = _results(client, done.output_file_id), _results(client, done.error_file_id)
    assert set(output) == {line["custom_id"] for line in good}
    answers = {}
    for i in range(150):
        row = output[f"chat-{i}"]
        assert row["error"] is None and row["response"]["status_code"] == 200
        answers[i] = row["response"]["body"]["choices"][0]["message"]["content"]
        assert row["response"]["body"]["usage"]["completion_tokens"] <= MAX_TOKENS
    _answers_as_interactive(answers, interactive)
    # Each bad line's error, as its endpoint would answer it (or, never a request, why not).
    assert set(errors) == {line["custom_id"] for line in bad}
    answered = {cid: (row["response"]["status_code"], row["response"]["body"]["error"]["code"])
                for cid, row in errors.items() if row["response"] is not None}
    assert answered.pop("no-messages")[0] == 400  # vLLM's own request model says why
    assert answered == {"unknown-model": (404, "model_not_found"), "too-many-tokens": (400, "max_tokens_too_large"),
                        "streamed": (400, "stream_not_supported"), "engine-priority": (400, "priority_not_allowed")}
    assert errors["wrong-url"]["response"] is None and errors["wrong-url"]["error"]["code"] == "mismatched_url"
    # The result files are the key's own, of purpose batch_output.
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    with pytest.raises(openai.NotFoundError):
        _client(app, CHAT_ONLY).files.content(done.output_file_id)


def test_an_embeddings_batch_matches_the_interactive_vectors(app):
    client = _client(app, FULL)
    texts = [f"sentence number {i} about the sea" for i in range(40)]
    batch = _submit(client, [_request(f"e{i}", EMBED, {"model": EMBED_MODEL, "input": t}) for i, t in enumerate(texts)],
                    EMBED)
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 40, done
    output = _results(client, done.output_file_id)
    for i in (0, 17, 39):
        vector = output[f"e{i}"]["response"]["body"]["data"][0]["embedding"]
        direct = client.embeddings.create(model=EMBED_MODEL, input=texts[i]).data[0].embedding
        assert len(vector) == len(direct) and max(abs(a - b) for a, b in zip(vector, direct, strict=True)) < 1e-3
        assert math.isclose(sum(a * a for a in vector), 1.0, rel_tol=1e-2)


def test_cancel_stops_new_lines_and_every_line_still_has_one_result(app):
    client = _client(app, FULL)
    lines = [_request(f"c{i}", CHAT, _chat(QUESTIONS[i % len(QUESTIONS)])) for i in range(200)]
    batch = _submit(client, lines, CHAT)
    _wait(client, batch.id, until=("in_progress",))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    counts = done.request_counts
    assert counts.total == 200 and counts.completed + counts.failed == 200 and counts.completed < 200
    output, errors = _results(client, done.output_file_id), _results(client, done.error_file_id)
    assert set(output) | set(errors) == {line["custom_id"] for line in lines} and not set(output) & set(errors)
    assert {row["error"]["code"] for row in errors.values() if row["response"] is None} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # asked again: the same answer


def test_a_keys_batches_are_its_own(app):
    mine, other = _client(app, FULL), _client(app, CHAT_ONLY)
    batch = _submit(mine, [_request("only", CHAT, _chat("Say hello."))], CHAT)
    for attempt in (lambda: other.batches.retrieve(batch.id), lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError) as hidden:
            attempt()
        assert hidden.value.body["code"] == "batch_not_found"
    assert batch.id not in [b.id for b in other.batches.list()]
    assert batch.id in [b.id for b in mine.batches.list()]
    # Another key's file cannot be a batch's input either.
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h")
    every = httpx.get(f"{app}/admin/batches?limit=100", headers={"authorization": f"Bearer {ADMIN}"},
                      timeout=TIMEOUT_S).json()
    assert next(b for b in every["data"] if b["id"] == batch.id)["owner"] == key_id(FULL)
    assert _wait(mine, batch.id).status == "completed"
    with pytest.raises(openai.ConflictError) as ended:  # nothing left to cancel
        mine.batches.cancel(batch.id)
    assert ended.value.body["code"] == "batch_not_cancellable"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input_file_id": "file-nope", "endpoint": CHAT, "completion_window": "24h"}, 404, "input_file_id"),
    ({"input_file_id": "x", "endpoint": "/v1/messages", "completion_window": "24h"}, 400, "endpoint"),
    ({"input_file_id": "x", "endpoint": CHAT, "completion_window": "1h"}, 400, "completion_window"),
    ({"input_file_id": "x", "endpoint": CHAT, "completion_window": "24h", "priority": 1}, 400, "priority"),
    ({"input_file_id": "x", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": 1}}, 400, "metadata.k"),
    ({"input_file_id": 7, "endpoint": CHAT, "completion_window": "24h"}, 400, "input_file_id"),
    ({"endpoint": CHAT, "completion_window": "24h"}, 400, "input_file_id"),
])
def test_a_malformed_batch_request_gets_a_clear_error(app, body, status, param):
    answer = httpx.post(f"{app}/v1/batches", headers={"authorization": f"Bearer {FULL}"}, json=body,
                        timeout=TIMEOUT_S)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param and answer.json()["error"]["message"]


def test_the_batch_api_needs_a_client_key_and_checks_its_query(app):
    headers = {"authorization": f"Bearer {FULL}"}
    assert httpx.get(f"{app}/v1/batches", timeout=TIMEOUT_S).status_code == 401
    assert httpx.get(f"{app}/v1/batches", headers={"authorization": f"Bearer {ADMIN}"},
                     timeout=TIMEOUT_S).status_code == 403
    assert httpx.get(f"{app}/admin/batches", headers=headers, timeout=TIMEOUT_S).status_code == 403
    for query in ("limit=0", "limit=101", "limit=x"):
        answer = httpx.get(f"{app}/v1/batches?{query}", headers=headers, timeout=TIMEOUT_S)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit", (query, answer.text)
    missing = httpx.get(f"{app}/v1/batches/batch_nope", headers=headers, timeout=TIMEOUT_S)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "batch_not_found"
    nan = httpx.post(f"{app}/v1/batches", headers={**headers, "content-type": "application/json"},
                     content=b'{"input_file_id": "x", "endpoint": "/v1/embeddings", "completion_window": NaN}',
                     timeout=TIMEOUT_S)
    assert nan.status_code == 400


def test_the_batch_command_submits_watches_and_fetches_results(app, tmp_path):
    lines = [_request(f"q{i}", CHAT, _chat(QUESTIONS[i % len(QUESTIONS)])) for i in range(6)]
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(_jsonl(lines))
    env = {**os.environ, "SHUNTER_URL": app, "SHUNTER_API_KEY": FULL}
    shunter = [sys.executable, "-m", "shunter.cli", "batch"]
    submitted = subprocess.run([*shunter, "submit", str(requests), "--endpoint", CHAT, "--wait"], env=env,
                               capture_output=True, text=True, timeout=BATCH_WAIT_S)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.split()[1]
    assert f"{batch_id}: completed (6 completed, 0 failed of 6)" in submitted.stdout
    out = tmp_path / "results.jsonl"
    fetched = subprocess.run([*shunter, "results", batch_id, "--out", str(out)], env=env, capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    assert fetched.returncode == 0, fetched.stderr
    assert sorted(json.loads(row)["custom_id"] for row in out.read_text().splitlines()) == sorted(
        line["custom_id"] for line in lines)
    # A key that is not one is told so, in the gateway's words, as the command's failure.
    refused = subprocess.run([*shunter, "status", batch_id], env={**env, "SHUNTER_API_KEY": "sk-not-a-key"},
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    assert refused.returncode == 1 and "401" in refused.stderr


def _gateway_replicas() -> list:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#gateway#"
    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def _until_done_reaches(client: openai.OpenAI, batch_id: str, lines: int) -> None:
    deadline = time.monotonic() + BATCH_WAIT_S
    while time.monotonic() < deadline:
        counts = client.batches.retrieve(batch_id).request_counts
        if counts.completed + counts.failed >= lines:
            return
        time.sleep(0.25)
    raise AssertionError(f"batch {batch_id} never reached {lines} lines done")


def test_a_batch_survives_a_killed_gateway_and_a_redeploy_with_every_line_once(app):
    """Killed (SIGKILL, no drain) one gateway replica while lines run through it, then the whole app
    deployed again with a changed batch setting (its gateways and batch service replaced, the engines
    kept): the batch carries on each time, and ends with one result line per input line, answered as the
    interactive endpoint answers, and no line twice in the usage ledger."""
    import ray

    # Retries: a connection to the killed gateway, or to one being replaced, is refused.
    client = _client(app, FULL).with_options(max_retries=5)
    interactive = {q: client.chat.completions.create(**_chat(q)).choices[0].message.content for q in QUESTIONS}
    lines = [_request(f"s{i}", CHAT, _chat(QUESTIONS[i % len(QUESTIONS)])) for i in range(120)]
    batch = _submit(client, lines, CHAT)
    _until_done_reaches(client, batch.id, 10)
    victims = _gateway_replicas()
    assert len(victims) == GATEWAYS
    ray.kill(victims[0], no_restart=True)
    done_then = client.batches.retrieve(batch.id).request_counts.completed
    _until_done_reaches(client, batch.id, done_then + 20)
    redeploy_batch(max_lines_in_flight=12)
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (120, 120, 0)
    output = _results(client, done.output_file_id)
    assert set(output) == {line["custom_id"] for line in lines} and done.error_file_id is None
    _answers_as_interactive({i: output[f"s{i}"]["response"]["body"]["choices"][0]["message"]["content"]
                             for i in range(120)}, interactive)
    # The ledger: each line's run under its own id, none twice (a line run again after its runner lost it
    # has the same id, and the ledger keeps one record of an id).
    with sqlite3.connect(usage_ledger()) as db:
        ids = [row[0] for row in db.execute("SELECT request_id FROM usage WHERE request_id LIKE ?", (f"{batch.id}-%",))]
    assert len(ids) == len(set(ids)) and set(ids) <= {f"{batch.id}-{n}" for n in range(1, 121)}
