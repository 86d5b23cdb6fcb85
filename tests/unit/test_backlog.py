"""The gateways' backlog reaching the autoscaling policy: each gateway's reports in a key-value store (a
dict here, Ray's GCS store in a cluster), summed fresh by the policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shunter.ops import backlog as backlog_module
from shunter.ops.autoscaling import QueueDepthPolicy
from shunter.ops.backlog import STALE_S, Backlog, BacklogReporter, backlog

pytestmark = pytest.mark.unit


class DictStore:
    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.writes = 0

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        self.writes += 1
        self.data[key] = value

    def keys(self, prefix: bytes) -> list[bytes]:
        return [k for k in self.data if k.startswith(prefix)]


def test_gateways_report_their_waiting_requests_and_the_policy_sums_the_fresh_ones():
    store, now = DictStore(), [1000.0]
    one = BacklogReporter("app", "gw-1", store, clock=lambda: now[0])
    two = BacklogReporter("app", "gw-2", store, clock=lambda: now[0])
    other_app = BacklogReporter("other", "gw-3", store, clock=lambda: now[0])
    assert one.report({"m": 5, "n": 1}) and two.report({"m": 7}) and other_app.report({"m": 100})
    assert backlog("app", "m", store, now=now[0]).waiting == 12 and backlog("app", "n", store, now=now[0]).waiting == 1
    assert not one.report({"m": 5, "n": 1}), "unchanged and recent: not written again"
    now[0] += 3
    assert one.report({"m": 5, "n": 1}), "non-zero: refreshed so it does not go stale"
    assert two.report({"m": 0}) and not two.report({"m": 0}), "zero: written once"
    now[0] += STALE_S + 1  # gw-1 died after its last report
    assert backlog("app", "m", store, now=now[0]) == (0, 0)
    store.data[b"backlog/app/torn"] = b"{not json"
    assert backlog("app", "m", store, now=now[0]) == (0, 0), "a torn entry counts for nothing"


def test_gateways_report_their_batch_class_requests_beside_the_waiting_ones():
    store, now = DictStore(), [1000.0]
    one = BacklogReporter("app", "gw-1", store, clock=lambda: now[0])
    two = BacklogReporter("app", "gw-2", store, clock=lambda: now[0])
    assert one.report({"m": 5}, {"m": 4}) and two.report({"m": 1}, {"m": 9})
    assert backlog("app", "m", store, now=now[0]) == Backlog(waiting=6, batch=13)
    assert one.report({"m": 5}, {"m": 3}), "a changed batch count is written"
    assert two.report({"m": 0}, {"m": 0}) and not two.report({"m": 0}, {"m": 0})
    now[0] += 3
    assert one.report({"m": 0}, {"m": 3}), "batch work still running keeps the report fresh"


def test_the_policy_counts_the_gateways_backlog_with_the_engines_queues(monkeypatch):
    monkeypatch.setattr(backlog_module, "backlog",
                        lambda app, model: Backlog(30, 0) if (app, model) == ("app", "m") else Backlog(0, 0))
    policy = QueueDepthPolicy(model="m", min_replicas=1, max_replicas=4, target_per_replica=8, upscale_delay_s=0,
                              downscale_delay_s=30)
    ctx = SimpleNamespace(current_num_replicas=1, target_num_replicas=1, aggregated_metrics={"engine_requests": {"a": 8}},
                          total_queued_requests=0, total_num_requests=8, current_time=100.0, policy_state={},
                          app_name="app")
    replicas, state = policy(ctx)
    assert replicas == 4, "8 in the engine + 30 waiting in the gateways = 38 over 8 per replica, capped at 4"


def test_batch_work_alone_scales_the_model_only_to_its_batch_cap(monkeypatch):
    """38 requests waiting or running would need 4 replicas of 8. All batch work: the model goes to its batch
    cap of 2. With 16 of them urgent: those need 2, and the batch work adds none beyond its cap. With 24
    urgent: 3, which the batch work fills too. No batch work: all 38 count, as without classes."""
    batch = {"n": 30}
    monkeypatch.setattr(backlog_module, "backlog", lambda app, model: Backlog(30, batch["n"]))
    policy = QueueDepthPolicy(model="m", min_replicas=1, max_replicas=4, target_per_replica=8, upscale_delay_s=0,
                              downscale_delay_s=30, batch_max_replicas=2)

    def decide_at(now: float, engine: int) -> int:
        ctx = SimpleNamespace(current_num_replicas=1, target_num_replicas=1,
                              aggregated_metrics={"engine_requests": {"a": engine}}, total_queued_requests=0,
                              total_num_requests=engine, current_time=now, policy_state={}, app_name="app")
        return policy(ctx)[0]

    batch["n"] = 38  # every request is batch work (8 in the engine, 30 waiting)
    assert decide_at(100.0, 8) == 2
    batch["n"] = 22  # 16 urgent: 2 replicas for them; batch adds none beyond its cap
    assert decide_at(102.0, 8) == 2
    batch["n"] = 14  # 24 urgent: 3 replicas for them, which the batch work may use
    assert decide_at(104.0, 8) == 3
    batch["n"] = 0  # no batch work: as before, all 38 count
    assert decide_at(106.0, 8) == 4
