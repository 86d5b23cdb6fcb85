"""Model versions: the config form, one deployment per version, the live/retired switch of the
autoscaling policy, and the control state's views and gate windows. No cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shunter.config import ConfigError, parse_config
from shunter.ops import autoscaling
from shunter.ops.control import Sample, _short, model_view, window_stats
from shunter.serve_plan import ClusterView, deployment_name, plan_deployments

SMOL = "builtin:smollm2-135m-instruct"
VERSIONED = {"name": "smol", "engine": {"max_num_seqs": 8, "cpu_kv_cache_gib": 2},
             "versions": [{"name": "v1", "source": SMOL, "weight": 100},
                          {"name": "v2", "source": SMOL, "engine": {"max_num_seqs": 16}}]}
CPU2 = ClusterView(has_gpus=False, largest_node_cpus=2)


def _error(model: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [model]})
    return str(err.value)


def test_versions_refine_the_model_engine_and_resolve_one_by_one():
    model = parse_config({"models": [VERSIONED]}).models[0]
    assert model.versioned and model.version_names() == ["v1", "v2"]
    assert model.file_weights() == [("v1", 100.0), ("v2", 0.0)]
    v2 = model.for_version("v2")
    assert v2.source == SMOL and not v2.versions
    assert (v2.engine.max_num_seqs, v2.engine.cpu_kv_cache_gib) == (16, 2), "v2 sets one key, inherits the rest"
    assert model.for_version("v1").engine.max_num_seqs == 8
    with pytest.raises(KeyError, match="has no version 'v9'"):
        model.for_version("v9")
    again = parse_config({"models": [model.model_dump(mode="json")]}).models[0]
    assert again.fingerprint == model.fingerprint, "a dumped config validates to the same versions"


def test_the_single_source_form_is_one_version():
    model = parse_config({"models": [{"name": "smol", "source": SMOL}]}).models[0]
    assert not model.versioned and model.version_names() == ["default"]
    assert model.file_weights() == [("default", 100.0)] and model.for_version("default") is model


@pytest.mark.parametrize("change, message", [
    ({"source": SMOL}, "either `source`"),
    ({"versions": [{"name": "v1", "source": SMOL}]}, "no version has a traffic weight"),
    ({"versions": [{"name": "v1", "source": SMOL, "weight": 1}, {"name": "v1", "source": SMOL}]}, "repeat"),
    ({"versions": [{"name": "bad name", "source": SMOL, "weight": 1}]}, "versions[0].name"),
    ({"versions": [{"name": "v1", "source": "builtin:nope", "weight": 1}]}, "versions[0].source"),
    ({"rollout": {"steps": [10, 50]}}, "end at 100"),
    ({"rollout": {"hold_s": 60, "max_hold_s": 10}}, "max_hold_s"),
])
def test_bad_versions_are_explained(change, message):
    assert message in _error({**VERSIONED, **change})


def test_the_fingerprint_follows_what_the_file_says_about_versions():
    base = parse_config({"models": [VERSIONED]}).models[0].fingerprint
    reweighted = {**VERSIONED, "versions": [{**VERSIONED["versions"][0], "weight": 50},
                                            {**VERSIONED["versions"][1], "weight": 50}]}
    assert parse_config({"models": [reweighted]}).models[0].fingerprint != base
    scaled = {**VERSIONED, "max_ongoing_requests": 8}
    assert parse_config({"models": [scaled]}).models[0].fingerprint == base, "not about versions"


def test_every_version_is_a_deployment_that_starts_only_if_it_has_traffic():
    cfg = parse_config({"models": [{**VERSIONED, "replicas": 1}]})
    plans = plan_deployments(cfg, CPU2)["smol"]
    assert {v: p["deployment"]["name"] for v, p in plans.items()} == {"v1": "model-smol--v1", "v2": "model-smol--v2"}
    assert deployment_name(cfg.models[0], "v2") == "model-smol--v2"
    for version, first in (("v1", 1), ("v2", 0)):
        scaling = plans[version]["deployment"]["autoscaling_config"]
        assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (0, 1, first)
        kwargs = scaling["policy"]["policy_kwargs"]
        assert (kwargs["min_replicas"], kwargs["max_replicas"]) == (1, 1), "a fixed count, held while live"
        assert kwargs["versioning"] == {"model": "smol", "version": version, "fingerprint": cfg.models[0].fingerprint,
                                        "live_at_start": version == "v1"}
    assert [p["cpu_cores"] for p in plans.values()] == [1, 1], "cores for the old and the new side by side"


def _ctx(target: int, running: int) -> SimpleNamespace:
    return SimpleNamespace(current_time=100.0, target_num_replicas=target, current_num_replicas=running,
                           aggregated_metrics={}, total_queued_requests=0, total_num_requests=0, policy_state={},
                           app_name="app")


def test_the_policy_holds_a_retired_version_at_zero_and_scales_a_live_one(monkeypatch):
    state: dict = {}
    monkeypatch.setattr("shunter.ops.control.read_state", lambda app: state)
    versioning = {"model": "smol", "version": "v2", "fingerprint": "f1", "live_at_start": False}
    policy = autoscaling.QueueDepthPolicy(model="smol", versioning=versioning, min_replicas=1, max_replicas=1,
                                          target_per_replica=1.0, upscale_delay_s=0, downscale_delay_s=0)
    assert policy(_ctx(0, 0))[0] == 0, "not live per the file, nothing saved: stays at zero"
    state["models"] = {"smol": {"fingerprint": "f1", "weights": [["v2", 0], ["v1", 100]], "live": ["v1", "v2"]}}
    policy._live = None  # past the cache's second
    assert policy(_ctx(0, 0))[0] == 1, "a rollout made it live: it starts"
    state["models"]["smol"]["live"] = ["v1"]
    policy._live = None
    assert policy(_ctx(1, 1)) == (0, {"reason": "version retired"})
    state["models"]["smol"]["fingerprint"] = "f0"  # written for another config: the file rules
    policy._live = None
    assert policy(_ctx(1, 1))[0] == 0


def test_views_and_windows():
    file_weights = [("v1", 100.0), ("v2", 0.0)]
    assert model_view({}, "m", "f", file_weights).live == {"v1"}
    saved = {"models": {"m": {"fingerprint": "f", "weights": [["v2", 10], ["v1", 90]], "live": ["v1", "v2"]}}}
    assert model_view(saved, "m", "f", file_weights).weights == (("v2", 10.0), ("v1", 90.0))
    samples = [Sample("v2", 5.0, True, 0.1, 1.0), Sample("v2", 15.0, False, None, None),
               Sample("v2", 16.0, True, None, 2.0), Sample("v1", 16.0, True, 0.2, 0.5)]
    stats = window_stats(samples, "v2", since=10.0)
    assert (stats.requests, stats.errors, stats.ttft_p95_s, stats.e2e_p95_s) == (2, 1, None, 2.0)
    assert _short("The deployment failed.\nTraceback:\n  File x\nRuntimeError: boom") == \
        "The deployment failed. ... RuntimeError: boom"


def test_models_prepare_prepares_every_versions_own_builtin_source(monkeypatch, tmp_path, capsys):
    """`make serve` runs `shunter models prepare`: a model with `versions:` has no `source` of its own."""
    from shunter import catalog
    from shunter.cli import main as shunter

    config = tmp_path / "versioned.yaml"
    config.write_text("applications:\n- name: s\n  import_path: shunter.deployments.app:build_app\n  args:\n    models:\n"
                      "    - name: smol\n      versions:\n"
                      f"      - {{name: v1, source: '{SMOL}', weight: 100}}\n"
                      f"      - {{name: v2, source: '{SMOL}'}}\n"
                      "      - {name: v3, source: /models/smol-v3}\n"
                      "    - {name: plain, source: 'builtin:all-minilm-l6-v2', task: embed}\n")
    prepared: list[str] = []
    monkeypatch.setattr(catalog, "resolve_source", lambda source, cache_dir=None: prepared.append(source) or
                        f"/cache/{source}")
    assert shunter(["models", "prepare", str(config)]) == 0
    assert prepared == [SMOL, SMOL, "builtin:all-minilm-l6-v2"], "each builtin version, not the local dir"
    out = capsys.readouterr().out
    assert f"smol version v1: {SMOL} -> /cache/{SMOL}" in out and "smol version v2:" in out
    assert "plain: builtin:all-minilm-l6-v2" in out and "v3" not in out
