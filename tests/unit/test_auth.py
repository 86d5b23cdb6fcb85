"""API keys: reading them from their sources, the digests they are kept as, constant-time lookup, the
door's answers (401, 403) and the per-request limits (400). No Ray, no engine."""

from __future__ import annotations

import pytest

from shunter.auth import (
    ANONYMOUS,
    KeyRing,
    KeySourceError,
    bearer_token,
    cache_salt,
    digest,
    key_id,
    new_key,
    read_key,
)
from shunter.config import ConfigError, KeySourceConfig, parse_config
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.parsed_request import parse
from shunter.endpoints import ENDPOINTS
from shunter.errors import ApiError
from shunter.routing.prefix import prefix_key, render_prompt

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"
ADMIN = "sk-admin-0123456789abcdef"
ENV = {"KEY_A": KEY_A, "KEY_B": KEY_B, "ADMIN_KEY": ADMIN}


def config(auth: dict | None = None, limits: dict | None = None):
    return parse_config({
        "models": [{"name": "chat", "aliases": ["small"], "source": "builtin:smollm2-135m-instruct"},
                   {"name": "embed", "source": "builtin:all-minilm-l6-v2", "task": "embed"}],
        "auth": auth or {}, "gateway": {"limits": limits or {}}})


def guarded(**extra) -> AccessControl:
    return AccessControl(config({
        "keys": [{"name": "team-a", "key_env": "KEY_A", "models": ["small"], **extra},
                 {"name": "team-b", "key_env": "KEY_B"}],
        "admin_keys": [{"name": "ops", "key_env": "ADMIN_KEY"}]}), environ=ENV)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def refusal(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        fn(*args)
    return caught.value


# ---- config: keys never inline ---------------------------------------------------------------------

@pytest.mark.parametrize("field", ["key", "api_key", "token"])
def test_a_key_written_in_the_config_is_refused_and_not_echoed(field):
    with pytest.raises(ConfigError) as caught:
        config({"keys": [{"name": "t", field: KEY_A}]})
    assert "key_env" in str(caught.value) and KEY_A not in str(caught.value)


def test_a_key_pasted_where_its_variable_name_goes_is_not_echoed():
    with pytest.raises(ConfigError) as caught:
        config({"keys": [{"name": "t", "key_env": "sk-abc-123"}]})
    assert "key_env" in str(caught.value) and "sk-abc-123" not in str(caught.value)


@pytest.mark.parametrize("auth, words", [
    ({"keys": [{"name": "t"}]}, "exactly one of"),
    ({"keys": [{"name": "t", "key_env": "A", "key_file": "/k"}]}, "exactly one of"),
    ({"keys": [{"name": "t", "key_env": "A", "models": ["nope"]}]}, "not served models"),
    ({"keys": [{"name": "t", "key_env": "A"}], "admin_keys": [{"name": "t", "key_env": "B"}]}, "repeat"),
    ({"keys": [{"name": "t", "key_env": "A", "tokens_per_minute": 0}]}, "tokens_per_minute"),
])
def test_bad_auth_sections_name_the_problem(auth, words):
    with pytest.raises(ConfigError, match=words):
        config(auth)


# ---- reading keys ------------------------------------------------------------------------------------

def test_keys_come_from_environment_variables_and_files(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"  {KEY_B}\n")
    assert read_key(KeySourceConfig(name="a", key_env="KEY_A"), ENV) == KEY_A
    assert read_key(KeySourceConfig(name="b", key_file=str(path)), {}) == KEY_B


@pytest.mark.parametrize("source, environ, words", [
    ({"key_env": "UNSET"}, {}, r"\$UNSET is not set"),
    ({"key_file": "/no/such/file"}, {}, "cannot read /no/such/file"),
    ({"key_env": "SHORT"}, {"SHORT": "abc"}, "at least 16"),
    ({"key_env": "SPACE"}, {"SPACE": "sk-0123456789 abcdef"}, "whitespace"),
])
def test_unusable_keys_stop_the_gateway_with_the_source_named(source, environ, words):
    with pytest.raises(KeySourceError, match=words) as caught:
        read_key(KeySourceConfig(name="k", **source), environ)
    assert "'k'" in str(caught.value)
    for value in environ.values():
        assert value not in str(caught.value)


def test_every_unreadable_key_is_listed_at_once_and_a_shared_key_is_refused():
    cfg = config({"keys": [{"name": "a", "key_env": "NOPE1"}, {"name": "b", "key_env": "NOPE2"}]})
    with pytest.raises(KeySourceError, match=r"NOPE1.*NOPE2"):
        KeyRing.load(cfg.auth, str, {})
    cfg = config({"keys": [{"name": "a", "key_env": "KEY_A"}], "admin_keys": [{"name": "b", "key_env": "SAME"}]})
    with pytest.raises(KeySourceError, match="same key"):
        KeyRing.load(cfg.auth, str, {"KEY_A": KEY_A, "SAME": KEY_A})


def test_the_ring_keeps_digests_only_and_finds_the_caller():
    ring = guarded().ring
    assert all(len(d) == 32 for d, _ in ring.entries)
    assert KEY_A not in repr(ring) and KEY_A.encode() not in b"".join(d for d, _ in ring.entries)
    assert ring.identify(KEY_A).name == "team-a"
    assert ring.identify(ADMIN).admin
    assert ring.identify(KEY_A + "x") is None and ring.identify("") is None
    assert ring.identify(KEY_A).key_id == key_id(KEY_A) == digest(KEY_A).hex()[:12]


def test_new_keys_are_long_random_and_usable():
    one, two = new_key(), new_key()
    assert one != two and len(one) >= 40
    assert read_key(KeySourceConfig(name="n", key_env="K"), {"K": one}) == one


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("BEARER abc", "abc"),
    (None, None), ("", None), ("Basic abc", None), ("Bearer", None), ("Bearer ", None), ("abc", None),
])
def test_bearer_tokens(header, token):
    assert bearer_token(header) == token


# ---- the door -------------------------------------------------------------------------------------------

def test_without_keys_everyone_gets_in_and_the_gateway_says_so(caplog):
    with caplog.at_level("WARNING", logger="ray.serve"):
        door = AccessControl(config(), environ={})
    assert "NO API KEYS ARE CONFIGURED" in caplog.text
    assert door.client({}).name == "anonymous" and door.admin({}).name == "anonymous"


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"authorization": "Basic abc"}, "invalid_api_key"),
    (bearer("sk-wrong-0123456789abcdef"), "invalid_api_key"),
])
def test_missing_or_wrong_keys_get_401(headers, code):
    error = refusal(guarded().client, headers)
    assert (error.status, error.code) == (401, code)
    assert error.headers["WWW-Authenticate"] == "Bearer"
    assert error.body()["error"]["type"] == "authentication_error"


def test_a_key_restricted_to_one_model_gets_403_on_the_others():
    door = guarded()
    caller = door.client(bearer(KEY_A))
    door.check_model(caller, "chat")  # allowed through its alias
    error = refusal(door.check_model, caller, "embed")
    assert (error.status, error.code, error.param) == (403, "model_not_allowed", "model")
    door.check_model(door.client(bearer(KEY_B)), "embed")  # an unrestricted key


def test_admin_needs_an_admin_key_and_client_keys_stay_out_of_admin():
    door = guarded()
    assert door.admin(bearer(ADMIN)).name == "ops"
    assert refusal(door.admin, {}).status == 401
    assert refusal(door.admin, bearer(KEY_B)).code == "admin_key_required"
    assert refusal(door.client, bearer(ADMIN)).code == "client_key_required"


def test_with_client_keys_but_no_admin_key_admin_is_closed_to_everyone():
    door = AccessControl(config({"keys": [{"name": "a", "key_env": "KEY_A"}]}), environ=ENV)
    assert refusal(door.admin, {}).status == 401
    assert refusal(door.admin, bearer(KEY_A)).status == 403


# ---- per-request limits --------------------------------------------------------------------------------

USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("endpoint, body, param, code", [
    ("chat", {"messages": [USER] * 4}, "messages", "too_many_messages"),
    ("chat", {"messages": [USER], "n": 3}, "n", "n_too_large"),
    ("chat", {"messages": [USER], "n": "8"}, "n", "n_too_large"),  # vLLM would make 8 of the string
    ("chat", {"messages": [USER], "n": 8.0}, "n", "n_too_large"),
    ("completion", {"prompt": "x", "n": "3"}, "n", "n_too_large"),
    ("chat", {"messages": [USER], "max_tokens": 33}, "max_tokens", "max_tokens_too_large"),
    ("chat", {"messages": [USER], "max_tokens": "500"}, "max_tokens", "max_tokens_too_large"),
    ("completion", {"prompt": "x", "max_tokens": 33.0}, "max_tokens", "max_tokens_too_large"),
    ("chat", {"messages": [USER], "max_completion_tokens": 33}, "max_completion_tokens", "max_tokens_too_large"),
    ("embedding", {"input": ["a", "b", "c", "d"]}, "input", "too_many_inputs"),
    ("embedding", {"input": [[1], [2], [3], [4]]}, "input", "too_many_inputs"),  # token-id inputs count too
    ("completion", {"prompt": ["a", "b", "c", "d"]}, "prompt", "too_many_inputs"),
])
def test_requests_past_a_limit_get_400_naming_the_field(endpoint, body, param, code):
    door = AccessControl(config(limits={"max_messages": 3, "max_n": 2, "max_tokens": 32, "max_embedding_inputs": 3,
                                        "max_completion_prompts": 3}), environ={})
    error = refusal(door.check_limits, parse(ENDPOINTS[endpoint], body))
    assert (error.status, error.param, error.code) == (400, param, code)


def test_requests_within_limits_pass_and_malformed_ones_are_400s_naming_the_field():
    door = AccessControl(config(limits={"max_messages": 3, "max_n": 2, "max_tokens": 32}), environ={})
    door.check_limits(parse(ENDPOINTS["chat"], {"messages": [USER] * 3, "n": "2", "max_tokens": 32.0}))
    door.check_limits(parse(ENDPOINTS["embedding"], {"input": "x"}))
    for endpoint, body, param in [("chat", {"messages": "not a list"}, "messages"),
                                  ("chat", {"messages": [USER], "n": 2.5}, "n"),
                                  ("completion", {"prompt": "x", "max_tokens": "lots"}, "max_tokens")]:
        error = refusal(parse, ENDPOINTS[endpoint], body)
        assert error.status == 400 and error.param and error.param.startswith(param), (body, error.param)


# ---- the CLI -------------------------------------------------------------------------------------------

def test_config_check_refuses_a_key_set_in_the_apps_runtime_env(tmp_path):
    import textwrap

    from shunter.cli import main as cli_main

    path = tmp_path / "keys.yaml"
    path.write_text(textwrap.dedent(f"""
        applications:
          - name: x
            import_path: shunter.deployments.app:build_app
            runtime_env: {{env_vars: {{TEAM_KEY: {KEY_A}}}}}
            args:
              models: [{{name: m, source: "builtin:smollm2-135m-instruct"}}]
              auth: {{keys: [{{name: team, key_env: TEAM_KEY}}]}}
    """))
    with pytest.raises(SystemExit) as caught:
        cli_main(["config", "check", str(path)])
    assert "TEAM_KEY" in str(caught.value) and "runtime-env agent log" in str(caught.value)
    assert KEY_A not in str(caught.value)


def test_keys_new_and_id(capsys, monkeypatch):
    import io

    from shunter.cli import main as cli_main

    assert cli_main(["keys", "new"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("sk-shunter-") and key_id(key) in err
    monkeypatch.setattr("sys.stdin", io.StringIO(key + "\n"))
    assert cli_main(["keys", "id"]) == 0
    assert capsys.readouterr().out.strip() == key_id(key)


# ---- prompt caches per tenant ------------------------------------------------------------------------

def test_each_key_gets_its_own_prompt_cache_salt_and_a_cache_group_shares_one():
    door = AccessControl(config({"keys": [{"name": "team-a", "key_env": "KEY_A", "cache_group": "org"},
                                          {"name": "team-b", "key_env": "KEY_B", "cache_group": "org"},
                                          {"name": "solo", "key_env": "ADMIN_KEY"}]}), environ=ENV)
    a, b, solo = (door.client(bearer(k)) for k in (KEY_A, KEY_B, ADMIN))
    assert cache_salt(a) == cache_salt(b) != cache_salt(solo)
    assert cache_salt(a, "mine") not in (cache_salt(a), cache_salt(solo, "mine")), "a client salt splits, never joins"
    salt = cache_salt(solo)
    assert salt is not None and len(salt) <= 128 and salt.isalnum(), "what vLLM's cache_salt takes"
    assert ADMIN not in salt and cache_salt(ANONYMOUS, "theirs") is None, "no keys: the client's own salt stands"


def test_the_router_keys_a_salted_prompt_apart():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    keys = {salt: prefix_key(render_prompt("chat", {**body, "cache_salt": salt} if salt else body), 16).keys
            for salt in (None, "a", "b")}
    assert not set(keys[None]) & set(keys["a"]) and not set(keys["a"]) & set(keys["b"])
