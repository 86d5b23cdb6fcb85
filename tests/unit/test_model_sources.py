"""Model weights in an object store (`source: s3://...` or `gs://...`): the URI checked at the config, the
folder copied once per node into the model cache and served from the copy, replicas copying at once
publishing one copy, and a folder that is no model refused with a reason before any transfer. With vLLM's
streaming loader (`extra_engine_args.load_format: runai_streamer`) the engine reads the store itself.
The store is a real S3 endpoint (moto's server) spoken to by Arrow's S3 client."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from shunter.catalog import ModelSourceError, remote_models_cache, resolve_source
from shunter.config import ConfigError, parse_config
from shunter.object_store import local_copy

pytestmark = pytest.mark.timeout(60)

BUCKET = "shunter-models"
CONFIG = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 9, "num_key_value_heads": 3,
          "num_hidden_layers": 30}
FILES = {"smol/config.json": json.dumps(CONFIG).encode(), "smol/model.safetensors": b"\0" * 65536,
         "smol/tokenizer.json": b"{}", "weights-only/model.safetensors": b"\0" * 16}


@pytest.fixture
def store(s3_endpoint, monkeypatch, tmp_path):
    """The bucket with model `smol` and a folder of weights without a config; the node's credentials
    and endpoint in the environment, as the docs ask; the model cache in tmp_path."""
    import pyarrow.fs as pafs

    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": s3_endpoint, "SHUNTER_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    filesystem, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")
    filesystem.create_dir(BUCKET)
    for path, data in FILES.items():
        with filesystem.open_output_stream(f"{BUCKET}/{path}") as out:
            out.write(data)
    yield f"s3://{BUCKET}", filesystem


def _model(source: str, **engine) -> dict:
    return {"models": [{"name": "m", "source": source, "engine": engine}]}


def test_a_remote_source_is_checked_as_a_uri_and_keeps_credentials_out():
    assert parse_config(_model("s3://bucket/models/smol")).models[0].source == "s3://bucket/models/smol"
    assert parse_config(_model("gs://bucket/smol")).models[0].source == "gs://bucket/smol"
    with pytest.raises(ConfigError, match="credentials do not belong in a model's source"):
        parse_config(_model("s3://AKIA:secret@bucket/smol"))
    with pytest.raises(ConfigError, match="names no bucket and folder"):
        parse_config(_model("s3://bucket"))
    versioned = {"models": [{"name": "m", "versions": [{"name": "v2", "source": "s3://AKIA:x@bucket/smol", "weight": 100}]}]}
    with pytest.raises(ConfigError, match="credentials do not belong"):
        parse_config(versioned)


def test_a_model_is_copied_once_into_the_nodes_cache_and_served_from_there(store, tmp_path):
    root, filesystem = store
    path = Path(resolve_source(f"{root}/smol"))
    assert path == local_copy(f"{root}/smol", remote_models_cache(None))
    assert path.is_relative_to(tmp_path / "cache")
    assert {p.name: p.stat().st_size for p in path.iterdir()} == {
        "config.json": len(FILES["smol/config.json"]), "model.safetensors": 65536, "tokenizer.json": 2}
    # The copy is the node's: the store is not read again (the weights gone there changes nothing here).
    filesystem.delete_file(f"{BUCKET}/smol/model.safetensors")
    assert Path(resolve_source(f"{root}/smol/")) == path
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "no staging folder is left behind"


def test_an_explicit_cache_dir_holds_the_copy(store, tmp_path):
    root, _ = store
    path = Path(resolve_source(f"{root}/smol", cache_dir=tmp_path / "elsewhere"))
    assert path.is_relative_to(tmp_path / "elsewhere") and (path / "config.json").is_file()


def test_replicas_copying_at_once_publish_one_copy(store):
    root, _ = store
    paths, errors = [], []

    def copy() -> None:
        try:
            paths.append(resolve_source(f"{root}/smol"))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=copy) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1, (errors, paths)
    cache = Path(paths[0]).parent
    assert [p.name for p in cache.iterdir()] == [Path(paths[0]).name], "one copy, no staging folders"


@pytest.mark.parametrize("folder", ["weights-only", "missing"])
def test_a_folder_that_is_no_model_is_refused_before_any_transfer(store, folder):
    root, _ = store
    with pytest.raises(ModelSourceError, match=f"{root}/{folder} holds no config.json"):
        resolve_source(f"{root}/{folder}")
    assert not local_copy(f"{root}/{folder}", remote_models_cache(None)).exists()


def test_an_unreachable_store_is_a_clear_error(monkeypatch, tmp_path):
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "SHUNTER_CACHE_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(ModelSourceError, match="cannot read s3://nowhere/smol/config.json"):
        resolve_source("s3://nowhere/smol")


def test_the_streaming_loader_reads_the_store_itself(store, tmp_path):
    """vLLM's Run:ai streamer loads safetensors straight from the store: nothing is copied."""
    root, _ = store
    assert resolve_source(f"{root}/smol", load_format="runai_streamer") == f"{root}/smol"
    assert resolve_source(f"{root}/smol", load_format="runai_streamer_sharded") == f"{root}/smol"
    assert not (tmp_path / "cache").exists()


def test_planning_reads_a_remote_models_shape_from_the_nodes_copy_never_the_store(store):
    from shunter.model_shape import model_shape

    root, _ = store
    assert model_shape(f"{root}/smol") is None, "not copied here yet: left to the engine, the store not read"
    resolve_source(f"{root}/smol")
    shape = model_shape(f"{root}/smol")
    assert shape is not None and (shape.attention_heads, shape.kv_heads, shape.layers) == (9, 3, 30), shape
