"""Every way a request ends settles it exactly once: the caller's quota, telemetry, the routers'
in-flight count, the version's traffic record, the admission slot and the replica's work.

The real RequestEnd, AdmissionGate, DrainTracker, RequestTelemetry and stream relay; the replica's
stream, the routing state and the quota ticket are recording stand-ins (each counts what was done to it).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import pytest

from shunter.config import LimitsConfig, parse_config
from shunter.deployments.relay import relay
from shunter.deployments.replica_call import Started
from shunter.deployments.request_end import RequestEnd
from shunter.deployments.telemetry import RequestTelemetry
from shunter.ops.admission import AdmissionGate, DispatchQueue
from shunter.ops.draining import DrainTracker
from shunter.replica_protocol import Working

pytestmark = pytest.mark.unit

MODEL = parse_config({"models": [{"name": "smol", "source": "builtin:smollm2-135m-instruct"}]}).models[0]
LIMITS = LimitsConfig()
TOKEN = 'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = 'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
ENGINE_ERROR = 'data: {"error":{"message":"engine died","code":500}}\n\n'


class ReplicaStream:
    """The replica's response: yields `items` (an exception instance is raised), then stops; or hangs."""

    def __init__(self, items: list[Any], hang: bool = False):
        self.items, self.hang, self.cancels = list(items), hang, 0

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item
        if self.hang:
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancels += 1


class Routing:
    def __init__(self, departed: float | None = None):
        self.departed, self.finished_ids, self.outcomes = departed, [], []

    def finished(self, routing_id: str, cached_tokens: int | None = None, prompt_tokens: int = 0) -> None:
        self.finished_ids.append(routing_id)

    def departed_at(self, replica: str) -> float | None:
        return self.departed

    def record_outcome(self, replica: str, failed: bool, why: str = "") -> None:
        self.outcomes.append(failed)


class Ticket:
    def __init__(self):
        self.settles: list[tuple[str, int, int]] = []

    def settle(self, status: int | str, prompt: int, completion: int) -> None:
        self.settles.append((str(status), prompt, completion))


class Request:
    """One request's obligations, taken the way the forward pipeline takes them."""

    def __init__(self, stream: ReplicaStream | None = None, admitted: bool = True, departed: float | None = None):
        self.tel = RequestTelemetry("smol", "chat", {}, "req-1")
        self.end = RequestEnd(self.tel)
        self.ticket, self.gate, self.routing = Ticket(), AdmissionGate(4), Routing(departed)
        self.drains, self.versions = DrainTracker("smol"), []
        self.stream = stream
        self.end.reserve(self.ticket)
        self.queue = DispatchQueue(lambda: 4)
        if admitted:
            assert self.gate.try_admit(4) is None
            self.end.hold(self.gate)
            self.queue.dispatched += 1  # its turn came at once (DispatchQueue.enter with room)
            self.end.dispatched(self.queue)

    def answered(self, streamed: bool) -> Started:
        started = Started("replica-a", {"stream": streamed, "status": 200}, self.stream, None, "rid.1")
        self.end.attach(self.stream, "replica-a", "rid.1", self.routing, self.drains if streamed else None,
                        self.versions.append)
        return started

    def assert_settled_once(self, status: str, cancelled: bool, outcome: list[bool]) -> None:
        assert self.end.settled and self.tel._done
        assert [s for s, _, _ in self.ticket.settles] == [status], "quota settled once, at the client's status"
        assert self.gate.admitted == 0, "the admission slot is back"
        assert self.queue.dispatched == 0, "the dispatch turn is back"
        if self.end.reply is not None:
            assert self.routing.finished_ids == ["rid.1"], "the routers' in-flight count, once"
            assert self.drains.open == {}, "no stream left counted open on the replica"
        assert (self.stream.cancels > 0 if self.stream else False) == cancelled
        assert self.versions == outcome, "the version's traffic record"


async def drain_relay(req: Request, started: Started, limits: LimitsConfig = LIMITS,
                      stop_after: int | None = None) -> list[str]:
    chunks, body = [], relay(started, MODEL, req.routing, req.end, limits)  # type: ignore[arg-type]
    async for chunk in body:
        chunks.append(chunk)
        if stop_after is not None and len(chunks) >= stop_after:
            await body.aclose()  # the client hung up
            break
    return chunks


# ---- whole replies and refusals: the forward pipeline settles them with the status it returns ------------

def test_a_whole_reply_settles_at_its_status():
    req = Request(ReplicaStream([]))
    req.answered(streamed=False)
    req.end.settle(200, ok=True)
    req.assert_settled_once("200", cancelled=False, outcome=[True])


@pytest.mark.parametrize(("status", "admitted"), [(429, False), (403, False), (503, True), (504, True)])
def test_a_refusal_or_a_timeout_before_any_reply_gives_everything_back(status, admitted):
    """429/403 from the door (no slot taken), 503 when no version could start, 504 at the deadline."""
    req = Request(admitted=admitted)
    req.end.settle(status, finished=False)
    req.assert_settled_once(str(status), cancelled=False, outcome=[])


def test_a_client_gone_while_a_whole_reply_runs_is_a_499_and_stops_the_replica():
    req = Request(ReplicaStream([]))
    req.answered(streamed=False)
    req.end.settle(499, finished=False)
    req.assert_settled_once("499", cancelled=True, outcome=[])


def test_a_whole_reply_whose_client_left_is_charged_what_its_replica_last_reported():
    """The client left before the reply: the door's cancellation settles it at the replica's last
    heartbeat (its prompt and the completion tokens so far), not at nothing, not at the reservation."""
    req = Request()
    req.tel.routing("default", attempt=1)
    req.tel.working(Working(prompt_tokens=35, completion_tokens=12))
    req.tel.working(Working(prompt_tokens=35, completion_tokens=40))
    req.end.settle(499, finished=False)
    req.assert_settled_once("499", cancelled=False, outcome=[])
    assert req.ticket.settles == [("499", 35, 40)]


def test_a_heartbeat_counts_only_for_its_own_attempt_and_never_for_a_reply_that_came():
    retried = Request()
    retried.tel.routing("default", attempt=1)
    retried.tel.working(Working(prompt_tokens=35, completion_tokens=12))
    retried.tel.attempt_failed("ReplicaFailure")  # that replica died; the retry starts over
    retried.tel.routing("default", attempt=2)
    retried.end.settle(499, finished=False)
    assert retried.ticket.settles == [("499", 0, 0)], "nothing reported yet: the ticket charges its estimate"
    served = Request(ReplicaStream([]))
    served.tel.routing("default", attempt=1)
    served.tel.working(Working(prompt_tokens=35, completion_tokens=12))
    served.tel.whole_reply({"usage": {"prompt_tokens": 35, "completion_tokens": 20}})
    served.answered(streamed=False)
    served.end.settle(200, ok=True)
    assert served.ticket.settles == [("200", 35, 20)], "the reply's own usage"


def test_settling_twice_does_nothing_the_second_time():
    req = Request(ReplicaStream([]))
    req.answered(streamed=False)
    req.end.settle(200, ok=True)
    req.end.settle(500, finished=False)
    req.assert_settled_once("200", cancelled=False, outcome=[True])


# ---- streams: the relay settles them however they end ------------------------------------------------------

def test_a_stream_served_whole_is_a_200_with_its_tokens_counted():
    req = Request(ReplicaStream([TOKEN, TOKEN, USAGE]))
    chunks = asyncio.run(drain_relay(req, req.answered(streamed=True)))
    assert chunks == [TOKEN, TOKEN]  # the usage chunk the client did not ask for is dropped
    req.assert_settled_once("200", cancelled=False, outcome=[True])
    assert req.ticket.settles == [("200", 5, 2)]
    assert req.routing.outcomes == [False], "a success for the replica's breaker"


def test_an_engine_error_inside_the_stream_is_a_stream_error_and_the_versions_failure():
    req = Request(ReplicaStream([TOKEN, ENGINE_ERROR, "data: [DONE]\n\n"]))
    asyncio.run(drain_relay(req, req.answered(streamed=True)))
    req.assert_settled_once("stream_error", cancelled=False, outcome=[False])
    assert req.routing.outcomes == [True], "the replica's failure"


def test_a_replica_that_breaks_mid_stream_ends_it_with_an_error_event():
    req = Request(ReplicaStream([TOKEN, RuntimeError("actor died")]))
    chunks = asyncio.run(drain_relay(req, req.answered(streamed=True)))
    assert json.loads(chunks[-1].removeprefix("data: "))["error"]["code"] == "stream_interrupted"
    req.assert_settled_once("stream_error", cancelled=True, outcome=[False])


def test_a_client_that_hangs_up_mid_stream_is_a_499_and_stops_the_replica():
    req = Request(ReplicaStream([TOKEN, TOKEN, TOKEN]))
    asyncio.run(drain_relay(req, req.answered(streamed=True), stop_after=1))
    req.assert_settled_once("499", cancelled=True, outcome=[])


@pytest.mark.parametrize(("limits", "code"), [
    (LimitsConfig(request_timeout_s=0.3), "request_timeout"),
    (LimitsConfig(stream_idle_timeout_s=0.3), "stream_idle_timeout"),
])
def test_a_stream_cut_by_a_limit_ends_with_a_504_event(limits, code):
    req = Request(ReplicaStream([TOKEN], hang=True))
    chunks = asyncio.run(drain_relay(req, req.answered(streamed=True), limits))
    event = json.loads(chunks[-1].removeprefix("data: "))["error"]
    assert event["code"] == code
    req.assert_settled_once("stream_error", cancelled=True, outcome=[])


def test_a_stream_on_a_replica_past_its_drain_timeout_is_aborted():
    req = Request(ReplicaStream([TOKEN], hang=True), departed=time.monotonic() - MODEL.draining.timeout_s - 1)
    chunks = asyncio.run(drain_relay(req, req.answered(streamed=True)))
    assert json.loads(chunks[-1].removeprefix("data: "))["error"]["code"] == "replica_drain_timeout"
    req.assert_settled_once("stream_error", cancelled=True, outcome=[])


def test_a_stream_whose_response_never_started_settles_when_dropped():
    """The client left before the first byte: the relay never ran, so its `finally` never did."""
    req = Request(ReplicaStream([TOKEN]))
    body = relay(req.answered(streamed=True), MODEL, req.routing, req.end, LIMITS)  # type: ignore[arg-type]
    end, req.end = req.end, None
    del body, end
    gc.collect()
    assert [s for s, _, _ in req.ticket.settles] == ["499"] and req.gate.admitted == 0
    assert req.stream.cancels == 1 and req.routing.finished_ids == ["rid.1"] and req.drains.open == {}
