"""The app with API keys, quotas and limits that three e2e modules share: the agent-API keys module, the
keys-and-fuzzing module and the hostile-client module (one app start for all; tests/e2e/conftest.py stops it after the last test
that uses it).

Keys reach the gateway as a real deployment gives them: environment variables of its process and a key
file (not a Serve runtime_env: Ray's runtime-env agent writes its env_vars to its log). The limits are
tight (8 generated tokens, n <= 2, 200 prompt tokens) so requests that pass every check finish fast on 2
CPU cores; the gateway takes few requests at once and few slow uploads, so the slow-upload test needs
hundreds of connections, not thousands.

It runs two gateway replicas, as a production app would: each holds its share of every key's quota
and of each model's admission bound, and every test here runs against both (Ray's proxy spreads
requests over them), so anything one gateway keeps to itself shows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from shunter.auth import new_key
from tests.integration.local_app import local_app, redeploy

from .live import CHAT_MODEL, EMBED_MODEL, wait_ready

APP = "keys-e2e"
FULL, CHAT_ONLY, BUDGET, PACED, ADMIN = new_key(), new_key(), new_key(), new_key(), new_key()
AGENTS, EMBED_ONLY = new_key(), new_key()  # tests/e2e/test_api_keys_agents.py
ORG_ONE, ORG_TWO = new_key(), new_key()  # two keys of one cache group (tests/e2e/test_api_keys_isolation.py)
LEAVER = new_key()  # clients that leave before their reply (tests/e2e/test_api_keys_disconnect.py)
JOBS = new_key()  # a batch-class key (tests/e2e/test_api_keys_agents.py: priority classes)
FLOOD, LIGHT = new_key(), new_key()  # two tenants of one class (tests/e2e/test_api_keys_flow.py)
URGENT = new_key()  # an interactive key (same module: engine priority on the Messages path)
METERED = new_key()  # a key whose rate-limit headers are read (tests/e2e/test_api_keys_flow.py)
LEDGER_A, LEDGER_B = new_key(), new_key()  # two tenants whose usage the ledger must equal (same module)
ENV = {"SHUNTER_TEST_KEY_FULL": FULL, "SHUNTER_TEST_KEY_CHAT": CHAT_ONLY, "SHUNTER_TEST_KEY_BUDGET": BUDGET,
       "SHUNTER_TEST_KEY_PACED": PACED, "SHUNTER_TEST_KEY_AGENTS": AGENTS, "SHUNTER_TEST_KEY_EMBED": EMBED_ONLY,
       "SHUNTER_TEST_KEY_ORG_ONE": ORG_ONE, "SHUNTER_TEST_KEY_ORG_TWO": ORG_TWO, "SHUNTER_TEST_KEY_LEAVER": LEAVER,
       "SHUNTER_TEST_KEY_JOBS": JOBS, "SHUNTER_TEST_KEY_FLOOD": FLOOD, "SHUNTER_TEST_KEY_LIGHT": LIGHT,
       "SHUNTER_TEST_KEY_METERED": METERED, "SHUNTER_TEST_KEY_LEDGER_A": LEDGER_A,
       "SHUNTER_TEST_KEY_LEDGER_B": LEDGER_B, "SHUNTER_TEST_KEY_URGENT": URGENT}
MAX_TOKENS, MAX_N, MAX_PROMPT_TOKENS = 8, 2, 200
MAX_EMBEDDING_INPUTS = 64
MAX_FILE_BYTES = 64 * 1024  # batch.max_file_bytes (tests/e2e/test_api_keys_files.py)
BUDGET_TOKENS_PER_MINUTE = 1000
PACED_REQUESTS_PER_MINUTE = 4  # 2 per gateway
METERED_REQUESTS_PER_MINUTE = 60  # 30 per gateway, refilled at one every 2 s
AGENTS_TOKENS_PER_MINUTE = 400  # 200 per gateway: a few small Responses and Messages requests each
LEAVER_TOKENS_PER_MINUTE = 10_000_000  # a quota that settles every request and never refuses one
GATEWAYS, GATEWAY_SLOTS, UPLOAD_SLOTS = 2, 96, 8  # slots: per gateway replica
# The chat model's admission bound per gateway: its share of the replica's 64 slots plus its share of the
# queue bound, 64 in all, below the gateway's own slots, so a flood that fills the bound is refused by the
# model's gate, not queued before the gateways (tests/e2e/test_api_keys_flow.py: fair at the door).
CHAT_QUEUE_PER_GATEWAY = 32
TIMEOUT_S = 90  # no single request may take longer: past it, the app hung
ENGINE_SEQS = 16  # each engine's max_num_seqs
# The chat model's price per million tokens (uncached prompt, cached prompt, completion): the ledger's cost.
PRICING = {"input_per_million": 0.5, "cached_input_per_million": 0.25, "output_per_million": 2.0}
# Two narrow classes after the default three, for the flow-control tests (tests/e2e/test_api_keys_flow.py):
# each may fill LANE_SLOTS of the 8 sequences a gateway's share of the chat engine runs at once (16, over two
# gateways; headroom is counted in those, fewer than the 32 slots), so a burst of them queues in the gateways
# while the engine has room to spare.
LANE_SLOTS = 2
BATCH_PRICE_MULTIPLIER = 0.5  # flex served at half the model's prices (tests/e2e/test_api_keys_usage.py)
FLOW_CONTROL = {
    "classes": [{"name": "interactive", "max_wait_s": 10},
                {"name": "standard", "min_share": 0.1},
                {"name": "batch", "max_wait_s": 50, "capacity_share": 0.75, "min_share": 0.05,
                 "price_multiplier": BATCH_PRICE_MULTIPLIER},
                {"name": "lane", "max_wait_s": 50, "capacity_share": LANE_SLOTS / (ENGINE_SEQS // GATEWAYS)},
                {"name": "lane-low", "max_wait_s": 50, "capacity_share": LANE_SLOTS / (ENGINE_SEQS // GATEWAYS)}],
    "default_class": "standard",
    # The lanes' checks count turns in a queue whose headroom holds the whole time: released after a quiet
    # spell (issue 52, item 2; checked in tests/unit/test_flow_queue.py), a lane alone would fill every
    # sequence, and the first test of a module would see another queue than the rest.
    "headroom_hold_s": None,
}


def args(admin_key_file: Path) -> dict[str, Any]:
    engine = {"max_model_len": 1024, "max_num_seqs": ENGINE_SEQS, "cpu_kv_cache_gib": 1}
    return {
        "models": [
            {"name": CHAT_MODEL, "aliases": ["smollm2"], "source": "builtin:smollm2-135m-instruct",
             "engine": {**engine, "scheduling_policy": "priority"}, "pricing": PRICING,
             "admission": {"max_queued_requests": GATEWAYS * CHAT_QUEUE_PER_GATEWAY}},
            {"name": EMBED_MODEL, "source": "builtin:all-minilm-l6-v2", "task": "embed",
             "engine": {**engine, "max_model_len": 256}},
        ],
        "gateway": {"replicas": GATEWAYS, "max_ongoing_requests": GATEWAY_SLOTS, "max_body_reads": UPLOAD_SLOTS, "body_timeout_s": 10,
                    "queue_timeout_s": 30,
                    "limits": {"max_tokens": MAX_TOKENS, "max_n": MAX_N, "max_messages": 32,
                               "max_prompt_tokens": MAX_PROMPT_TOKENS, "request_timeout_s": 60,
                               "max_embedding_inputs": MAX_EMBEDDING_INPUTS,
                               "stream_idle_timeout_s": 30}},
        "flow_control": FLOW_CONTROL,
        # A ledger of this app's own, beside the admin key (not ~/.shunter, which outlives the test run).
        "usage": {"path": str(admin_key_file.parent / "usage.sqlite3"), "flush_interval_s": 0.2},
        # The Files API's records and bytes of this app's own too, and a small file limit to cross.
        "batch": {"state": str(admin_key_file.parent / "batch.sqlite3"), "files": str(admin_key_file.parent / "files"),
                  "max_file_bytes": MAX_FILE_BYTES},
        "auth": {
            "keys": [{"name": "full", "key_env": "SHUNTER_TEST_KEY_FULL"},
                     {"name": "chat-only", "key_env": "SHUNTER_TEST_KEY_CHAT", "models": ["smollm2"],
                      "tokens_per_minute": 120},
                     {"name": "budget", "key_env": "SHUNTER_TEST_KEY_BUDGET",
                      "tokens_per_minute": BUDGET_TOKENS_PER_MINUTE},
                     {"name": "paced", "key_env": "SHUNTER_TEST_KEY_PACED",
                      "requests_per_minute": PACED_REQUESTS_PER_MINUTE},
                     {"name": "agents", "key_env": "SHUNTER_TEST_KEY_AGENTS",
                      "tokens_per_minute": AGENTS_TOKENS_PER_MINUTE},
                     {"name": "embed-only", "key_env": "SHUNTER_TEST_KEY_EMBED", "models": [EMBED_MODEL]},
                     {"name": "org-one", "key_env": "SHUNTER_TEST_KEY_ORG_ONE", "cache_group": "org"},
                     {"name": "org-two", "key_env": "SHUNTER_TEST_KEY_ORG_TWO", "cache_group": "org"},
                     {"name": "leaver", "key_env": "SHUNTER_TEST_KEY_LEAVER",
                      "tokens_per_minute": LEAVER_TOKENS_PER_MINUTE},
                     {"name": "jobs", "key_env": "SHUNTER_TEST_KEY_JOBS", "priority_class": "batch"},
                     {"name": "flood", "key_env": "SHUNTER_TEST_KEY_FLOOD"},
                     {"name": "light", "key_env": "SHUNTER_TEST_KEY_LIGHT"},
                     {"name": "urgent", "key_env": "SHUNTER_TEST_KEY_URGENT", "priority_class": "interactive"},
                     {"name": "metered", "key_env": "SHUNTER_TEST_KEY_METERED",
                      "requests_per_minute": METERED_REQUESTS_PER_MINUTE, "tokens_per_minute": 60_000},
                     {"name": "ledger-a", "key_env": "SHUNTER_TEST_KEY_LEDGER_A", "tokens_per_minute": 100_000},
                     {"name": "ledger-b", "key_env": "SHUNTER_TEST_KEY_LEDGER_B"}],
            "admin_keys": [{"name": "ops", "key_file": str(admin_key_file)}],
        },
    }


_running: dict[str, Any] = {}  # the running keyed app's config, and its secrets folder


def redeploy_batch(**batch: Any) -> None:
    """Deploy the running keyed app again with these `batch` settings changed: its gateways and batch
    service are replaced (their arguments changed), its engines stay."""
    config = _running["args"]
    config = _running["args"] = {**config, "batch": {**config["batch"], **batch}}
    redeploy(config, APP)


def usage_ledger() -> Path:
    """The keyed app's usage ledger (a SQLite file)."""
    return Path(_running["args"]["usage"]["path"])


@contextmanager
def keyed_app(secrets: Path) -> Iterator[str]:
    key_file = secrets / "admin-key"
    key_file.write_text(ADMIN + "\n")
    # ENV is in the environment of the processes Ray starts (as `ray start` in a shell, or a pod's env
    # from a Secret, gives them), not in a runtime_env: tests/e2e/conftest.py sets it before the kept
    # cluster starts.
    missing = [name for name, value in ENV.items() if os.environ.get(name) != value]
    assert not missing, f"set before the cluster starts (tests/e2e/conftest.py): {missing}"
    _running.update(args=args(key_file), secrets=secrets)
    with local_app(_running["args"], APP, keep_cluster=True) as base:
        wait_ready(base)
        yield base


def replica_failures(app: str, model: str = CHAT_MODEL) -> dict[str, int]:
    """Replica failures recorded per replica, the most any gateway answered with (each gateway keeps its
    own breakers; a dozen asks reach both)."""
    seen: dict[str, int] = {}
    for _ in range(12):
        resp = httpx.get(f"{app}/admin/models/{model}/replicas", headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        for row in resp.json()["replicas"]:
            seen[row["replica"]] = max(seen.get(row["replica"], 0), row["failures"])
            assert row["breaker"] == "closed", row
    return seen


def served_chat(app: str, key: str) -> None:
    """A plain chat of `key` is served (another key's requests must not keep it from that)."""
    resp = httpx.post(f"{app}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S,
                      json={"model": CHAT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200, resp.text
