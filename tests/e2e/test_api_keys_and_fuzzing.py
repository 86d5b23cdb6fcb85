"""API keys, quotas and limits on a live app with real engines (SmolLM2 and MiniLM), then fuzzing it.

The app (tests/e2e/keyed_app.py, shared with the hostile-client module) gets its keys as a real deployment
gives them: environment variables of its process and a key file (not a Serve runtime_env: Ray's
runtime-env agent writes its env_vars to its log, which the log test here catches).

Fuzzing: schemathesis generates requests from the gateway's own OpenAPI schema (every operation, bodies
valid and invalid, streaming among them), and hypothesis generates arbitrary JSON and bytes as bodies for
every generation and embedding endpoint (text with lone surrogates, odd code points, conversation items
vLLM's layers choke on). Every answer must be a non-5xx within its timeout (no hang), a 200 stream must not
carry the engine's error, no answer may move a breaker (the replica failures the gateways recorded stay
as they were), another key is served after each endpoint's cases, and the app must still answer a normal
request afterwards. Case counts are printed at the end (`-s`).

Two profiles: `make test` runs the fast one (derandomized: the same cases every run, a few dozen per
operation); `make fuzz` sets SHUNTER_FUZZ=deep, ten times as many cases, with a fresh seed each run.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shunter.auth import key_id

from .keyed_app import (
    ADMIN,
    APP,
    CHAT_ONLY,
    FULL,
    GATEWAYS,
    MAX_N,
    MAX_PROMPT_TOKENS,
    MAX_TOKENS,
    ORG_TWO,
    PACED,
    PACED_REQUESTS_PER_MINUTE,
    TIMEOUT_S,
    replica_failures,
    served_chat,
)
from .live import CAPITAL_QUESTION, CHAT_MODEL, EMBED_MODEL, assert_capital, ray_session_dir

pytestmark = pytest.mark.own_app

PROMPT_MARKER = "zebra-quartz-prompt-marker"
DEEP = os.environ.get("SHUNTER_FUZZ") == "deep"
SCALE = 10 if DEEP else 1  # cases per operation, relative to the fast profile
CASES: Counter[str] = Counter()  # cases sent, by source and operation
ANSWERS: Counter[str] = Counter()  # answers, by status class (and streams among the 200s)


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def chat(base: str, key: str | None, model: str = CHAT_MODEL, headers: dict[str, str] | None = None,
         **extra: Any) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=TIMEOUT_S, json={
        "model": model, "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        "max_tokens": 8, "temperature": 0, **extra})


# ---- keys --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [None, "sk-wrong-0123456789abcdef", ADMIN])
def test_missing_wrong_or_admin_keys_get_401_or_403_from_every_v1_endpoint(app, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path, body in [("GET", "/v1/models", None), ("GET", f"/v1/models/{CHAT_MODEL}", None),
                               ("POST", "/v1/chat/completions", {"model": CHAT_MODEL, "messages": []}),
                               ("POST", "/v1/completions", {"model": CHAT_MODEL, "prompt": "x"}),
                               ("POST", "/v1/embeddings", {"model": EMBED_MODEL, "input": "x"}),
                               ("POST", "/v1/responses", {"model": CHAT_MODEL, "input": "x"}),
                               ("POST", "/v1/messages", {"model": CHAT_MODEL, "max_tokens": 1, "messages": []})]:
        resp = httpx.request(method, f"{app}{path}", headers=headers, json=body, timeout=TIMEOUT_S)
        expected = 403 if key == ADMIN else 401
        assert resp.status_code == expected, (path, resp.text)
        error = resp.json()["error"]
        assert error["type"] == ("permission_error" if key == ADMIN else "authentication_error")
        if expected == 401:
            assert resp.headers["www-authenticate"] == "Bearer"


def test_the_official_client_with_a_wrong_key_gets_an_authentication_error(app):
    with pytest.raises(openai.AuthenticationError) as caught:
        client(app, "sk-wrong-0123456789abcdef").chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert caught.value.code == "invalid_api_key"


def test_a_key_restricted_to_one_model_sees_and_uses_only_that_model(app):
    restricted = client(app, CHAT_ONLY)
    assert [m.id for m in restricted.models.list()] == [CHAT_MODEL]
    assert sorted(m.id for m in client(app, FULL).models.list()) == sorted([CHAT_MODEL, EMBED_MODEL])
    with pytest.raises(openai.PermissionDeniedError) as caught:
        restricted.embeddings.create(model=EMBED_MODEL, input="hello")
    assert caught.value.code == "model_not_allowed"
    reply = restricted.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": CAPITAL_QUESTION}])
    assert_capital(reply.choices[0].message.content, app, max_tokens=8, key=FULL)


def test_admin_endpoints_need_the_admin_key(app):
    for key, status in [(None, 401), (FULL, 403), ("sk-wrong-0123456789abcdef", 401), (ADMIN, 200)]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        resp = httpx.get(f"{app}/admin/rollouts", headers=headers, timeout=TIMEOUT_S)
        assert resp.status_code == status, (key, resp.text)
        resp = httpx.post(f"{app}/admin/rollouts/{CHAT_MODEL}", headers=headers, json={"to": "v2"}, timeout=TIMEOUT_S)
        assert resp.status_code == (400 if status == 200 else status), resp.text  # 400: one version only


def test_every_admin_operation_the_gateway_publishes_refuses_callers_without_an_admin_key(app):
    """Every handler checks the key itself: this holds a new /admin operation to it as well."""
    paths = httpx.get(f"{app}/openapi.json", timeout=TIMEOUT_S).json()["paths"]
    operations = [(method.upper(), path) for path, methods in paths.items() if path.startswith("/admin")
                  for method in methods]
    assert len(operations) >= 8, operations
    for method, path in operations:
        url = app + path.replace("{model_id}", CHAT_MODEL)
        for key, status, code in [(None, 401, "missing_api_key"), (FULL, 403, "admin_key_required")]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            resp = httpx.request(method, url, headers=headers, json={}, timeout=TIMEOUT_S)
            assert resp.status_code == status and resp.json()["error"]["code"] == code, (method, path, resp.text)


def test_a_key_over_its_token_budget_gets_429_while_another_key_is_served(app):
    statuses, refused = [], None
    for _ in range(8):  # 120 tokens a minute; each request uses about 40
        resp = chat(app, CHAT_ONLY)
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            refused = resp
            break
    # Each gateway holds half the budget, which the restricted-key test above may have spent on one.
    assert refused is not None, statuses
    assert all(s == 200 for s in statuses[:-1]), statuses
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-tokens"] == "120"
    other = chat(app, FULL)
    assert other.status_code == 200, other.text
    assert_capital(other.json()["choices"][0]["message"]["content"], app, max_tokens=8, key=FULL)
    assert "x-ratelimit-limit-tokens" not in other.headers  # the full key has no quota


def test_a_key_over_its_requests_per_minute_gets_429_from_each_gateway_past_its_share(app):
    """Each of the GATEWAYS replicas holds its share of the key's rate (2 of 4 a minute): whichever
    gateway a request reaches, that gateway's first two are served and the rest refused, so together
    they never let through more than the key's limit."""
    from .live import gateways_that_served

    ids = [f"paced-{uuid.uuid4().hex}" for _ in range(12)]
    answers = {rid: chat(app, PACED, max_tokens=1, headers={"X-Request-ID": rid}) for rid in ids}
    gateway_of = gateways_that_served(APP, ids)
    assert set(gateway_of) == set(ids) and len(set(gateway_of.values())) == GATEWAYS, gateway_of
    share = PACED_REQUESTS_PER_MINUTE // GATEWAYS
    for gateway in set(gateway_of.values()):
        statuses = [answers[rid].status_code for rid in ids if gateway_of[rid] == gateway]
        assert statuses == ([200] * share + [429] * len(statuses))[:len(statuses)], (gateway, statuses)
    for refused in (a for a in answers.values() if a.status_code == 429):
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "requests" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == str(PACED_REQUESTS_PER_MINUTE)
    assert chat(app, FULL, max_tokens=1).status_code == 200, "another key is not held by this one's limit"


def test_usage_is_counted_per_key_id_never_per_key(app):
    from .live import scrape_until

    resp = chat(app, FULL)
    assert resp.status_code == 200
    from tests.integration.local_app import kept_metrics_url

    text = scrape_until(kept_metrics_url(),
                        [("ray_shunter_key_tokens_total", {"key_id": key_id(FULL), "kind": "completion"})])
    assert 'key_name="full"' in text
    assert FULL not in text and CHAT_ONLY not in text


# ---- limits --------------------------------------------------------------------------------------

def test_limits_answer_400_naming_the_field(app):
    cases = [({"max_tokens": 9}, "max_tokens_too_large"), ({"n": 3}, "n_too_large"),
             ({"messages": [{"role": "user", "content": "x"}] * 33}, "too_many_messages"),
             ({"messages": [{"role": "user", "content": "word " * 400}]}, "prompt_too_long")]
    for extra, code in cases:
        resp = chat(app, FULL, **extra)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == code


def test_a_chat_that_names_no_max_tokens_gets_the_platform_limit(app):
    resp = httpx.post(f"{app}/v1/chat/completions", headers={"Authorization": f"Bearer {FULL}"}, timeout=TIMEOUT_S,
                      json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Write a long story."}]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 8


def test_keys_and_prompts_stay_out_of_every_log(app):
    request_id = f"leak-scan-{uuid.uuid4().hex}"  # logged by design: the scan's positive control
    resp = chat(app, FULL, messages=[{"role": "user", "content": f"Say {PROMPT_MARKER}"}],
                headers={"X-Request-ID": request_id})
    assert resp.status_code == 200
    logs = ray_session_dir() / "logs"
    deadline, leaks, traced = time.monotonic() + 30, [], []
    while not traced and time.monotonic() < deadline:  # log lines reach their files within moments
        leaks, traced = [], []
        for path in logs.rglob("*"):
            if path.is_file():
                text = path.read_text(errors="replace")
                traced += [path.name] if request_id in text else []
                leaks += [(path.name, what) for what, secret in
                          [("full key", FULL), ("admin key", ADMIN), ("prompt", PROMPT_MARKER)] if secret in text]
        time.sleep(0 if traced else 1)
    assert traced, "the scan found the request's own id nowhere: it is not reading the logs the request wrote"
    assert not leaks


# ---- fuzzing ---------------------------------------------------------------------------------------

def _auth_for(path: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN if path.startswith('/admin') else FULL}"}


def _schema(base: str) -> Any:
    """The live gateway's OpenAPI document; `model` fields offered the served names (and one unknown)
    so generated bodies reach the engines, not only the 404."""
    import schemathesis

    raw = httpx.get(f"{base}/openapi.json", timeout=TIMEOUT_S).json()
    names = [CHAT_MODEL, "smollm2", EMBED_MODEL, "no-such-model"]
    schemas = raw["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"):
        ref = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schemas[ref.rpartition("/")[2]]  # the engine's own request model (a union for embeddings)
        for variant in [schemas[v["$ref"].rpartition("/")[2]] for v in body.get("anyOf", ())] or [body]:
            variant["properties"]["model"] = {"type": "string", "enum": names}
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=base)
    schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE,
                                           schemathesis.GenerationMode.NEGATIVE],
                                    max_examples=25 * SCALE, database="none")
    return schema


def _streamed(case: Any) -> Any:
    """The same valid case, asking for a stream."""
    if isinstance(case.body, dict):
        case.body["stream"] = True
    return case


# The fields of a request every valid case keeps in `_core_streamed`: the schema is vLLM's whole request
# model, whose dozens of optional fields (structured outputs, logprobs, penalties...) make nearly every
# generated valid case one the engine refuses for a combination; these cases reach the engine and stream.
_CORE = ("model", "messages", "prompt", "input", "system", "max_tokens", "max_completion_tokens",
         "max_output_tokens", "temperature", "top_p", "stop", "user")


def _core_streamed(case: Any) -> Any:
    """The same valid case, only its core fields, asking for a short stream of a chat model (a case the
    schema generated without a model, or with an unknown one, would only test the door's 400/404, which
    the other strategies do: this one is for streams that reach an engine, whatever the app's state)."""
    if isinstance(case.body, dict):
        case.body = {k: v for k, v in case.body.items() if k in _CORE}
        case.body["stream"] = True
        if case.body.get("model") not in (CHAT_MODEL, "smollm2"):
            case.body["model"] = CHAT_MODEL
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(case.body.get(field), int):
                case.body[field] = max(1, min(case.body[field], 8))
    return case


def _fuzz(operation: Any, failures: list[str]) -> Any:
    """A hypothesis test sending schemathesis' cases (valid and invalid) for one operation."""
    from schemathesis import GenerationMode

    name = f"{operation.method.upper()} {operation.path}"

    examples = SCALE * (60 if operation.path.startswith("/v1/") and operation.method.upper() == "POST" else 15)

    strategies = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]
    if operation.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE).map(_streamed))
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE).map(_core_streamed))

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              derandomize=not DEEP)
    @given(case=st.one_of(*strategies))
    def run(case: Any) -> None:
        CASES[f"schemathesis {name}"] += 1
        try:
            response = case.call(headers=_auth_for(operation.path), timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection is a finding
            failures.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
            return
        content_type = response.headers.get("content-type", "")
        _count_answer("schemathesis", response.status_code, content_type)
        if response.status_code >= 500:
            failures.append(f"{name} {case.body!r:.200} -> {response.status_code} {response.text[:200]}")
        elif response.status_code == 200 and operation.path in ("/v1/chat/completions", "/v1/completions"):
            if isinstance(content_type, list):  # schemathesis lists each header's values
                content_type = content_type[0] if content_type else ""
            answer = httpx.Response(200, headers={"content-type": content_type}, content=response.content)
            problem = limits_broken(case.body, answer)
            if problem is not None:
                failures.append(f"{name} {case.body!r:.200} -> 200 beyond the limits: {problem}")

    return run


def _count_answer(source: str, status: int, content_type: Any) -> None:
    if isinstance(content_type, list):  # schemathesis' responses list each header's values
        content_type = content_type[0] if content_type else ""
    ANSWERS[f"{source} {status // 100}xx"] += 1
    if status == 200 and str(content_type).startswith("text/event-stream"):
        ANSWERS[f"{source} 200 streams"] += 1


def test_schemathesis_every_operation_answers_without_5xx_or_hang(app):
    failures: list[str] = []
    operations = [result.ok() for result in _schema(app).get_all_operations()]
    assert len(operations) >= 13
    for operation in operations:
        _fuzz(operation, failures)()
    assert not failures, failures[:10]
    # The valid cases reached the engines, streams among them.
    assert ANSWERS["schemathesis 2xx"] > 0 and ANSWERS["schemathesis 200 streams"] > 0, ANSWERS


# Text as hostile clients send it: now and then with lone surrogates, control and odd code points.
ANY_CHARS = st.text(st.characters(blacklist_categories=()), max_size=8)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
                    | ANY_CHARS,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12) | ANY_CHARS, inner,
                                                                                max_size=4),
                    max_leaves=12)
TEXT = st.text(max_size=40) | ANY_CHARS
# Numbers also come as strings and floats, and past the limits: a 200 must still keep every limit.
def _count(limit: int) -> st.SearchStrategy[Any]:
    within = st.integers(1, limit)
    return within | within.map(str) | within.map(float) | st.integers(limit + 1, limit + 6).map(str)


SAMPLING = {"stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "max_tokens": _count(MAX_TOKENS), "n": _count(MAX_N), "temperature": st.floats(0.1, 2),
            "top_p": st.floats(0.1, 1), "stop": TEXT | st.lists(TEXT, max_size=2), "seed": st.integers(0, 2**31),
            "user": TEXT}
VALID = {
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.sampled_from([CHAT_MODEL, "smollm2"]),
         "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                     "content": TEXT}), min_size=1, max_size=3)},
        optional={**SAMPLING, "logprobs": st.booleans()}),
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.sampled_from([CHAT_MODEL, "smollm2"]),
         "prompt": TEXT | st.lists(st.integers(0, 40_000), min_size=1, max_size=5) | st.lists(TEXT, min_size=1, max_size=2)},
        optional={**SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5)}),
    "/v1/embeddings": st.fixed_dictionaries(
        {"model": st.just(EMBED_MODEL), "input": TEXT | st.lists(TEXT, min_size=1, max_size=3)},
        optional={"encoding_format": st.sampled_from(["float", "base64"]), "user": TEXT}),
    "/v1/responses": st.fixed_dictionaries(
        {"model": st.just(CHAT_MODEL), "input": TEXT | st.lists(st.one_of(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                   "content": TEXT | st.just([]) | st.lists(st.fixed_dictionaries(
                                       {"type": st.sampled_from(["input_text", "output_text", "refusal"]),
                                        "text": TEXT, "refusal": TEXT}), max_size=2)}),
            st.fixed_dictionaries({"type": st.just("message"), "role": st.just("assistant"), "content": st.just([])}),
            st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT})),
            min_size=1, max_size=3)},
        optional={"stream": st.booleans(), "max_output_tokens": _count(MAX_TOKENS), "instructions": TEXT,
                  "metadata": st.dictionaries(st.text(max_size=8), TEXT, max_size=2), "temperature": st.floats(0, 2)}),
    "/v1/messages": st.fixed_dictionaries(
        {"model": st.just(CHAT_MODEL), "max_tokens": _count(MAX_TOKENS),
         "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                     "content": TEXT | st.just([]) | st.lists(st.fixed_dictionaries(
                                                         {"type": st.just("text"), "text": TEXT}), max_size=2)}),
                              min_size=1, max_size=3)},
        optional={"stream": st.booleans(), "system": TEXT, "stop_sequences": st.lists(TEXT, max_size=2),
                  "metadata": st.fixed_dictionaries({"user_id": TEXT}), "temperature": st.floats(0, 1)}),
}


def _prompts(body: Any) -> int:
    prompt = body.get("prompt") if isinstance(body, dict) else None
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def limits_broken(body: Any, resp: httpx.Response) -> str | None:
    """What a 200 answer gives beyond the app's limits (None: nothing): more choices than max_n per
    prompt, more completion tokens than max_tokens per choice, a prompt over max_prompt_tokens, or an
    error event inside the stream."""
    prompts = _prompts(body)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        tokens: Counter[int] = Counter()
        for line in resp.text.splitlines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            error = event.get("error")
            # A request the platform accepted with a 200 must not fail mid-stream, except by its own fault
            # that only the engine's work could find (vLLM's logprobs of some echoed prompts raise): the
            # client's error then, never the engine's.
            if error and (error.get("type") != "invalid_request_error" or str(error.get("code")).startswith("5")):
                return f"an error event inside a 200 stream: {error}"
            for choice in event.get("choices") or ():
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    tokens[choice["index"]] += 1  # a chunk carries at least one token
            usage = event.get("usage")
            if usage and not event.get("choices") and usage["prompt_tokens"] > MAX_PROMPT_TOKENS * prompts:
                return f"prompt of {usage['prompt_tokens']} tokens"
        if len(tokens) > MAX_N * prompts or any(i >= MAX_N * prompts for i in tokens):
            return f"{len(tokens)} choices streamed"
        if any(n > MAX_TOKENS for n in tokens.values()):
            return f"a choice streamed {max(tokens.values())} token chunks"
        return None
    reply = resp.json()
    choices = reply.get("choices") or []
    usage = reply.get("usage") or {}
    if len(choices) > MAX_N * prompts:
        return f"{len(choices)} choices"
    if usage.get("completion_tokens", 0) > MAX_TOKENS * max(1, len(choices)):
        return f"{usage['completion_tokens']} completion tokens for {len(choices)} choices"
    if usage.get("prompt_tokens", 0) > MAX_PROMPT_TOKENS * prompts:
        return f"prompt of {usage['prompt_tokens']} tokens"
    return None


def _near(valid: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """Valid bodies, and valid bodies with one field (or a new one) replaced by arbitrary JSON."""
    def spoil(body: dict) -> st.SearchStrategy[dict]:
        field = st.sampled_from(sorted(body)) | st.text(max_size=12)
        return st.tuples(field, JSON).map(lambda kv: {**body, kv[0]: kv[1]})

    return valid | valid.flatmap(spoil)


# One plainly valid body per endpoint, always among the cases: the positive control that bodies reach the engine.
SERVED = {"/v1/chat/completions": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
          "/v1/completions": {"model": CHAT_MODEL, "prompt": "Hello", "max_tokens": 2},
          "/v1/embeddings": {"model": EMBED_MODEL, "input": "hello"},
          "/v1/responses": {"model": CHAT_MODEL, "input": "Hi", "max_output_tokens": 2},
          "/v1/messages": {"model": CHAT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}
# Cases per endpoint in the fast profile: the two agent APIs are covered by schemathesis too.
EXAMPLES = {"/v1/responses": 30, "/v1/messages": 30}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                                  "/v1/messages"])
def test_hypothesis_bodies_never_get_a_5xx_or_hang(app, path):
    seen: Counter[int] = Counter()
    failures_before = replica_failures(app, EMBED_MODEL if path == "/v1/embeddings" else CHAT_MODEL)

    @settings(max_examples=EXAMPLES.get(path, 50) * SCALE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=not DEEP)
    @given(body=_near(VALID[path]) | JSON, raw=st.none() | st.none() | st.binary(max_size=64))
    @example(body=SERVED[path], raw=None)
    def run(body: Any, raw: bytes | None) -> None:
        CASES[f"hypothesis POST {path}"] += 1
        content = raw if raw is not None else json.dumps(body).encode()
        resp = httpx.post(f"{app}{path}", content=content, timeout=TIMEOUT_S,
                          headers={**_auth_for(path), "Content-Type": "application/json"})
        seen[resp.status_code] += 1
        _count_answer("hypothesis", resp.status_code, resp.headers.get("content-type", ""))
        assert resp.status_code < 500, (body, raw, resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            shape = {"message", "type"} if path == "/v1/messages" else {"message", "type", "code"}
            assert set(resp.json()["error"]) >= shape, resp.text
        elif path in ("/v1/chat/completions", "/v1/completions"):
            problem = limits_broken(body, resp)
            assert problem is None, (problem, body, resp.text[:300])
        elif path != "/v1/embeddings":
            assert "server_error" not in resp.text and "api_error" not in resp.text, (body, resp.text[-300:])

    run()
    print(f"\n{path}: statuses {dict(seen)}")
    assert sum(n for status, n in seen.items() if status < 300) > 0, seen  # some bodies reached the engine
    model = EMBED_MODEL if path == "/v1/embeddings" else CHAT_MODEL
    assert replica_failures(app, model) == failures_before, "a client's body was counted as a replica failure"
    served_chat(app, ORG_TWO)  # another key is served after it all


def test_after_fuzzing_the_app_still_serves_normally(app):
    reply = client(app, FULL).chat.completions.create(
        model=CHAT_MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": CAPITAL_QUESTION}])
    assert_capital(reply.choices[0].message.content, app, max_tokens=8, key=FULL)
    print(f"\nfuzz cases: {sum(CASES.values())} in all; answers {dict(sorted(ANSWERS.items()))}")
    for name, count in sorted(CASES.items()):
        print(f"  {count:4d}  {name}")

