"""Real parallel execution on CPU: tensor parallelism 2 and pipeline parallelism 2 through the gateway,
checked against the same model served with one rank (greedy decoding must give the same tokens).

- TP=2 needs a model whose heads split in two; the builtin SmolLM2 has 9. The test makes one: random
  weights in float32 (so both splits compute the same sums), 4 heads and 2 KV heads, with the builtin
  SmolLM2 tokenizer and chat template.
- PP=2 splits the same model into two stages of 2 layers (the CPU engine needs compile mode for it; the
  platform chooses that itself). Everything runs in float32, so only the split differs from the reference.
  (SmolLM2's 30 layers split the same way; compiling them twice, for the stages and a compiled reference,
  cost the suite a minute and checked nothing more.)

Each app takes both cores of this machine, so they run one after another on a cluster of their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from shunter.local_serve import free_port, local_cluster_env

from .live import LiveApp, wait_ready

pytestmark = pytest.mark.own_cluster

APP = "parallel"
SMOL = "builtin:smollm2-135m-instruct"
PROMPTS = ["Name three rivers of Europe.", "def fibonacci(n):"]
MAX_TOKENS = 24


def make_tiny_model(out: Path) -> Path:
    """A 4-layer Llama with random weights and SmolLM2's tokenizer: 4 attention heads, 2 KV heads."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from shunter.catalog import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_source(SMOL, progress=False))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # Wide weights make the next-token choice clear-cut, so rounding never decides it.
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def reference_answers(model_dir: str) -> list[str]:
    """Greedy answers of the model in one process, by transformers, in float32: what every split must say.
    (A one-rank vLLM engine said the same, and cost the module a minute to start.)"""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def _model(name: str, source: str, cores: int, tp: int = 1, pp: int = 1, **engine) -> dict:
    # float32: a split changes the order of sums; in bfloat16 that can flip a near-tie a dozen tokens in.
    return {"name": name, "source": source, "cpu_cores_per_replica": cores,
            "engine": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "cpu_kv_cache_gib": 1,
                       "tensor_parallel_size": tp, "pipeline_parallel_size": pp, **engine}}


class Cluster:
    """One Ray cluster for the module; `serve(models)` replaces the app and waits for it."""

    def __init__(self, gpus: bool = False) -> None:
        import ray
        from ray import serve

        # On a GPU machine Ray finds the GPUs itself; the CPU tests keep to this machine's two cores.
        os.environ.update(local_cluster_env())
        ray.init(include_dashboard=False, log_to_driver=False, **({} if gpus else {"num_cpus": 2}))
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except BaseException:
            self.close()
            raise
        self.app = LiveApp(f"http://127.0.0.1:{port}")

    def serve(self, models: list[dict]) -> LiveApp:
        from ray import serve

        from shunter.deployments.app import build_app

        serve.delete(APP)  # frees the cores before the next app claims them
        serve.run(build_app({"models": models}), name=APP, route_prefix="/")
        wait_ready(self.app.base_url)
        return self.app

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(exclusive_machine, tmp_path_factory) -> Iterator[tuple[Cluster, str, dict[str, list[str]]]]:
    tiny = str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama")))
    reference = reference_answers(tiny)
    live = Cluster()
    try:
        yield live, tiny, reference
    finally:
        live.close()


def _answers(app: LiveApp, model: str, stream: bool = False) -> list[str]:
    client = app.openai()
    answers = []
    for prompt in PROMPTS:
        kwargs = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                  "temperature": 0}
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            answers.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            answers.append(client.chat.completions.create(**kwargs).choices[0].message.content)
    return answers


def _engine_processes(app: LiveApp, model: str) -> list[psutil.Process]:
    """The model's engine processes as its replica names them (/ready: forked by the node's fork server,
    they are not the replica's children)."""
    pids = httpx.get(f"{app.base_url}/ready", timeout=60).json()["models"][model]["engine_pids"]
    return [psutil.Process(pid) for pid in pids]


def _engine_ranks(app: LiveApp, model: str) -> list[str]:
    """The processes running the model's engine ranks: the children of its engine-core process (the engine
    process whose parent is not one of them), resource trackers aside. Not by process title: vLLM's worker
    titles were missing in some runs on this machine."""
    procs = _engine_processes(app, model)
    pids = {proc.pid for proc in procs}
    ranks = []
    for core in (proc for proc in procs if proc.ppid() not in pids):
        for proc in core.children():
            line = " ".join(proc.cmdline())
            if "resource_tracker" not in line:
                ranks.append(line[:120])
    return ranks


def _engine_niceness(app: LiveApp, model: str) -> set[int]:
    # Niceness is per thread on Linux: every thread of the engine's processes.
    return {os.getpriority(os.PRIO_PROCESS, thread.id)
            for proc in _engine_processes(app, model) for thread in proc.threads()}


def test_tensor_parallel_2_answers_as_one_rank_does(cluster):
    live, tiny, reference = cluster
    assert all(reference), "the random model says something (greedy, 24 tokens)"
    app = live.serve([_model("tiny", tiny, 2, tp=2)])
    ranks = _engine_ranks(app, "tiny")
    assert len(ranks) == 2, f"two TP ranks run: {ranks}"
    assert _engine_niceness(app, "tiny") == {19}, "the engine yields to the platform (engine.cpu_nice)"
    assert _answers(app, "tiny") == reference
    assert _answers(app, "tiny", stream=True) == reference, "streamed through the gateway too"


def test_pipeline_parallel_2_answers_as_one_rank_does(cluster):
    live, tiny, reference = cluster
    app = live.serve([_model("tiny", tiny, 2, pp=2)])
    ranks = _engine_ranks(app, "tiny")
    assert len(ranks) == 2, f"two pipeline stages run: {ranks}"
    assert _answers(app, "tiny") == reference
    assert _answers(app, "tiny", stream=True) == reference, "streamed too"


def test_a_split_the_model_cannot_take_is_refused_before_anything_starts(cluster):
    from shunter.config import ConfigError
    from shunter.deployments.app import build_app

    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 does not divide the model's 9 attention heads"):
        build_app({"models": [_model("smol", SMOL, 2, tp=2)]})
