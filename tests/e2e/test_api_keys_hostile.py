"""The hostile client, against real engines with keys, quotas and limits (tests/e2e/keyed_app.py).

Every promise the door makes is tried the way an attacker would: numbers sent as strings and floats,
prompts hidden in content parts, tool definitions and batches, streams hung up before their usage
chunk, NaN and Infinity in every admin body, bodies that are not JSON by content type, hundreds of slow
uploads, and what an unauthenticated probe may learn. With two gateways, a cordon set through one is seen
by both. A 200 that exceeds a limit or a quota is a
failure here as much as a 500.
"""

from __future__ import annotations

import json
import math
import socket
import time
import uuid
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from .keyed_app import (
    ADMIN,
    APP,
    BUDGET,
    BUDGET_TOKENS_PER_MINUTE,
    CHAT_ONLY,
    ENGINE_SEQS,
    FULL,
    GATEWAY_SLOTS,
    GATEWAYS,
    MAX_N,
    MAX_PROMPT_TOKENS,
    MAX_TOKENS,
    TIMEOUT_S,
)
from .live import CAPITAL_QUESTION, CHAT_MODEL, EMBED_MODEL, assert_capital

pytestmark = pytest.mark.own_app

LONG_TEXT = "word " * 400  # about 400 tokens: twice max_prompt_tokens


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


def post(app: str, path: str, body: Any = None, key: str | None = FULL, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kwargs.pop("headers", {}))
    return httpx.post(f"{app}{path}", json=body, headers=headers, timeout=kwargs.pop("timeout", TIMEOUT_S), **kwargs)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": CAPITAL_QUESTION}], "max_tokens": 4,
            "temperature": 0, **extra}


def refused(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- 1. numbers are what the engine would make of them -----------------------------------------------

@pytest.mark.parametrize("path, extra, code", [
    ("/v1/chat/completions", {"n": "8"}, "n_too_large"),
    ("/v1/chat/completions", {"n": 8.0}, "n_too_large"),
    ("/v1/chat/completions", {"max_tokens": "500"}, "max_tokens_too_large"),
    ("/v1/chat/completions", {"max_completion_tokens": 500.0}, "max_tokens_too_large"),
    ("/v1/completions", {"n": "3"}, "n_too_large"),
    ("/v1/completions", {"max_tokens": "500", "stream": "true"}, "max_tokens_too_large"),
])
def test_numbers_sent_as_strings_or_floats_are_held_to_the_limits(app, path, extra, code):
    body = chat_body(**extra) if path == "/v1/chat/completions" else \
        {"model": CHAT_MODEL, "prompt": "The capital of France is", "max_tokens": 4, **extra}
    refused(post(app, path, body), 400, code)


def test_numbers_as_strings_within_the_limits_are_served_as_the_numbers_they_are(app):
    resp = post(app, "/v1/chat/completions", chat_body(n="2", max_tokens="6", temperature="0.5"))
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert len(reply["choices"]) == 2 and reply["usage"]["completion_tokens"] <= 2 * 6
    streamed = post(app, "/v1/chat/completions", chat_body(stream="true"))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert "data: [DONE]" in streamed.text


# ---- 2. a prompt is counted however it is sent ---------------------------------------------------------

def test_a_prompt_in_content_parts_is_counted_like_the_same_text_as_a_string(app):
    as_string = post(app, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": LONG_TEXT}]))
    as_parts = post(app, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": LONG_TEXT[:1000]}, {"type": "text", "text": LONG_TEXT[1000:]}]}]))
    for resp in (as_string, as_parts):
        assert f"at most {MAX_PROMPT_TOKENS}" in refused(resp, 400, "prompt_too_long")["message"]


def test_tool_definitions_count_toward_the_quota_and_the_prompt_limit(app):
    """Tool definitions are prompt text the key pays for, and the model reads: the builtin chat model's
    template renders them (tool_choice "none" included, as vLLM's default keeps them), so vLLM's own
    renderer counts them toward max_prompt_tokens at the replica."""
    tool = {"type": "function", "function": {"name": "lookup", "description": "word " * 1000,
                                             "parameters": {"type": "object", "properties": {}}}}
    body = chat_body(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="none")
    refused(post(app, "/v1/chat/completions", body, key=BUDGET), 429, "request_exceeds_quota")
    assert post(app, "/v1/chat/completions", body, key=FULL).status_code == 400  # no quota; past the context
    shorter = {**tool, "function": {**tool["function"], "description": "word " * 300}}  # within the context
    error = refused(post(app, "/v1/chat/completions", {**body, "tools": [shorter]}, key=FULL), 400,
                    "prompt_too_long")
    assert f"at most {MAX_PROMPT_TOKENS} prompt tokens" in error["message"]
    # Without the tool the same chat is served: it was the tool's text that did not fit.
    served = post(app, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "hi"}]), key=FULL)
    assert served.status_code == 200 and served.json()["usage"]["prompt_tokens"] < MAX_PROMPT_TOKENS, served.text


def test_every_prompt_of_a_batch_is_held_to_the_limit(app):
    refused(post(app, "/v1/completions", {"model": CHAT_MODEL, "prompt": ["Hello", LONG_TEXT], "max_tokens": 2}),
            400, "prompt_too_long")
    served = post(app, "/v1/completions", {"model": CHAT_MODEL, "prompt": ["Hello", "The sky is"], "max_tokens": 2,
                                           "n": MAX_N})
    assert served.status_code == 200 and len(served.json()["choices"]) == 2 * MAX_N


# ---- 3. hanging up does not refund what was generated ------------------------------------------------------

def _hang_up_after_first_token(app: str) -> int:
    """Open a stream on the budget key, read until its first token, hang up; the status it got."""
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Count from one to one hundred."}],
            "max_tokens": MAX_TOKENS, "stream": True}
    with httpx.stream("POST", f"{app}/v1/chat/completions", json=body, timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {BUDGET}"}) as resp:
        if resp.status_code != 200:
            resp.read()
            assert resp.json()["error"]["code"] == "rate_limit_exceeded", resp.text
            return resp.status_code
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                break  # the usage chunk has not come yet: close here
    return 200


def test_streams_cut_before_their_usage_chunk_are_charged_what_they_produced(app):
    # What one such request really costs at least: its prompt as the engine counts it, and one token.
    probe = post(app, "/v1/chat/completions", {"model": CHAT_MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Count from one to one hundred."}]}, key=FULL)
    cost = probe.json()["usage"]["prompt_tokens"] + 1
    began, served, statuses = time.monotonic(), 0, []
    for _ in range(3 * BUDGET_TOKENS_PER_MINUTE // cost):
        status = _hang_up_after_first_token(app)
        statuses.append(status)
        if status == 429:
            break
        served += 1
    assert statuses[-1] == 429, f"{served} streams hung up early, and the key was never stopped"
    refilled = BUDGET_TOKENS_PER_MINUTE / 60 * (time.monotonic() - began)
    # Honoured within one request's worth per gateway: the streams it got cost what the budget held.
    assert served * cost <= BUDGET_TOKENS_PER_MINUTE + refilled + GATEWAYS * (cost + MAX_TOKENS), (served, cost,
                                                                                                  refilled)


def _settled_count(url: str, **labels: str) -> float:
    """The key's settled requests as Ray's exporter shows them, once two scrapes 3 s apart agree (the
    suite's clusters export every 2 s, so a fresh count shows up late)."""
    from .live import metric_total

    last = None
    for _ in range(20):
        now = metric_total(httpx.get(url, timeout=10).text, "ray_shunter_key_requests_total", **labels)
        if now == last:
            return now
        last = now
        time.sleep(3)
    raise AssertionError(f"the key's request count never settled: {last}")


def test_whole_requests_whose_client_hangs_up_are_each_settled_once(app):
    """Clients that give up on whole (not streamed) replies while they queue at the engine: Serve cancels
    the gateway's handler, and each request still settles its quota and telemetry once, as 499, with
    nothing left in flight. One the engine finished as its client left is settled as the 200 it was (CI
    saw 23 of 24); only the batches the engine ran before the hang-up reached it can race like that: the one
    running as the clients left, and the next it took up in the moment the cancellation took to arrive (CI's
    run of 24 identical prompts, their prefix cached, finished 15). Each prompt here is its own: no cached
    prefix lets the engine run a batch in a moment."""
    import concurrent.futures

    from tests.integration.local_app import kept_metrics_url

    from .live import metric_total

    url = kept_metrics_url()
    before, hung_before = _settled_count(url, key_name="full"), _settled_count(url, key_name="full", status="499")
    finished_before = _settled_count(url, key_name="full", status="200")

    def one(i: int) -> str:
        body = chat_body(max_tokens=MAX_TOKENS, n=MAX_N, temperature=1.0, seed=1, ignore_eos=True,
                         messages=[{"role": "user", "content": f"{i} " + f"word{i} " * 45}])
        try:
            resp = post(app, "/v1/chat/completions", body, timeout=0.5)
            return str(resp.status_code) if resp.status_code == 200 else resp.text
        except httpx.TimeoutException:
            return "hung up"

    sent = 24  # more than the engine runs at once: most wait, and their clients leave
    with concurrent.futures.ThreadPoolExecutor(sent) as pool:
        outcomes = list(pool.map(one, range(sent)))
    hung = outcomes.count("hung up")
    assert hung and set(outcomes) <= {"hung up", "200"}, outcomes
    deadline = time.monotonic() + 60
    while _settled_count(url, key_name="full") < before + sent and time.monotonic() < deadline:
        time.sleep(1)
    assert _settled_count(url, key_name="full") == before + sent, "each request settled exactly once"
    hung_up = _settled_count(url, key_name="full", status="499") - hung_before
    finished = _settled_count(url, key_name="full", status="200") - finished_before
    assert hung_up + finished == sent, "a hang-up settles as 499, or as 200 where the reply was whole first"
    # The race is only for requests the engine ran before the cancellation reached it: the batch of
    # max_num_seqs / n running as the clients left, and the next it took up. Every one still queued is a 499.
    assert finished >= outcomes.count("200") and hung_up >= hung - 2 * (ENGINE_SEQS // MAX_N), outcomes
    # A gauge is a sample the gateway hands Ray within a second of its change (shunter.ray_metrics.StickyGauge):
    # the settled counts can be exported before it. It must come down to zero.
    deadline, in_flight = time.monotonic() + 30, None
    while in_flight != 0 and time.monotonic() < deadline:
        time.sleep(1)
        in_flight = metric_total(httpx.get(url, timeout=10).text, "ray_shunter_requests_in_flight", model=CHAT_MODEL)
    assert in_flight == 0, f"{in_flight} requests still counted in flight"


# ---- 4. non-finite numbers never get in ----------------------------------------------------------------------

NON_FINITE = ['NaN', 'Infinity', '-Infinity', '1e999']


def _admin_operations(app: str) -> list[tuple[str, str]]:
    paths = httpx.get(f"{app}/openapi.json", timeout=TIMEOUT_S).json()["paths"]
    return [(method.upper(), path) for path, methods in paths.items() if path.startswith("/admin")
            for method in methods if method in ("post", "put")]


def test_nan_and_infinity_are_refused_in_every_admin_body_and_the_models_keep_serving(app):
    operations = _admin_operations(app)
    assert len(operations) >= 6, operations
    bodies = [f'{{"weights": {{"default": {v}}}}}' for v in NON_FINITE] + \
             [f'{{"to": "v2", "hold_s": {v}}}' for v in NON_FINITE] + \
             [f'{{"timeout_s": {v}}}' for v in NON_FINITE]
    for method, path in operations:
        url = app + path.replace("{model_id}", CHAT_MODEL).replace("{replica_id}", "r1")
        for raw in bodies:
            resp = httpx.request(method, url, content=raw, timeout=TIMEOUT_S, headers={
                "Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
            assert resp.status_code == 400, (method, path, raw, resp.text)
            assert resp.json()["error"]["code"] == "invalid_json", (method, path, raw, resp.text)
    for raw in ('{"temperature": NaN}', '{"top_p": Infinity}', '{"max_tokens": 1e999}'):
        body = json.dumps(chat_body())[:-1] + ", " + raw[1:]
        resp = httpx.post(f"{app}/v1/chat/completions", content=body, timeout=TIMEOUT_S,
                          headers={"Authorization": f"Bearer {FULL}", "Content-Type": "application/json"})
        refused(resp, 400, "invalid_json")
    ready = httpx.get(f"{app}/ready", timeout=TIMEOUT_S)
    assert ready.status_code == 200, ready.text
    assert_capital(post(app, "/v1/chat/completions", chat_body(max_tokens=8)).json()["choices"][0]["message"][
        "content"], app, max_tokens=8, key=FULL)


def test_admin_bodies_are_typed_and_bounded(app):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    for body in ({"weights": {"default": -1}}, {"weights": {"default": "lots"}}, {"weights": {}},
                 {"weights": {"default": 0}}, {"weights": [1, 2]}):
        resp = httpx.put(f"{app}/admin/models/{CHAT_MODEL}/weights", json=body, headers=headers, timeout=TIMEOUT_S)
        assert refused(resp, 400)["param"].startswith("weights"), (body, resp.text)
    for body in ({"replace": "yes"}, {"force": 1}, {"timeout_s": -5}, {"timeout_s": 10 ** 9}, {"surprise": True}):
        resp = post(app, f"/admin/models/{CHAT_MODEL}/replicas/r1/drain", body, key=ADMIN)
        refused(resp, 400)


# ---- 5. JSON only, said so by its content type ---------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_bodies_not_sent_as_json_get_415_on_v1_and_admin(app, content_type):
    cases = [(f"{app}/v1/chat/completions", FULL, json.dumps(chat_body())),
             (f"{app}/admin/rollouts/{CHAT_MODEL}/pause", ADMIN, "{}"),
             (f"{app}/admin/rollouts/{CHAT_MODEL}", ADMIN, '{"to": "v2"}')]
    for url, key, raw in cases:
        headers = {"Authorization": f"Bearer {key}"}
        if content_type:
            headers["Content-Type"] = content_type
        resp = httpx.post(url, content=raw, headers=headers, timeout=TIMEOUT_S)
        refused(resp, 415, "unsupported_media_type")
    ok = httpx.post(f"{app}/v1/chat/completions", content=json.dumps(chat_body()), timeout=TIMEOUT_S,
                    headers={"Authorization": f"Bearer {FULL}", "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


# ---- 6. slow uploads --------------------------------------------------------------------------------------------

def test_many_slow_uploads_do_not_stop_a_normal_request(app):
    """More connections than the gateways take at once, each sending a chat request's headers and then
    one byte of its 100000-byte body: a normal request is still served, and the slow ones are refused
    (408 or 503), not held."""
    url = urlparse(app)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {FULL}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{").encode()
    slow = []
    try:
        for _ in range(2 * GATEWAYS * GATEWAY_SLOTS):
            sock = socket.create_connection((url.hostname, url.port), timeout=TIMEOUT_S)
            sock.sendall(head)
            slow.append(sock)
        time.sleep(1.0)
        resp = post(app, "/v1/chat/completions", chat_body(max_tokens=8), timeout=30)
        assert resp.status_code == 200, resp.text
        assert_capital(resp.json()["choices"][0]["message"]["content"], app, max_tokens=8, key=FULL)
        statuses = []
        for sock in slow[:10]:
            sock.settimeout(30)
            first = sock.recv(200).decode(errors="replace")
            statuses.append(first.split(" ")[1] if first.startswith("HTTP/1.1") else first[:40])
        assert set(statuses) <= {"408", "503"}, statuses
    finally:
        for sock in slow:
            sock.close()


# ---- 10. what a probe and a key may learn --------------------------------------------------------------------

def test_ready_tells_a_probe_only_whether_it_is_ready_and_an_admin_everything(app):
    probe = httpx.get(f"{app}/ready", timeout=TIMEOUT_S)
    assert probe.status_code == 200 and probe.json() == {"ready": True}
    detailed = httpx.get(f"{app}/ready", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT_S).json()
    assert detailed["ready"] and {"pid", "replica"} <= set(detailed["models"][CHAT_MODEL])
    client = httpx.get(f"{app}/ready", headers={"Authorization": f"Bearer {FULL}"}, timeout=TIMEOUT_S).json()
    assert client == {"ready": True}


def test_an_unknown_model_lists_only_the_models_the_key_may_use(app):
    error = refused(post(app, "/v1/chat/completions", chat_body(model="no-such-model"), key=CHAT_ONLY), 404,
                    "model_not_found")
    assert CHAT_MODEL in error["message"] and EMBED_MODEL not in error["message"]


def _same_id_streams(app: str) -> None:
    import concurrent.futures

    def one(_: int) -> int:
        return post(app, "/v1/chat/completions", chat_body(stream=True, max_tokens=8),
                    headers={"X-Request-ID": "same-id-for-all"}).status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [200] * 6


def test_requests_sharing_a_client_request_id_are_each_served(app):
    _same_id_streams(app)


def test_requests_sharing_a_client_request_id_leave_no_load_behind(app):
    _same_id_streams(app)
    deadline = time.monotonic() + 10
    while True:  # every request's load is given back: nothing stays counted in flight
        listed = httpx.get(f"{app}/admin/models/{CHAT_MODEL}/replicas", timeout=TIMEOUT_S,
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()["replicas"]
        if all(r["in_flight_here"] == 0 for r in listed) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert listed and all(r["in_flight_here"] == 0 for r in listed), listed


# ---- 11. several gateways, one set of cordons ------------------------------------------------------------

def _listings(app: str, count: int) -> dict[str, bool]:
    """Replica listings of the embedding model, through whichever gateway Ray's proxy picks, in rounds of
    `count` until every gateway has answered (the proxy prefers the less busy one, so a round may miss
    one): gateway log file -> whether its replica was cordoned there."""
    from .live import gateways_that_served

    seen: dict[str, bool] = {}
    for _ in range(5):
        answers = {}
        for _ in range(count):
            rid = f"listing-{uuid.uuid4().hex}"
            resp = httpx.get(f"{app}/admin/models/{EMBED_MODEL}/replicas", timeout=TIMEOUT_S,
                             headers={"Authorization": f"Bearer {ADMIN}", "X-Request-ID": rid})
            assert resp.status_code == 200, resp.text
            (replica,) = resp.json()["replicas"]
            answers[rid] = replica["cordoned"]
        for rid, gateway in gateways_that_served(APP, list(answers)).items():
            assert seen.setdefault(gateway, answers[rid]) == answers[rid], "one gateway answered both ways"
        if len(seen) == GATEWAYS:
            break
    return seen


def test_a_cordon_is_seen_by_every_gateway_and_so_is_its_release(app):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(f"{app}/admin/models/{EMBED_MODEL}/replicas", headers=admin, timeout=TIMEOUT_S).json()
    (replica,) = [r["replica"] for r in listed["replicas"]]
    drain = f"/admin/models/{EMBED_MODEL}/replicas/{replica}/drain"
    resp = post(app, drain, {"replace": False, "force": True}, key=ADMIN)
    assert resp.status_code == 202, resp.text
    try:
        assert _listings(app, 12) == {g: True for g in _gateway_names()}
        # The only replica, cordoned, still serves: nothing is refused for a drain.
        served = post(app, "/v1/embeddings", {"model": EMBED_MODEL, "input": "still here"})
        assert served.status_code == 200, served.text
    finally:
        released = httpx.delete(f"{app}{drain}", headers=admin, timeout=TIMEOUT_S)
    assert released.status_code == 200 and released.json()["cordoned"] is False, released.text
    assert _listings(app, 12) == {g: False for g in _gateway_names()}


def _gateway_names() -> set[str]:
    """The gateways alive now, by log file (an earlier module may have replaced some: the batch tests kill one
    and redeploy the app)."""
    from .live import living_gateway_logs

    names = living_gateway_logs(APP)
    assert len(names) == GATEWAYS, names
    return names


def test_finite_floats_in_sampling_parameters_still_work(app):
    resp = post(app, "/v1/chat/completions", chat_body(temperature=0.0, top_p=1.0, max_tokens=8.0))
    assert resp.status_code == 200 and not math.isnan(resp.json()["usage"]["completion_tokens"])
