"""LoRA adapters on two real replicas of SmolLM2 (tests/e2e/routing_app.py: max_loras 1, max_cpu_loras 1,
so each engine holds one adapter at a time):

- each adapter's greedy answer through Shunter, by name and as `smol:<adapter>`, equals vLLM's own offline
  engine with a LoRARequest for it, with more adapters than the replicas hold together (loaded and evicted
  in turn);
- repeated requests for an adapter go to the replica whose engine holds it (its own load counters say it
  loaded the adapter once, the other replica never), and a burst for one adapter spreads over both;
- an adapter found in the model's adapter_dirs is served like a configured one;
- an adapter in an object store (a real S3 endpoint) is fetched into the node's cache on its first request
  and answers as its files do; a missing one is a 422 for its requests and a 400 for an admin addition;
  a source with credentials in it is refused without echoing them;
- an operator adds an adapter through the admin API and it serves at once (as vLLM answers for it), then
  removes it and it is a 404; bad additions are refused with the reason; an adapter rolls out to new
  files behind the gates and is promoted;
- a broken adapter is a 422 and the replica keeps serving; a key limited to one adapter gets 403 for the
  others and the base, a key for `smol:*` uses every adapter, the added one too, but not the base;
- a batch (OpenAI's Batch API) across the base and the adapters answers each line as vLLM does, and the same
  file from the key limited to one adapter has every other line refused before it runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from shunter.lora_sources import local_copy

from .routing_app import (
    ADAPTER_DIRS,
    ADAPTERS,
    ADDED,
    ADMIN,
    APP,
    BROKEN,
    BUCKET,
    CLOUD,
    FULL,
    GHOST,
    LEGAL_ONLY,
    MODEL,
    QUESTION,
    SCANNED,
    TOKENS,
    TUNERS,
    reference_answers,
)

pytestmark = pytest.mark.own_app

HEADER = "x-shunter-replica"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}

@pytest.fixture(scope="module")
def app(routing_live_app):
    return routing_live_app


@pytest.fixture(scope="module")
def reference(app) -> dict[str, str]:
    return reference_answers()


def ask(app, model: str, key: str = FULL, question: list[dict[str, str]] = QUESTION) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": model, "messages": question, "max_tokens": TOKENS, "temperature": 0})


def answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def stats(replica: str) -> dict[str, Any]:
    from ray import serve

    from shunter.replica_protocol import RouteHint

    handle = serve.get_deployment_handle(f"model-{MODEL}", app_name=APP)
    return handle.stats.remote(RouteHint(pin=replica)).result(timeout_s=60)


def replicas(app) -> list[str]:
    resp = httpx.get(f"{app.base_url}/admin/models/{MODEL}/replicas", headers=ADMIN_HEADERS, timeout=60)
    return sorted(r["replica"] for r in resp.json()["replicas"])


def models_listed(app, key: str = FULL) -> dict[str, Any]:
    cards = httpx.get(f"{app.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60).json()
    return {card["id"]: card.get("parent") for card in cards["data"]}


def test_adapters_are_listed_with_their_base_those_found_in_adapter_dirs_too(app):
    parents = models_listed(app)
    assert parents == {MODEL: None, **{name: MODEL for name in (*ADAPTERS, BROKEN, SCANNED, CLOUD, GHOST)}}, parents
    assert ask(app, SCANNED).json()["model"] == SCANNED


def test_each_adapter_answers_as_vllm_itself_does_with_more_adapters_than_the_replicas_hold(app, reference):
    """Four adapters, two replicas holding one each: asked in turn, twice, they are loaded and evicted."""
    assert answer(ask(app, MODEL)) == reference[""], "the base model, with LoRA on, answers as vLLM does"
    for round_ in range(2):
        for name in ADAPTERS:
            resp = ask(app, name if round_ == 0 else f"{MODEL}:{name}")
            assert answer(resp) == reference[name], (round_, name)
            assert resp.json()["model"] == name
    assert len({reference[""], *(reference[n] for n in ADAPTERS)}) == len(ADAPTERS) + 1, \
        "every adapter answers apart from the base and from each other"
    loads = sum(sum(stats(r)["adapter_loads"].values()) for r in replicas(app))
    assert loads > len(ADAPTERS), f"more adapters than the replicas hold: some were loaded again ({loads})"


# Two lines for the base and each adapter, interleaved: every adapter is loaded and evicted as they come (the
# replicas hold one each); 40 lines checked nothing more in four times the engine time.
BATCH_LINES = 10


def _batch_done(client, batch_id: str, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return batch
        time.sleep(0.5)


def test_a_batch_across_the_adapters_answers_each_line_as_vllm_does(app, reference):
    """OpenAI's Batch API, lines for the base and every adapter interleaved (so the replicas load and evict
    adapters as the lines come): each line's answer is vLLM's own for its adapter. The same file from a key
    limited to one adapter: every line for anything else is refused before the batch runs, as the
    endpoint refuses it (403; 404 for an adapter that does not exist)."""
    import openai

    full = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key=FULL, max_retries=0, timeout=120)
    limited = full.with_options(api_key=LEGAL_ONLY)
    names = ["", *ADAPTERS]
    lines = [{"custom_id": f"{i}-{names[i % len(names)] or 'base'}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": names[i % len(names)] or MODEL, "messages": QUESTION, "max_tokens": TOKENS,
                       "temperature": 0}} for i in range(BATCH_LINES)]
    lines.append({"custom_id": "nobody", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "no-such-adapter", "messages": QUESTION, "max_tokens": TOKENS}})
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    ids = {}
    for client in (full, limited):
        uploaded = client.files.create(file=("adapters.jsonl", content), purpose="batch")
        ids[client] = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id
    done = _batch_done(full, ids[full])
    assert done.status == "completed" and \
        (done.request_counts.completed, done.request_counts.failed) == (BATCH_LINES, 1), done
    for row in (json.loads(r) for r in full.files.content(done.output_file_id).read().splitlines()):
        adapter = row["custom_id"].split("-", 1)[1]
        text = row["response"]["body"]["choices"][0]["message"]["content"]
        assert text == reference["" if adapter == "base" else adapter], row["custom_id"]
        assert row["response"]["body"]["model"] == (MODEL if adapter == "base" else adapter)
    done = _batch_done(limited, ids[limited])
    legal = BATCH_LINES // len(names)  # the lines for the one adapter the limited key may use
    assert done.status == "completed" and \
        (done.request_counts.completed, done.request_counts.failed) == (legal, BATCH_LINES - legal + 1), done
    errors = [json.loads(r) for r in limited.files.content(done.error_file_id).read().splitlines()]
    assert Counter(e["response"]["status_code"] for e in errors) == {403: BATCH_LINES - legal, 404: 1}


def test_an_adapter_in_an_object_store_is_fetched_to_the_node_and_answers_as_its_files_do(app, reference):
    source = f"s3://{BUCKET}/{CLOUD}"
    assert not local_copy(source).exists(), "nothing is fetched before a request needs it"
    for _ in range(2):  # the second time from the node's copy (or the engine's memory)
        resp = ask(app, CLOUD)
        assert answer(resp) == reference["legal"] and resp.json()["model"] == CLOUD, resp.text
    assert (local_copy(source) / "adapter_config.json").is_file(), "fetched into the node's cache"
    missing = ask(app, GHOST)
    assert missing.status_code == 422, missing.text
    error = missing.json()["error"]
    assert error["code"] == "adapter_unavailable" and f"s3://{BUCKET}/{GHOST}" in error["message"], error
    url = f"{app.base_url}/admin/models/{MODEL}/adapters"
    refused = httpx.post(url, json={"name": "nowhere", "source": f"s3://{BUCKET}/nowhere"}, headers=ADMIN_HEADERS,
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "adapter_source_unreadable", refused.text
    leaky = httpx.post(url, json={"name": "leaky", "source": f"s3://AKIA:secret@{BUCKET}/{CLOUD}"},
                       headers=ADMIN_HEADERS, timeout=60)
    assert leaky.status_code == 400 and "credentials" in leaky.text and "secret" not in leaky.text, leaky.text


def test_an_adapters_requests_go_where_it_is_loaded_and_a_burst_spreads(app):
    first = ask(app, "legal", question=[{"role": "user", "content": "Name a court."}])
    holder = first.headers[HEADER]
    (other,) = [r for r in replicas(app) if r != holder]
    before = {r: stats(r)["adapter_loads"].get("legal", 0) for r in (holder, other)}
    # Where legal is loaded now: the replica that just served it, and the other one too if an earlier
    # test left legal in its engine (then either is right, and neither loads it again).
    holders = {r for r in (holder, other) if "legal" in stats(r)["adapters"]}
    assert holder in holders, holders
    served = [ask(app, "legal", question=[{"role": "user", "content": f"Name law number {i}."}]).headers[HEADER]
              for i in range(6)]
    assert set(served) <= holders, f"each request went where legal is loaded ({sorted(holders)}): {served}"
    after = {r: stats(r)["adapter_loads"].get("legal", 0) for r in (holder, other)}
    assert after == before, f"no replica loaded legal again: {before} -> {after}"
    assert stats(holder)["adapters"] == ["legal"]

    async def burst() -> list[str]:
        client = app.async_openai()

        async def one(q: int) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model="medical", max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": f"Describe symptom number {q}."}])
            return raw.headers[HEADER]

        return await asyncio.gather(*(one(q) for q in range(16)))

    spread = Counter(asyncio.run(burst()))
    assert len(spread) == 2, f"a burst for one adapter does not pile onto one replica: {spread}"


def test_an_operator_adds_an_adapter_that_serves_at_once_then_removes_it(app, reference):
    url = f"{app.base_url}/admin/models/{MODEL}/adapters"
    body = {"name": ADDED, "source": ADAPTER_DIRS[ADDED]}
    assert ask(app, ADDED).status_code == 404, "not served before it is added"
    assert httpx.post(url, json=body, timeout=60).status_code in (401, 403), "an admin key is needed"
    for bad, status, code in (({"name": MODEL, "source": ADAPTER_DIRS[ADDED]}, 409, "adapter_name_taken"),
                              ({"name": "x", "source": "/nonexistent"}, 400, None),
                              ({"name": "a:b", "source": ADAPTER_DIRS[ADDED]}, 400, None),
                              # A name its DELETE route could not carry is refused, so every added one is removable.
                              ({"name": "sec2/slash", "source": ADAPTER_DIRS[ADDED]}, 400, None),
                              ({"name": "..", "source": ADAPTER_DIRS[ADDED]}, 400, None),
                              ({"name": ADDED, "source": ADAPTER_DIRS[ADDED], "rank": float("nan")}, 400, None)):
        resp = httpx.post(url, content=json.dumps(bad), headers={**ADMIN_HEADERS, "Content-Type": "application/json"},
                          timeout=60)
        assert resp.status_code == status and (code is None or resp.json()["error"]["code"] == code), (bad, resp.text)

    added = httpx.post(url, json=body, headers=ADMIN_HEADERS, timeout=60)
    assert added.status_code == 201 and added.json()["origin"] == "admin", added.text
    assert models_listed(app)[ADDED] == MODEL
    assert answer(ask(app, ADDED)) == reference[ADDED], "served as vLLM serves it, no restart"
    assert answer(ask(app, ADDED, key=TUNERS)) == reference[ADDED], "smol:* covers an adapter added later"
    listed = httpx.get(url, headers=ADMIN_HEADERS, timeout=60).json()["adapters"]
    (held_by,) = [a["held_by"] for a in listed if a["name"] == ADDED]
    assert held_by, f"the router knows which replica loaded it: {listed}"

    removed = httpx.delete(f"{url}/{ADDED}", headers=ADMIN_HEADERS, timeout=60)
    assert removed.status_code == 200, removed.text
    gone = ask(app, ADDED)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    assert ADDED not in models_listed(app)
    assert httpx.delete(f"{url}/{ADDED}", headers=ADMIN_HEADERS, timeout=60).status_code == 404


def test_a_broken_adapter_is_refused_and_the_replicas_keep_serving(app):
    for _ in range(2):
        resp = ask(app, BROKEN)
        assert resp.status_code == 422, resp.text
        error = resp.json()["error"]
        assert error["code"] == "adapter_unavailable" and BROKEN in error["message"]
    assert ask(app, ADAPTERS[0]).status_code == 200 and ask(app, MODEL).status_code == 200


def test_keys_limited_to_adapters(app):
    assert ask(app, "legal", LEGAL_ONLY).status_code == 200
    for other in ("medical", MODEL, f"{MODEL}:finance"):
        resp = ask(app, other, LEGAL_ONLY)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "model_not_allowed", (other, resp.text)
    assert list(models_listed(app, LEGAL_ONLY)) == ["legal"]
    assert ask(app, "finance", TUNERS).status_code == 200
    assert ask(app, MODEL, TUNERS).status_code == 403, "smol:* is every adapter of smol, not smol itself"


def test_an_adapter_rolls_out_to_new_files_behind_the_gates(app, reference):
    """finance rolls out to new files (poetry's weights): while it shifts, each conversation gets one
    version's answer under the name finance; promoted, every request gets the new one."""
    url = f"{app.base_url}/admin/models/{MODEL}/adapters/finance/rollout"
    settings = {"steps": [50, 100], "hold_s": 2, "max_hold_s": 120,
                "gates": {"min_requests": 2, "max_ttft_p95_ratio": 20, "max_e2e_p95_ratio": 20, "latency_slack_s": 5}}
    bad = httpx.post(url, json={"source": "/nonexistent", **settings}, headers=ADMIN_HEADERS, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_adapter", bad.text
    started = httpx.post(url, json={"source": ADAPTER_DIRS[ADDED], **settings}, headers=ADMIN_HEADERS, timeout=60)
    assert started.status_code == 202, started.text
    assert httpx.delete(f"{app.base_url}/admin/models/{MODEL}/adapters/finance", headers=ADMIN_HEADERS,
                        timeout=60).status_code == 409, "not removed mid-rollout"
    seen: set[str] = set()
    for i in range(60):
        status = httpx.get(url, headers=ADMIN_HEADERS, timeout=60).json()
        if status["rollout"]["phase"] == "done":
            break
        resp = httpx.post(f"{app.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {FULL}"},
                          timeout=120, json={"model": "finance", "messages": QUESTION, "max_tokens": TOKENS,
                                             "temperature": 0, "user": f"user-{i}"})
        assert resp.json()["model"] == "finance", "the client sees the adapter's name, whatever the version"
        seen.add(answer(resp))
    rollout = status["rollout"]
    assert (rollout["phase"], rollout["outcome"]) == ("done", "promoted"), rollout["history"]
    assert seen <= {reference["finance"], reference[ADDED]} and reference[ADDED] in seen, seen
    assert status["source"] == ADAPTER_DIRS[ADDED]
    assert answer(ask(app, "finance")) == reference[ADDED], "promoted: the new files serve"
