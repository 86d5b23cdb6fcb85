"""OpenAI's Usage API over the usage ledger (GET /v1/organization/usage/completions: usage_params, usage_routes):
its parameters checked into 400s in the API's shape, buckets aligned from start_time and paged with a cursor,
a client key seeing its own buckets only and an admin key (or an open deployment) every key's, refusal
counters not counted as model requests, and OpenAI's own client reading the answer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import QueryParams

from shunter.config import parse_config
from shunter.deployments.gateway import usage_routes
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.parts import parts
from shunter.deployments.gateway.usage import UsageWriter
from shunter.deployments.gateway.usage_params import cursor, parse_completions_usage
from shunter.errors import ApiError
from shunter.usage_ledger import LedgerStore, UsageRecord
from tests.unit.test_usage import Ledger

pytestmark = pytest.mark.unit

MODEL = {"name": "m", "source": "builtin:smollm2-135m-instruct", "aliases": ["small"]}
OPEN = parse_config({"models": [MODEL]})
ALICE, BOB, ADMIN = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef", "sk-admin-0123456789abcdef"
DAY = 86400
T0 = 1_767_225_600  # 2026-01-01T00:00:00Z


def parse(query: str, config: Any = OPEN):
    return parse_completions_usage(QueryParams(query), config)


def refused(query: str) -> dict[str, Any]:
    with pytest.raises(ApiError) as caught:
        parse(query)
    assert caught.value.status == 400
    error = caught.value.body()["error"]
    assert error["type"] == "invalid_request_error"
    return error


# ---- the parameters ---------------------------------------------------------------------------------------

def test_the_parameters_are_read_as_openai_documents_them():
    q = parse(f"start_time={T0}")
    assert (q.start, q.end, q.width, q.limit, q.first, q.group_by, q.models, q.key_ids) == \
        (T0, None, DAY, 7, T0, (), None, None), "1d buckets, 7 a page, by default"
    assert (parse(f"start_time={T0}&bucket_width=1h").limit, parse(f"start_time={T0}&bucket_width=1m").limit) == \
        (24, 60)
    assert parse(f"start_time={T0}&bucket_width=1m&limit=1440").limit == 1440
    brackets = parse(f"start_time={T0}&end_time={T0 + DAY}&group_by[]=model&group_by[]=api_key_id"
                     "&models[]=small&api_key_ids[]=k1")
    assert (brackets.end, brackets.group_by, brackets.store_groups, brackets.models, brackets.key_ids) == \
        (T0 + DAY, ("model", "api_key_id"), ("model", "key_id"), ("m",), ("k1",)), \
        "OpenAI's client sends arrays as name[]; a model by any of its names"
    repeated = parse(f"start_time={T0}&group_by=api_key_id&group_by=model&group_by=model&api_key_ids=a,b")
    assert repeated.group_by == ("api_key_id", "model") and repeated.key_ids == ("a", "b")
    assert parse(f"start_time={T0}&models=gone").models == ("gone",), "a model no longer served: its rows stay"


@pytest.mark.parametrize(("query", "param", "code"), [
    ("", "start_time", "missing_required_parameter"),
    ("start_time=", "start_time", "missing_required_parameter"),
    ("start_time=1.5", "start_time", "invalid_value"),
    ("start_time=nan", "start_time", "invalid_value"),
    ("start_time=-1", "start_time", "invalid_value"),
    ("start_time=1e9", "start_time", "invalid_value"),
    ("start_time=99999999999999999999", "start_time", "invalid_value"),
    ("start_time=20000000000", "start_time", "invalid_value"),
    (f"start_time={T0}&end_time=soon", "end_time", "invalid_value"),
    (f"start_time={T0}&end_time={T0 - 1}", "end_time", "invalid_window"),
    (f"start_time={T0}&bucket_width=1w", "bucket_width", "invalid_bucket_width"),
    (f"start_time={T0}&limit=0", "limit", "invalid_value"),
    (f"start_time={T0}&limit=32", "limit", "invalid_value"),
    (f"start_time={T0}&bucket_width=1h&limit=169", "limit", "invalid_value"),
    (f"start_time={T0}&limit=ten", "limit", "invalid_value"),
    (f"start_time={T0}&page=garbage", "page", "invalid_page"),
    (f"start_time={T0}&page=page_%%%", "page", "invalid_page"),
    (f"start_time={T0}&page={cursor(T0 + 5)}", "page", "invalid_page"),  # not on a bucket of this query
    (f"start_time={T0}&page={cursor(T0 - DAY)}", "page", "invalid_page"),  # before start_time
    (f"start_time={T0}&group_by=project_id", "group_by", "invalid_group_by"),
    (f"start_time={T0}&group_by[]=model&group_by[]=colour", "group_by", "invalid_group_by"),
    (f"start_time={T0}&project_ids[]=p1", "project_ids", "unsupported_parameter"),
    (f"start_time={T0}&batch=true", "batch", "unsupported_parameter"),
])
def test_a_bad_parameter_is_a_400_that_names_it(query, param, code):
    error = refused(query)
    assert (error["param"], error["code"]) == (param, code), error


def test_an_unsupported_group_names_what_is_supported():
    message = refused(f"start_time={T0}&group_by=user_id")["message"]
    assert "user_id" in message and "model" in message and "api_key_id" in message


def test_pages_list_every_bucket_from_start_time_and_cut_the_last_at_end_time():
    q = parse(f"start_time={T0 + 3600}&end_time={T0 + 10 * DAY}")  # buckets from start_time, not midnight
    page = q.page(now=T0 + 100 * DAY)
    assert page.buckets == [(T0 + 3600 + i * DAY, T0 + 3600 + (i + 1) * DAY) for i in range(7)]
    assert page.next_start == T0 + 3600 + 7 * DAY and page.next_page == cursor(page.next_start)
    second = parse(f"start_time={T0 + 3600}&end_time={T0 + 10 * DAY}&page={page.next_page}").page(now=T0 + 100 * DAY)
    assert second.buckets == [(T0 + 3600 + 7 * DAY, T0 + 3600 + 8 * DAY), (T0 + 3600 + 8 * DAY, T0 + 3600 + 9 * DAY),
                              (T0 + 3600 + 9 * DAY, T0 + 10 * DAY)], "the last bucket ends where the window does"
    assert second.next_start is None and second.next_page is None
    open_end = parse(f"start_time={T0}&bucket_width=1h").page(now=T0 + 2 * 3600 + 5)
    assert open_end.buckets == [(T0, T0 + 3600), (T0 + 3600, T0 + 7200), (T0 + 7200, T0 + 10800)], \
        "no end_time: up to the bucket now is in, whole"
    assert open_end.next_start is None
    assert parse(f"start_time={T0 + DAY}").page(now=T0).buckets == [], "a window that starts later: no bucket"
    assert parse(f"start_time={T0}&end_time={T0}").page(now=T0 + DAY).buckets == []


# ---- the route ----------------------------------------------------------------------------------------------

def usage_row(request_id: str, key: str, at: float, model: str = "m", adapter: str = "", prompt: int = 10,
              cached: int = 0, completion: int = 5, status: str = "200", requests: int = 1) -> UsageRecord:
    return UsageRecord(request_id=request_id, at=at, key_name=key, key_id=f"id-{key}", model=model, adapter=adapter,
                       priority_class="standard", endpoint="chat", status=status, prompt_tokens=prompt,
                       cached_tokens=cached, completion_tokens=completion, cost=None, requests=requests)


def _keyed(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, key in (("ALICE_KEY", ALICE), ("BOB_KEY", BOB), ("ADMIN_KEY", ADMIN)):
        monkeypatch.setenv(name, key)
    return parse_config({"models": [MODEL], "auth": {
        "keys": [{"name": "alice", "key_env": "ALICE_KEY"}, {"name": "bob", "key_env": "BOB_KEY"}],
        "admin_keys": [{"name": "ops", "key_env": "ADMIN_KEY"}]}})


def _app(gw: Any) -> FastAPI:
    app = FastAPI()
    app.include_router(usage_routes.router)
    app.dependency_overrides[parts] = lambda: gw

    @app.exception_handler(ApiError)
    async def _api_error(request: Any, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    return app


def _get(app: FastAPI, url: str, key: str | None = None, header: str = "authorization") -> httpx.Response:
    headers = {} if key is None else {header: f"Bearer {key}" if header == "authorization" else key}

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await client.get(url, headers=headers)

    return asyncio.run(call())


@pytest.fixture
def ledger(tmp_path):
    store = LedgerStore(tmp_path / "usage.sqlite3")
    yield Ledger(store)
    store.close()


def _gateway(config: Any, ledger: Ledger, rows: list[UsageRecord]) -> tuple[Any, UsageWriter]:
    access = AccessControl(config)
    ids = {c.name: c.key_id for _, c in access.ring.entries}
    w = UsageWriter(config.usage.model_copy(update={"flush_interval_s": 60}), ledger)
    for r in rows:  # buffered in this gateway: the route sends them first
        w.add(UsageRecord.from_dict({**r.to_dict(), "key_id": ids.get(r.key_name, r.key_id)}))
    return SimpleNamespace(access=access, config=config, usage=w), w


ROWS = [
    usage_row("a1", "alice", T0 + 60, prompt=100, cached=40, completion=10),
    usage_row("a2", "alice", T0 + DAY + 5, adapter="sql", prompt=20, completion=2),
    usage_row("a3", "alice", T0 + DAY + 7, status="429", prompt=0, completion=0, requests=1),  # a refusal
    usage_row("b1", "bob", T0 + 120, prompt=7, completion=3),
    usage_row("b2", "bob", T0 + 2 * DAY + 1, status="499", prompt=9, completion=1),  # it reached the engine
]
URL = f"/v1/organization/usage/completions?start_time={T0}&end_time={T0 + 3 * DAY}"


def _buckets(answer: httpx.Response) -> list[list[tuple[Any, ...]]]:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "page" and all(b["object"] == "bucket" for b in body["data"])
    return [[(r["api_key_id"], r["model"], r["input_tokens"], r["input_cached_tokens"], r["output_tokens"],
              r["num_model_requests"]) for r in b["results"]] for b in body["data"]]


def test_a_key_sees_its_own_buckets_only_and_an_admin_every_keys(monkeypatch, ledger):
    config = _keyed(monkeypatch)
    gw, w = _gateway(config, ledger, ROWS)
    app = _app(gw)
    ids = {c.name: c.key_id for _, c in gw.access.ring.entries}
    alice = _get(app, URL, ALICE)
    assert w.pending == 0, "this gateway's buffered records were sent first"
    body = alice.json()
    assert [(b["start_time"], b["end_time"]) for b in body["data"]] == [(T0 + i * DAY, T0 + (i + 1) * DAY)
                                                                         for i in range(3)]
    assert body["has_more"] is False and body["next_page"] is None
    assert _buckets(alice) == [[(None, None, 100, 40, 10, 1)], [(None, None, 20, 0, 2, 1)], []], \
        "her own usage; the 429 is not a model request; an empty bucket is listed empty"
    result = body["data"][0]["results"][0]
    assert result["object"] == "organization.usage.completions.result" and result["project_id"] is None
    assert (result["input_audio_tokens"], result["output_audio_tokens"], result["batch"]) == (0, 0, None)
    grouped = _get(app, URL + "&group_by=model&group_by=api_key_id", ALICE)
    assert _buckets(grouped) == [[(ids["alice"], "m", 100, 40, 10, 1)], [(ids["alice"], "m:sql", 20, 0, 2, 1)], []]
    assert _buckets(_get(app, URL + f"&api_key_ids={ids['bob']}", ALICE)) == [[], [], []], \
        "asking for another key's id shows nothing of it"
    assert _buckets(_get(app, URL, BOB, header="x-api-key")) == [[(None, None, 7, 0, 3, 1)], [], [(None, None, 9, 0, 1, 1)]]
    everyone = _get(app, URL + "&group_by[]=api_key_id", ADMIN)
    assert [sorted(b) for b in _buckets(everyone)] == [
        sorted([(ids["alice"], None, 100, 40, 10, 1), (ids["bob"], None, 7, 0, 3, 1)]),
        [(ids["alice"], None, 20, 0, 2, 1)], [(ids["bob"], None, 9, 0, 1, 1)]], "an admin key: every key's"
    assert _buckets(_get(app, URL + f"&api_key_ids[]={ids['bob']}&models=small", ADMIN)) == \
        [[(None, None, 7, 0, 3, 1)], [], [(None, None, 9, 0, 1, 1)]]
    assert _buckets(_get(app, URL + "&models=m:sql", ADMIN)) == [[], [(None, None, 20, 0, 2, 1)], []]
    assert _get(app, URL).status_code == 401
    assert _get(app, URL, "sk-nobody-0123456789abcdef").status_code == 401


def test_an_open_deployment_answers_for_everyone_and_pages_follow_next_page(ledger):
    gw, _ = _gateway(OPEN, ledger, ROWS)
    app = _app(gw)
    first = _get(app, URL + "&limit=2").json()
    assert [len(b["results"]) for b in first["data"]] == [1, 1] and first["has_more"] is True
    assert first["data"][0]["results"][0]["num_model_requests"] == 2 and \
        first["data"][0]["results"][0]["input_tokens"] == 107
    second = _get(app, URL + f"&limit=2&page={first['next_page']}").json()
    assert [(b["start_time"], b["results"][0]["output_tokens"]) for b in second["data"]] == [(T0 + 2 * DAY, 1)]
    assert second["has_more"] is False and second["next_page"] is None
    minutes = _get(app, f"/v1/organization/usage/completions?start_time={T0}&bucket_width=1m&limit=3").json()
    assert [b["start_time"] for b in minutes["data"]] == [T0, T0 + 60, T0 + 120] and minutes["has_more"] is True
    assert [[r["input_tokens"] for r in b["results"]] for b in minutes["data"]] == [[], [100], [7]]


def test_refusals_the_ledger_off_or_silent_are_in_the_api_error_shape(ledger):
    gw, _ = _gateway(OPEN, ledger, [])
    app = _app(gw)
    bad = _get(app, "/v1/organization/usage/completions?start_time=yesterday")
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    ledger.fail = 10
    down = _get(app, URL)
    assert down.status_code == 503 and down.json()["error"]["code"] == "usage_ledger_unavailable"
    assert down.headers["retry-after"]
    off = _get(_app(SimpleNamespace(access=gw.access, config=OPEN, usage=None)), URL)
    assert off.status_code == 503 and off.json()["error"]["code"] == "usage_ledger_unavailable"


def test_openais_own_client_reads_the_answer(monkeypatch, ledger):
    openai = pytest.importorskip("openai")
    config = _keyed(monkeypatch)
    gw, _ = _gateway(config, ledger, ROWS)
    app = _app(gw)
    ids = {c.name: c.key_id for _, c in gw.access.ring.entries}

    async def read(key: str) -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, admin_api_key=key, http_client=http)
            return await client.admin.organization.usage.completions(
                start_time=T0, end_time=T0 + 3 * DAY, bucket_width="1d", group_by=["model", "api_key_id"])

    page = asyncio.run(read(ALICE))
    assert [[(r.api_key_id, r.model, r.input_tokens, r.num_model_requests) for r in b.results] for b in page.data] \
        == [[(ids["alice"], "m", 100, 1)], [(ids["alice"], "m:sql", 20, 1)], []]
    everyone = asyncio.run(read(ADMIN))
    assert {r.api_key_id for b in everyone.data for r in b.results} == {ids["alice"], ids["bob"]}
