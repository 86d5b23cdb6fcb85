"""The CUDA path, where a GPU machine runs the suite (`make install ENGINE=gpu`): vLLM's Ray executor
inside the replica's placement group, with the same greedy-answer check as the CPU test.

Skipped, with the reason, on machines without enough CUDA devices (tests/conftest.py).
"""

from __future__ import annotations

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


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_split_engine_on_gpus_answers_as_one_gpu_does(gpu_cluster, tp, pp):
    live, tiny = gpu_cluster
    source = tiny if tp > 1 else SMOL  # SmolLM2's 9 heads do not split in two; its 30 layers do
    reference = _answers(live.serve([_gpu_model("m", source)]), "m")
    app = live.serve([_gpu_model("m", source, tp=tp, pp=pp)])
    ready = app.openai().models.list()
    assert [m.id for m in ready.data][:1] == ["m"]
    assert _answers(app, "m") == reference, f"TP {tp} x PP {pp} on GPUs gives one GPU's greedy answers"
    assert len(reference) == len(PROMPTS)
