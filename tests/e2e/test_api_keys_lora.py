"""LoRA adapters of the keyed app's chat model (tests/e2e/keyed_app.py; issue 24, in progress): served by
name through the gateway with the answers vLLM itself gives for the same adapter, more adapters than the
engine runs at once served in turn, a broken adapter refused without taking the replica down, and a key
limited to one adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from .keyed_app import ADAPTER_DIRS, ADAPTERS, BROKEN_ADAPTER, FULL, LEGAL_ONLY, MAX_TOKENS, TIMEOUT_S
from .live import CHAT_MODEL

pytestmark = pytest.mark.own_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = MAX_TOKENS  # the app's limit

# vLLM's own offline engine, with each adapter as a LoRARequest: the reference answers. The same engine
# settings as the app's chat model (bfloat16, eager, max_model_len 1024, rank 8).
_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
base, adapters = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=base, enable_lora=True, max_lora_rank=8, max_loras=1, max_model_len=1024, dtype="bfloat16",
          enforce_eager=True, max_num_seqs=4)
params = SamplingParams(temperature=0, max_tokens=%d)
question = [%s]
answers = {name: llm.chat(question, params, lora_request=LoRARequest(name, i + 1, path))[0].outputs[0].text
           for i, (name, path) in enumerate(adapters.items())}
print("ANSWERS " + json.dumps(answers))
"""


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    from shunter.catalog import resolve_source

    base = resolve_source("builtin:smollm2-135m-instruct", progress=False)
    script = _REFERENCE % (TOKENS, json.dumps(QUESTION[0]))
    out = subprocess.run([sys.executable, "-c", script, base, json.dumps(ADAPTER_DIRS)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ANSWERS ")), None)
    assert line is not None, out.stderr[-2000:]
    return json.loads(line[len("ANSWERS "):])


def ask(app: str, model: str, key: str = FULL) -> httpx.Response:
    return httpx.post(f"{app}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S,
                      json={"model": model, "messages": QUESTION, "max_tokens": TOKENS, "temperature": 0})


def test_adapters_are_listed_with_their_base(app):
    cards = httpx.get(f"{app}/v1/models", headers={"Authorization": f"Bearer {FULL}"}, timeout=TIMEOUT_S).json()
    parents = {card["id"]: card.get("parent") for card in cards["data"]}
    assert all(parents[name] == CHAT_MODEL for name in (*ADAPTERS, BROKEN_ADAPTER)), parents
    assert parents[CHAT_MODEL] is None


def test_each_adapter_answers_as_vllm_itself_does_more_adapters_than_the_engine_holds(app, reference):
    """max_loras is 1 and max_cpu_loras 2: three adapters asked in turn, twice, are loaded and evicted."""
    base = ask(app, CHAT_MODEL).json()["choices"][0]["message"]["content"]
    for round_ in range(2):
        for name in ADAPTERS:
            model = name if round_ == 0 else f"smollm2:{name}"  # by name, then as base:adapter (an alias)
            resp = ask(app, model)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == name
            assert resp.json()["choices"][0]["message"]["content"] == reference[name], (round_, name)
    assert len({base, *reference.values()}) == len(ADAPTERS) + 1, "the adapters answer apart from the base"


def test_a_broken_adapter_is_refused_and_the_replica_keeps_serving(app):
    for _ in range(2):
        resp = ask(app, BROKEN_ADAPTER)
        assert resp.status_code == 422, resp.text
        assert resp.json()["error"]["code"] == "adapter_unavailable" and BROKEN_ADAPTER in resp.json()["error"]["message"]
    assert ask(app, ADAPTERS[0]).status_code == 200 and ask(app, CHAT_MODEL).status_code == 200


def test_a_key_limited_to_one_adapter_gets_403_for_another_and_for_the_base(app):
    assert ask(app, "legal", LEGAL_ONLY).status_code == 200
    for other in ("medical", CHAT_MODEL, f"{CHAT_MODEL}:finance"):
        resp = ask(app, other, LEGAL_ONLY)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "model_not_allowed", (other, resp.text)
    listed = httpx.get(f"{app}/v1/models", headers={"Authorization": f"Bearer {LEGAL_ONLY}"}, timeout=TIMEOUT_S)
    assert [card["id"] for card in listed.json()["data"]] == ["legal"]
