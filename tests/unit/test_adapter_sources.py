"""Adapters in an object store: URIs checked at the config, fetched once per node into the cache, served
from the copy; a missing or unreadable source is the request's 422 (the replica's) or the admin call's
400, never a crash. The store is a real S3 endpoint (moto's server) spoken to by Arrow's S3 client."""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from shunter.config.adapters import AdapterConfig
from shunter.engine_lora import AdapterUnavailable, EngineAdapters
from shunter.lora_sources import AdapterSourceError, fetch, local_copy, remote_adapter_config

pytestmark = pytest.mark.timeout(60)

BUCKET = "shunter-adapters"


@pytest.fixture
def store(s3_endpoint, monkeypatch, tmp_path):
    """The bucket, with adapter `tune` (a config and a weights file) and a folder that is no adapter; the
    node's credentials and endpoint in the environment, as the docs ask; the cache in tmp_path."""
    import pyarrow.fs as pafs

    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": s3_endpoint, "SHUNTER_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    filesystem, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")
    filesystem.create_dir(BUCKET)
    for path, data in {"tune/adapter_config.json": json.dumps({"r": 8}).encode(),
                       "tune/adapter_model.safetensors": b"\0" * 4096,
                       "not-an-adapter/readme.txt": b"hello"}.items():
        with filesystem.open_output_stream(f"{BUCKET}/{path}") as out:
            out.write(data)
    return f"s3://{BUCKET}"


def test_a_remote_source_is_checked_as_a_uri_and_keeps_credentials_out():
    assert AdapterConfig(name="t", source="s3://bucket/folder/tune").source == "s3://bucket/folder/tune"
    assert AdapterConfig(name="t", source="gs://bucket/tune").rank() is None, "read where it is fetched"
    with pytest.raises(ValidationError, match="credentials do not belong"):
        AdapterConfig(name="t", source="s3://AKIA:secret@bucket/tune")
    with pytest.raises(ValidationError, match="names no bucket and folder"):
        AdapterConfig(name="t", source="s3://bucket")


def test_an_adapter_is_fetched_once_into_the_nodes_cache(store):
    local = fetch(f"{store}/tune")
    assert local == str(local_copy(f"{store}/tune"))
    files = {p.name: p.stat().st_size for p in local_copy(f"{store}/tune").iterdir()}
    assert files == {"adapter_config.json": 8, "adapter_model.safetensors": 4096}
    assert fetch(f"{store}/tune/") == local or fetch(f"{store}/tune") == local
    assert remote_adapter_config(f"{store}/tune") == {"r": 8}
    assert not [p for p in local_copy(f"{store}/tune").parent.iterdir() if p.name.startswith(".")], \
        "no staging folder is left behind"


@pytest.mark.parametrize("folder, why", [("missing", "holds no adapter_config.json"),
                                         ("not-an-adapter", "holds no adapter_config.json")])
def test_a_source_that_is_no_adapter_says_so(store, folder, why):
    with pytest.raises(AdapterSourceError, match=why):
        fetch(f"{store}/{folder}")
    assert not local_copy(f"{store}/{folder}").exists()


class LoadingEngine:
    """Stands in for vLLM's AsyncLLM's add_lora, recording the paths it was asked to load (the real
    engine loads real adapters in tests/e2e/test_routing_adapters.py)."""

    def __init__(self):
        self.paths: list[str] = []

    async def add_lora(self, request) -> bool:
        self.paths.append(request.lora_path)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True


def test_a_replica_serves_a_remote_adapter_from_its_nodes_copy(store):
    async def run():
        counter = itertools.count(1)
        models = SimpleNamespace(lora_requests={}, lora_id_counter=SimpleNamespace(inc=lambda _: next(counter)))
        engine = LoadingEngine()
        adapters = EngineAdapters(engine, models, "base", 2, [("tune", f"{store}/tune"), ("gone", f"{store}/missing")])
        await asyncio.gather(adapters.ready("tune"), adapters.ready("tune"))  # one fetch, one load
        assert engine.paths == [str(local_copy(f"{store}/tune"))]
        assert models.lora_requests["tune"].lora_path == engine.paths[0], "vLLM reloads from the copy"
        with pytest.raises(AdapterUnavailable) as refused:
            await adapters.ready("gone")
        error = refused.value.body["error"]
        assert error["code"] == "adapter_unavailable" and "holds no adapter_config.json" in error["message"]
        assert adapters.held() == ["tune"]

    asyncio.run(run())
