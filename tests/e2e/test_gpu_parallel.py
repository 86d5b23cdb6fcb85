"""The CUDA path, where a GPU machine runs the suite (`make install ENGINE=gpu`): vLLM's Ray executor
inside the replica's placement group, with the same greedy-answer check as the CPU test.

Skipped, with the reason, on machines without enough CUDA devices (tests/conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from .test_parallel import PROMPTS, SMOL, Cluster, _answers, make_tiny_model

pytestmark = [pytest.mark.own_cluster, pytest.mark.gpu(devices=2)]


def _gpu_model(name: str, source: str, tp: int = 1, pp: int = 1) -> dict:
    return {"name": name, "source": source, "accelerator": "gpu",
            "engine": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "gpu_memory_utilization": 0.3,
                       "tensor_parallel_size": tp, "pipeline_parallel_size": pp}}


@pytest.fixture(scope="module")
def gpu_cluster(exclusive_machine, tmp_path_factory) -> Iterator[tuple[Cluster, str]]:
    live = Cluster(gpus=True)
    try:
        yield live, str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama")))
    finally:
        live.close()


def _gpus_reserved(expected: int, timeout_s: float = 60) -> float:
    """The cluster's GPUs held by actors and placement groups, once it is `expected` (the last app's
    groups are removed a moment after `serve.delete` returns): what the serving app reserved."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        held = ray.cluster_resources().get("GPU", 0) - ray.available_resources().get("GPU", 0)
        if held == expected or time.monotonic() > deadline:
            return held
        time.sleep(1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_split_engine_on_gpus_answers_as_one_gpu_does(gpu_cluster, tp, pp):
    live, tiny = gpu_cluster
    source = tiny if tp > 1 else SMOL  # SmolLM2's 9 heads do not split in two; its 30 layers do
    reference = _answers(live.serve([_gpu_model("m", source)]), "m")
    # Greedy answers of both prompts, each saying something: equal lists below are a real comparison.
    assert len(reference) == len(PROMPTS) and all(answer.strip() for answer in reference), reference
    assert _gpus_reserved(1) == 1, "the reference engine runs on one GPU"
    app = live.serve([_gpu_model("m", source, tp=tp, pp=pp)])
    assert _gpus_reserved(tp * pp) == tp * pp, f"TP {tp} x PP {pp} runs on {tp * pp} GPUs"
    ready = app.openai().models.list()
    assert [m.id for m in ready.data][:1] == ["m"]
    assert _answers(app, "m") == reference, f"TP {tp} x PP {pp} on GPUs gives one GPU's greedy answers"
