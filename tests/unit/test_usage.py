"""Usage per tenant from the gateway (shunter.deployments.gateway.usage, /admin/usage) and its config: the
writer batches off the request path, keeps a failed batch and sends it again (counted once by the ledger),
counts refusals per minute and kind instead of sending a row each, drops the oldest past its bound and counts
them, and hands everything over when it closes; the hook writes
one record per settled request of exactly what the key was charged; /admin/usage refuses bad parameters in
the API's error shape and answers 503 without a ledger."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from shunter.config import ConfigError, ShunterConfig, UsageConfig, parse_config
from shunter.deployments.gateway import admin_routes, usage
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.context import RequestContext, client_gone, refused, served
from shunter.deployments.gateway.flow.queue import FlowQueue
from shunter.deployments.gateway.forward import Forwarder
from shunter.deployments.gateway.lora import LiveAdapters
from shunter.deployments.gateway.parts import parts
from shunter.deployments.gateway.request_body import BodyReader
from shunter.deployments.gateway.request_end import RequestEnd, standard_hooks
from shunter.deployments.gateway.serving_state import ServingState
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.deployments.gateway.usage import PLATFORM_KEY, UsageWriter, record_usage, usage_record
from shunter.deployments.gateway.usage_params import parse_usage_query
from shunter.endpoints import CHAT, ParsedRequest
from shunter.errors import ApiError
from shunter.replica_protocol import AdapterRoute
from shunter.usage_ledger import LedgerStore, UsageRecord
from tests.unit.test_forward import Replica, Traffic, _request

pytestmark = pytest.mark.unit

PRICED = {"name": "m", "source": "builtin:smollm2-135m-instruct", "aliases": ["small"],
          "pricing": {"input_per_million": 1.0, "cached_input_per_million": 0.25, "output_per_million": 4.0}}
CONFIG = parse_config({"models": [PRICED]})
MODEL = CONFIG.models[0]


def rec(i: int | str) -> UsageRecord:
    return UsageRecord(request_id=f"r{i}", at=1000.0, key_name="k", key_id="kid", model="m", adapter="",
                       priority_class="standard", endpoint="chat", status="200", prompt_tokens=3, cached_tokens=0,
                       completion_tokens=1, cost=None)


class Ledger:
    """The UsageLedger deployment's handle, over a real store: `.record.remote(batch)`, `.query.remote(...)` and
    `.buckets.remote(...)` return awaitables. `fail`: the next calls that raise before writing; `lose_reply`:
    those that write, then raise (the reply lost on the way back); `hang`: calls never answer."""

    def __init__(self, store: LedgerStore | None = None):
        self.store = store
        self.batches: list[list[str]] = []  # the request ids of every batch that reached the ledger
        self.fail = self.lose_reply = 0
        self.hang = False
        self.record = SimpleNamespace(remote=self._record)
        self.query = SimpleNamespace(remote=self._query)
        self.buckets = SimpleNamespace(remote=self._buckets)

    def _record(self, batch: list[dict[str, Any]]) -> Any:
        async def call() -> int:
            if self.hang:
                await asyncio.Event().wait()
            if self.fail:
                self.fail -= 1
                raise ConnectionError("the ledger is restarting")
            self.batches.append([r["request_id"] for r in batch])
            new = self.store.write(UsageRecord.from_dict(r) for r in batch) if self.store else len(batch)
            if self.lose_reply:
                self.lose_reply -= 1
                raise ConnectionError("the reply was lost")
            return new

        return call()

    def _query(self, **kwargs: Any) -> Any:
        async def call() -> list[dict[str, Any]]:
            if self.fail:
                raise ConnectionError("the ledger is restarting")
            assert self.store is not None
            return self.store.query(**kwargs)

        return call()

    def _buckets(self, **kwargs: Any) -> Any:
        async def call() -> list[dict[str, Any]]:
            if self.fail:
                raise ConnectionError("the ledger is restarting")
            assert self.store is not None
            return self.store.buckets(**kwargs)

        return call()


def writer(ledger: Ledger, **config: Any) -> UsageWriter:
    return UsageWriter(UsageConfig(**{"flush_interval_s": 60, **config}), ledger)


# ---- the writer ------------------------------------------------------------------------------------------

def test_records_go_in_batches_of_at_most_max_batch_records_in_order():
    ledger = Ledger()
    w = writer(ledger, max_batch_records=3)

    async def run() -> None:
        for i in range(7):
            w.add(rec(i))
        assert ledger.batches == [], "adding only buffers: nothing is sent on the request path"
        assert await w.flush()
        await w.close()

    asyncio.run(run())
    assert ledger.batches == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert w.pending == 0 and w.sent == 7


def test_the_background_task_sends_every_flush_interval():
    ledger = Ledger()
    w = writer(ledger, flush_interval_s=0.01)

    async def run() -> None:
        w.add(rec(1))
        w.add(rec(2))
        for _ in range(200):
            if ledger.batches:
                break
            await asyncio.sleep(0.01)
        w.add(rec(3))
        for _ in range(200):
            if len(ledger.batches) == 2:
                break
            await asyncio.sleep(0.01)
        await w.close()

    asyncio.run(run())
    assert ledger.batches == [["r1", "r2"], ["r3"]]


def test_a_failed_batch_is_kept_and_sent_again_first(tmp_path):
    store = LedgerStore(tmp_path / "usage.sqlite3")
    ledger = Ledger(store)
    w = writer(ledger, max_batch_records=2)

    async def run() -> None:
        for i in range(3):
            w.add(rec(i))
        ledger.fail = 1
        assert not await w.flush(), "the ledger is down: nothing is lost, nothing is sent"
        assert w.pending == 3
        w.add(rec(3))
        ledger.lose_reply = 1  # written, but the gateway never hears so: sent again, counted once
        assert not await w.flush()
        assert await w.flush()

    asyncio.run(run())
    assert ledger.batches == [["r0", "r1"], ["r0", "r1"], ["r2", "r3"]], "the failed batch first, as it was"
    assert store.count() == 4, "a batch sent again after a lost reply is in the ledger once"
    store.close()


def test_past_the_bound_the_oldest_records_are_dropped_and_counted(monkeypatch):
    counted: list[float] = []
    metric = SimpleNamespace(inc=lambda value, tags=None: counted.append(value))
    monkeypatch.setattr(usage, "_record", lambda fn: fn({"shunter_usage_records_dropped_total": metric}))
    ledger = Ledger()
    w = writer(ledger, max_buffered_records=5)
    for i in range(8):  # off the event loop: nothing is sending
        w.add(rec(i))
    assert w.dropped == 3 and counted == [1, 1, 1]
    asyncio.run(w.close())
    assert ledger.batches == [["r3", "r4", "r5", "r6", "r7"]]


def refused_rec(key: str = "k", status: str = "429", at: float = 1000.0) -> UsageRecord:
    return UsageRecord(request_id=f"x{at}", at=at, key_name=key, key_id=f"id-{key}", model="m", adapter="",
                       priority_class="standard", endpoint="chat", status=status, prompt_tokens=0, cached_tokens=0,
                       completion_tokens=0, cost=None)


class Wall:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_refusals_are_counted_per_minute_and_kind_not_sent_a_row_each(tmp_path):
    store = LedgerStore(tmp_path / "usage.sqlite3")
    ledger, wall = Ledger(store), Wall(1000.0)
    w = UsageWriter(UsageConfig(flush_interval_s=60), ledger, wall=wall)

    async def run() -> None:
        for i in range(10_000):
            w.add(refused_rec(at=1000.0 + i * 0.001))
        for _ in range(5):
            w.add(refused_rec(status="499", at=1010.0))
        w.add(rec(1))
        assert w.held == 3 and w.pending == 3, "two counters and one record, not 10,006 records"
        assert await w.flush()
        first = ledger.batches[-1]
        assert first[0] == "r1" and len(first) == 3 and all(i.startswith(f"refused:{w.writer_id}:960:") for i in first[1:])
        for _ in range(3):
            w.add(refused_rec(at=1019.0))
        assert await w.flush()
        assert ledger.batches[-1] == first[1:2], "the counter again, under its id, with its count so far"
        assert await w.flush() and len(ledger.batches) == 2, "nothing new: nothing sent"
        wall.now = 1020.0  # the minute is over and all of it is in the ledger: forgotten
        assert await w.flush() and w.held == 0
        w.add(refused_rec(at=1021.0))
        assert await w.flush()
        assert ledger.batches[-1][0].startswith(f"refused:{w.writer_id}:1020:"), "a new minute, a new counter"

    asyncio.run(run())
    assert store.count() == 4 and sum(r["requests"] for r in store.query(group_by=())) == 10_000 + 3 + 5 + 1 + 1
    assert {r["requests"] for r in store.query(key="k", group_by=("priority_class",))} == {10_010}
    store.close()


def test_a_flood_of_refusals_stays_within_the_bound(monkeypatch, tmp_path):
    counted: list[float] = []
    metric = SimpleNamespace(inc=lambda value, tags=None: counted.append(value))
    monkeypatch.setattr(usage, "_record", lambda fn: fn({"shunter_usage_records_dropped_total": metric}))
    store = LedgerStore(tmp_path / "usage.sqlite3")
    ledger, wall = Ledger(store), Wall(1000.0)
    w = UsageWriter(UsageConfig(flush_interval_s=60, max_buffered_records=10), ledger, wall=wall)

    async def run() -> None:
        for i in range(50_000):  # a flood from three tenants: three counters
            w.add(refused_rec(key=f"t{i % 3}", at=1000.0 + i / 5000))
            assert w.held <= 10
        assert w.held == 3 and w.dropped == 0
        assert await w.flush()
        for minute in range(20):  # twenty minutes of it, the ledger down
            wall.now = 1020.0 + minute * 60
            for i in range(3000):
                w.add(refused_rec(key=f"t{i % 3}", at=wall.now + i / 100))
            assert w.held <= 10
        ledger.fail = 1
        assert not await w.flush()
        assert await w.flush()

    asyncio.run(run())
    # 60 counters in 20 minutes, room for 10: the first three were all sent (forgotten free), then the oldest
    # 50 go, each with its 1,000 unsent refusals.
    assert w.dropped == sum(counted) == 50 * 1000, "the oldest minutes' unsent counts, each request counted"
    (row,) = store.query(group_by=())
    assert row["requests"] + w.dropped == 50_000 + 20 * 3000, "what the ledger has plus what was dropped: every refusal"
    assert store.count() == 3 + 10, "a row per minute and kind, however many refusals"
    store.close()


def test_closing_hands_everything_over_and_a_silent_ledger_cannot_hold_the_stop():
    ledger = Ledger()
    w = writer(ledger, flush_interval_s=0.01)

    async def run() -> tuple[bool, bool]:
        w.add(rec(1))
        done = await w.close(timeout_s=1.0)
        ledger.hang = True
        w.add(rec(2))
        stuck = await w.close(timeout_s=0.05)
        return done, stuck

    done, stuck = asyncio.run(run())
    assert done and ledger.batches == [["r1"]]
    assert not stuck and w.pending == 1, "within its timeout; what did not go is reported, not waited for"


# ---- the hook ----------------------------------------------------------------------------------------------

class Collect:
    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    def add(self, record: UsageRecord) -> None:
        self.records.append(record)


def _end(caller: Any = None, reached: bool = True, prompt: int = 100, cached: int | None = 40,
         completion: int = 10, ticket: Any = None) -> RequestEnd:
    ctx = RequestContext(CHAT, ParsedRequest(CHAT, {}), MODEL, "client-id", caller=caller, priority_class="batch",
                         adapter=AdapterRoute("sql", "/adapters/sql", "sql"))
    ctx.usage.prompt_tokens, ctx.usage.cached_tokens, ctx.usage.completion_tokens = prompt, cached, completion
    ctx.ticket = ticket
    end = RequestEnd(ctx, RequestTelemetry(ctx, {}), standard_hooks(Traffic()))  # type: ignore[arg-type]
    if reached:
        end.dispatched(FlowQueue(lambda: 4))
    return end


def test_a_record_holds_what_the_key_was_charged_and_its_cost():
    access = AccessControl(CONFIG)
    caller = access.client({})
    ticket = access.admit(caller, "m", ParsedRequest(CHAT, {"messages": [{"role": "user", "content": "hi"}]}))
    end = _end(caller, ticket=ticket)
    outcome = served(200)
    ticket.settle("200", 100, 10)
    r = usage_record(end, outcome, now=lambda: 1234.5)
    assert (r.key_name, r.key_id, r.model, r.adapter, r.priority_class, r.endpoint, r.status, r.at) == \
        (caller.name, caller.key_id, "m", "sql", "batch", "chat", "200", 1234.5)
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (100, 40, 10)
    assert r.cost == pytest.approx((60 * 1.0 + 40 * 0.25 + 10 * 4.0) / 1e6)
    assert r.request_id == end.ctx.routing_id != "client-id", "the gateway's own id: a client's X-Request-ID may repeat"


def test_a_class_price_multiplier_scales_the_cost_and_nothing_else():
    access = AccessControl(CONFIG)
    caller = access.client({})
    ticket = access.admit(caller, "m", ParsedRequest(CHAT, {"messages": [{"role": "user", "content": "hi"}]}))
    end = _end(caller, ticket=ticket)
    ticket.settle("200", 100, 10)
    full = usage_record(end, served(200))
    end.ctx.price_multiplier = 0.5
    half = usage_record(end, served(200))
    assert half.cost == pytest.approx(full.cost / 2) and full.cost > 0
    assert (half.prompt_tokens, half.completion_tokens) == (full.prompt_tokens, full.completion_tokens)
    flow = parse_config({"models": [PRICED], "flow_control": {"classes": [
        {"name": "interactive", "price_multiplier": 2}, {"name": "batch", "capacity_share": 0.5,
                                                         "price_multiplier": 0.5}],
        "default_class": "interactive", "service_tiers": {"priority": "interactive", "flex": "batch"}}}).flow_control
    assert [flow.price_multiplier(c) for c in ("interactive", "batch", "")] == [2, 0.5, 1.0]
    for odd in (float("nan"), -1, 1e9, "free"):
        with pytest.raises(ConfigError, match="price_multiplier"):
            parse_config({"models": [PRICED], "flow_control": {"classes": [{"name": "only", "price_multiplier": odd}],
                                                                "default_class": "only", "service_tiers": {}}})


def test_a_request_that_never_reached_an_engine_records_zero_tokens():
    access = AccessControl(CONFIG)
    caller = access.client({})
    ticket = access.admit(caller, "m", ParsedRequest(CHAT, {"messages": [{"role": "user", "content": "hi"}]}))
    writer_ = Collect()
    end = _end(caller, reached=False, ticket=ticket)
    end.hooks = standard_hooks(Traffic(), writer_)  # type: ignore[arg-type]
    end.settle(client_gone())  # it left while it waited for a slot
    (r,) = writer_.records
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.status) == (0, 0, 0, "499")
    assert r.cost == 0.0
    # without a ticket (refused by the quota itself), the same rule
    no_ticket = _end(caller, reached=False)
    no_ticket.hooks = standard_hooks(Traffic(), writer_)  # type: ignore[arg-type]
    no_ticket.settle(refused(429))
    assert (writer_.records[1].prompt_tokens, writer_.records[1].status) == (0, "429")


def test_a_stream_cut_before_any_usage_records_the_estimated_prompt_as_charged():
    access = AccessControl(CONFIG)
    caller = access.client({})
    ticket = access.admit(caller, "m", ParsedRequest(CHAT, {"messages": [{"role": "user", "content": "hi " * 50}]}))
    writer_ = Collect()
    end = _end(caller, ticket=ticket, prompt=0, cached=None, completion=0)
    end.hooks = standard_hooks(Traffic(), writer_)  # type: ignore[arg-type]
    end.settle(client_gone())
    (r,) = writer_.records
    assert r.prompt_tokens == ticket.prompt_estimate > 0 and ticket.charged == (r.prompt_tokens, 0)


def test_settling_twice_writes_one_record_and_the_platforms_own_requests_have_no_key():
    writer_ = Collect()
    end = _end(caller=None)  # the tier monitor's request
    end.hooks = standard_hooks(Traffic(), writer_)  # type: ignore[arg-type]
    end.settle(served(200))
    end.settle(served(200))
    (r,) = writer_.records
    assert r.key_name == r.key_id == PLATFORM_KEY == ""
    assert (r.prompt_tokens, r.completion_tokens) == (100, 10)
    unpriced = parse_config({"models": [{"name": "u", "source": "builtin:smollm2-135m-instruct"}]}).models[0]
    end = _end()
    end.ctx.model = unpriced
    assert usage_record(end, served(200)).cost is None


def test_the_metrics_count_each_kind_and_cost_only_when_priced(monkeypatch):
    seen: list[tuple[str, float, dict[str, str]]] = []

    def metric(name: str) -> Any:
        return SimpleNamespace(inc=lambda value, tags=None: seen.append((name, value, tags or {})))

    metrics = {n: metric(n) for n in usage._NAMES}
    monkeypatch.setattr(usage, "_record", lambda fn: fn(metrics))
    record_usage(None)(_end(), served(200))
    labels = {"key_name": "", "model": "m", "adapter": "sql", "priority_class": "batch"}
    assert seen[:3] == [("shunter_usage_tokens_total", 100, {**labels, "kind": "prompt"}),
                        ("shunter_usage_tokens_total", 40, {**labels, "kind": "cached"}),
                        ("shunter_usage_tokens_total", 10, {**labels, "kind": "completion"})]
    assert seen[3][0] == "shunter_usage_cost_total" and seen[3][1] == pytest.approx(110 / 1e6)
    seen.clear()
    end = _end()
    end.ctx.model = parse_config({"models": [{"name": "u", "source": "builtin:smollm2-135m-instruct"}]}).models[0]
    record_usage(None)(end, served(200))
    assert [n for n, _, _ in seen] == ["shunter_usage_tokens_total"] * 3, "no pricing: no cost series"


def test_a_whole_reply_through_the_real_pipeline_is_one_record_of_its_usage():
    replica, traffic = Replica(), Traffic()
    state = ServingState(CONFIG, {"m": {"default": replica}}, traffic)  # type: ignore[arg-type]
    writer_ = Collect()
    forwarder = Forwarder(CONFIG, AccessControl(CONFIG), BodyReader(CONFIG.gateway), state, traffic, None,  # type: ignore[arg-type]
                          LiveAdapters(CONFIG), writer_)  # type: ignore[arg-type]
    replica.routing = state.routing(MODEL, "default")
    body = {"model": "small", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    response = asyncio.run(forwarder.forward(_request(body), CHAT))
    assert response.status_code == 200
    (r,) = writer_.records
    assert (r.model, r.endpoint, r.status, r.prompt_tokens, r.completion_tokens) == ("m", "chat", "200", 3, 1)
    assert r.cost == pytest.approx((3 * 1.0 + 1 * 4.0) / 1e6)


# ---- /admin/usage ------------------------------------------------------------------------------------------

def _refused(call: Any) -> dict[str, Any]:
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value.body()["error"]


def test_the_query_parameters_are_checked():
    q = parse_usage_query(None, "small", "1700000000", "2026-01-31T12:00:00Z", None, CONFIG)
    assert q == {"key": None, "model": "m", "since": 1_700_000_000.0, "until": 1_769_860_800.0,
                 "group_by": ("key", "model")}, "a model by any of its names; ISO 8601 in UTC"
    assert parse_usage_query(None, "gone", None, None, "", CONFIG)["model"] == "gone", "a retired model's records"
    assert parse_usage_query(None, None, None, None, "", CONFIG)["group_by"] == ()
    assert parse_usage_query(None, None, "2026-01-31", "2026-01-31T01:00:00+01:00", " adapter, endpoint ,adapter",
                             CONFIG)["group_by"] == ("adapter", "endpoint")
    for bad in ("nan", "inf", "-5", "yesterday", "1e999", "2026-13-01"):
        error = _refused(lambda bad=bad: parse_usage_query(None, None, bad, None, None, CONFIG))
        assert (error["param"], error["code"], error["type"]) == ("since", "invalid_time", "invalid_request_error")
    error = _refused(lambda: parse_usage_query(None, None, "200", "100", None, CONFIG))
    assert error["code"] == "invalid_window"
    error = _refused(lambda: parse_usage_query(None, None, None, None, "key,key_id", CONFIG))
    assert (error["param"], error["code"]) == ("group_by", "invalid_group_by") and "key_id" in error["message"]


def _admin_app(gw: Any) -> FastAPI:
    app = FastAPI()
    app.include_router(admin_routes.router)
    app.dependency_overrides[parts] = lambda: gw

    @app.exception_handler(ApiError)
    async def _api_error(request: Any, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    return app


def _get(app: FastAPI, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await client.get(url, headers=headers)

    return asyncio.run(call())


def test_admin_usage_answers_the_ledgers_sums_after_sending_its_own_records(tmp_path):
    store = LedgerStore(tmp_path / "usage.sqlite3")
    ledger = Ledger(store)
    w = writer(ledger)
    w.add(rec(1))
    w.add(rec(2))
    gw = SimpleNamespace(access=AccessControl(CONFIG), config=CONFIG, usage=w)
    answer = _get(_admin_app(gw), "/admin/usage?group_by=key,endpoint&since=0")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and body["since"] == 0.0 and body["until"] is None
    assert body["group_by"] == ["key", "endpoint"]
    assert body["data"] == [{"key": "k", "endpoint": "chat", "requests": 2, "prompt_tokens": 6, "cached_tokens": 0,
                             "completion_tokens": 2, "cost": None, "first_at": 1000.0, "last_at": 1000.0}]
    assert _get(_admin_app(gw), "/admin/usage?key=nobody").json()["data"] == []
    store.close()


def test_admin_usage_refusals_are_in_the_api_error_shape():
    ledger = Ledger()
    gw = SimpleNamespace(access=AccessControl(CONFIG), config=CONFIG, usage=writer(ledger))
    app = _admin_app(gw)
    bad = _get(app, "/admin/usage?group_by=colour")
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    ledger.fail = 10
    down = _get(app, "/admin/usage")
    assert down.status_code == 503 and down.json()["error"]["code"] == "usage_ledger_unavailable"
    assert down.headers["retry-after"]
    off = _get(_admin_app(SimpleNamespace(access=gw.access, config=CONFIG, usage=None)), "/admin/usage")
    assert off.status_code == 503 and off.json()["error"]["code"] == "usage_ledger_unavailable"


def test_admin_usage_needs_an_admin_key(monkeypatch):
    monkeypatch.setenv("CLIENT_KEY", "sk-client-0123456789abcdef")
    monkeypatch.setenv("ADMIN_KEY", "sk-admin-0123456789abcdef")
    cfg = parse_config({"models": [PRICED], "auth": {"keys": [{"name": "c", "key_env": "CLIENT_KEY"}],
                                                     "admin_keys": [{"name": "ops", "key_env": "ADMIN_KEY"}]}})
    gw = SimpleNamespace(access=AccessControl(cfg), config=cfg, usage=None)
    app = _admin_app(gw)
    assert _get(app, "/admin/usage").status_code == 401
    assert _get(app, "/admin/usage", {"authorization": "Bearer sk-client-0123456789abcdef"}).status_code == 403
    assert _get(app, "/admin/usage", {"authorization": "Bearer sk-admin-0123456789abcdef"}).status_code == 503


# ---- the config --------------------------------------------------------------------------------------------

def _config(**extra: Any) -> dict[str, Any]:
    return {"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct", **extra.pop("model", {})}], **extra}


def test_usage_defaults_and_pricing_are_optional():
    cfg = parse_config(_config())
    assert cfg.usage == UsageConfig() and cfg.usage.enabled and cfg.usage.path == "~/.shunter/usage.sqlite3"
    assert (cfg.usage.flush_interval_s, cfg.usage.max_batch_records, cfg.usage.max_buffered_records) == \
        (1.0, 500, 100_000)
    assert (cfg.usage.retention_days, cfg.usage.max_size_mb) == (90, None)
    kept = parse_config(_config(usage={"retention_days": None, "max_size_mb": 512})).usage
    assert (kept.retention_days, kept.max_size_mb) == (None, 512)
    assert cfg.models[0].pricing is None
    priced = parse_config(_config(model={"pricing": {"input_per_million": 0.5, "output_per_million": 2}}))
    pricing = priced.models[0].pricing
    assert pricing is not None and pricing.cached_input_per_million is None and pricing.cached_price == 0.5
    again = ShunterConfig.model_validate(priced.model_dump(mode="json"))  # the gateway's own re-validation
    assert again == priced


@pytest.mark.parametrize("price", [math.nan, math.inf, -1.0, "nan", "Infinity"])
def test_pricing_must_be_a_finite_non_negative_number(price):
    for field in ("input_per_million", "cached_input_per_million", "output_per_million"):
        pricing = {"input_per_million": 1, "output_per_million": 1, field: price}
        with pytest.raises(ConfigError, match=f"pricing.{field}"):
            parse_config(_config(model={"pricing": pricing}))


def test_usage_settings_are_bounded():
    for usage_cfg, field in (({"flush_interval_s": 0}, "flush_interval_s"), ({"flush_interval_s": 61}, "flush_interval_s"),
                             ({"flush_interval_s": math.nan}, "flush_interval_s"), ({"max_batch_records": 0}, "max_batch_records"),
                             ({"max_buffered_records": 0}, "max_buffered_records"), ({"path": "usage.db"}, "path"),
                             ({"path": ""}, "path"), ({"colour": 1}, "colour"),
                             ({"retention_days": 0}, "retention_days"), ({"retention_days": -1}, "retention_days"),
                             ({"retention_days": math.nan}, "retention_days"), ({"max_size_mb": 0}, "max_size_mb"),
                             ({"max_size_mb": math.inf}, "max_size_mb"), ({"max_size_mb": "big"}, "max_size_mb")):
        with pytest.raises(ConfigError, match=f"usage.{field}"):
            parse_config(_config(usage=usage_cfg))
    assert parse_config(_config(usage={"enabled": False, "path": "/var/lib/shunter/u.db"})).usage.path == \
        "/var/lib/shunter/u.db"
