"""`auth:`: API keys, admin keys and per-key quotas; keys come from the environment or a file, never inline."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from shunter.config.base import StrictModel

KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


_INLINE_KEY_FIELDS = ("key", "api_key", "secret", "token", "value")


class KeySourceConfig(StrictModel):
    """Where one key is read from when the gateway starts: an environment variable or a file (a mounted
    Kubernetes Secret, a Docker secret). Never the key itself: config files get committed."""

    name: str = Field(
        pattern=KEY_NAME_PATTERN,
        description="The key's name: who holds it (team-search, ci). Shown in logs and metrics beside the "
        "key's hashed id; never the key.",
    )
    key_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable of the gateway's process that holds the key.",
    )
    key_file: str | None = Field(
        default=None, description="File that holds the key (surrounding whitespace is ignored)."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for field in _INLINE_KEY_FIELDS:
                if field in data:
                    raise ValueError(
                        f"`{field}:` would put a key in the config file; keys are never written in a config "
                        "(config files get committed). Put the key in an environment variable and name it "
                        "with `key_env:`, or in a file named with `key_file:`")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> KeySourceConfig:
        if (self.key_env is None) == (self.key_file is None):
            raise ValueError(f"key {self.name!r}: give exactly one of `key_env` (an environment variable) or "
                             "`key_file` (a file) to read the key from")
        return self

    @property
    def source(self) -> str:
        """Where the key comes from, for messages (never the key)."""
        return f"${self.key_env}" if self.key_env else f"file {self.key_file}"


class ApiKeyConfig(KeySourceConfig):
    """One client key: which models it may use and its budget."""

    models: list[str] = Field(
        default_factory=list,
        description="Models (names or aliases) this key may use; empty = every model. LoRA adapters are named "
        "like models (`<adapter>` or `<model>:<adapter>`); `<model>:*` allows every adapter of a model, those "
        "added through the admin API too (the model itself only if listed). /v1/models lists only these to "
        "the key; others answer 403. With `tokens_per_minute`, a key limited to one adapter is that "
        "adapter's quota.",
    )
    requests_per_minute: int | None = Field(
        default=None, ge=1, description="Requests per minute this key may send; null = unlimited."
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1,
        description="Prompt plus completion tokens per minute; null = unlimited. A request reserves its "
        "prompt estimate plus its max_tokens and is settled at its real usage when it ends.",
    )
    priority_class: str | None = Field(
        default=None,
        description="The priority class (flow_control.classes) of this key's requests that ask for none; "
        "null = flow_control.default_class.",
    )
    priority_classes: list[str] | None = Field(
        default=None,
        description="The classes this key may ask for (`service_tier` or the x-shunter-priority header); "
        "another is a 403, never a silent change of class. null = its default class and every less urgent one.",
    )
    weight: float = Field(
        default=1.0, gt=0, le=1000,
        description="This key's share among the keys whose requests of one priority class wait for the same "
        "model: while they wait, each gets slots in proportion to its weight (counted in the tokens its "
        "requests may use), and all of them when nobody else waits.",
    )
    cache_group: str | None = Field(
        default=None, pattern=KEY_NAME_PATTERN,
        description="Keys with the same cache group share cached prompt prefixes (one organization's common "
        "system prompt); null = the key's own. Every key's requests carry a prompt-cache salt derived from "
        "its group or name, so one key can neither reuse nor detect (by `cached_tokens`, timing or the "
        "`x-shunter-prefix-predicted` header) a prefix another group's key sent.",
    )


class AuthConfig(StrictModel):
    """Who may call the platform. With any key configured, every /v1 endpoint needs `Authorization: Bearer
    <key>` and /admin needs an admin key; with none, the API is open (and the gateway says so loudly)."""

    keys: list[ApiKeyConfig] = Field(default_factory=list, description="Client keys for /v1/*.")
    admin_keys: list[KeySourceConfig] = Field(
        default_factory=list,
        description="Keys for /admin/* (rollouts, weights). Client keys never open /admin; with client keys "
        "but no admin key, /admin is closed to everyone.",
    )

    anonymous: bool = Field(
        default=False,
        description="Serve with no keys on a non-loopback address on purpose (behind an authenticating "
        "proxy). Without keys and without this, the gateway refuses to start on an address other than "
        "127.0.0.1/::1/localhost: anyone who reaches it could use /v1 and /admin.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin_keys)

    @property
    def env_vars(self) -> list[str]:
        """The environment variables the keys are read from (client and admin)."""
        return [k.key_env for k in [*self.keys, *self.admin_keys] if k.key_env]

    @model_validator(mode="after")
    def _names_unique(self) -> AuthConfig:
        names = [k.name for k in [*self.keys, *self.admin_keys]]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"key names repeat: {repeated}; every key (client and admin) needs its own name")
        return self
