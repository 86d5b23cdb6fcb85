"""API keys: read from their sources once, kept only as SHA-256 digests, checked in constant time.

Keys are long random strings (not passwords), so one SHA-256 is the right hash: it keeps the key out of
memory dumps and makes the comparison independent of the key's bytes, and a slow password hash would
only cost every request. A presented key is hashed once and compared with every configured digest by
`hmac.compare_digest`, without stopping at the first match, so the time taken says nothing about which
key, or how much of one, matched.

A key's id is the first 12 hex digits of its digest: safe to show in logs and to use as a metric label,
and enough to tell keys apart (and to find a key's id from the key: `shunter keys id`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shunter.config import ApiKeyConfig, AuthConfig, KeySourceConfig

MIN_KEY_LENGTH = 16  # shorter keys are guessable; `shunter keys new` makes 43-character ones
KEY_PREFIX = "sk-shunter-"


class KeySourceError(ValueError):
    """A configured key cannot be read or is unusable; the message names the key and its source, never
    the key."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_id(key: str) -> str:
    """The public id of a key (its digest's first 12 hex digits)."""
    return digest(key).hex()[:12]


def new_key() -> str:
    """A fresh key: 32 random bytes, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def read_key(source: KeySourceConfig, environ: Mapping[str, str] | None = None) -> str:
    """The key from its environment variable or file, checked. Raises KeySourceError naming the source."""
    environ = os.environ if environ is None else environ
    if source.key_env:
        value = environ.get(source.key_env)
        if value is None:
            raise KeySourceError(f"key {source.name!r}: environment variable ${source.key_env} is not set in the "
                            "gateway's process")
    else:
        try:
            value = Path(source.key_file or "").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeySourceError(f"key {source.name!r}: cannot read {source.key_file}: "
                            f"{exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'}") from None
    key = value.strip()
    if len(key) < MIN_KEY_LENGTH:
        raise KeySourceError(f"key {source.name!r} from {source.source} is {len(key)} characters; a key needs at "
                        f"least {MIN_KEY_LENGTH} (make one with `shunter keys new`)")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise KeySourceError(f"key {source.name!r} from {source.source} holds whitespace or control characters; "
                        "a key is one printable word")
    return key


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key's name and public id, and what it may use."""

    name: str
    key_id: str
    admin: bool = False
    models: frozenset[str] | None = None  # canonical model names; None = every model
    config: ApiKeyConfig | None = None  # a client key's settings (quotas)

    def may_use(self, model: str, base: str | None = None) -> bool:
        """`model`: the canonical name asked for; `base`: its base model when it is a LoRA adapter (a key
        listing `<base>:*` may use every adapter of that base, those added later too)."""
        return not self.admin and (self.models is None or model in self.models or
                                   (base is not None and f"{base}{ALL_ADAPTERS}" in self.models))


ALL_ADAPTERS = ":*"  # `<model>:*` in a key's models: every LoRA adapter of that model


def cache_salt(caller: Caller, asked: Any = None) -> str | None:
    """The prompt-cache salt (vLLM's per-request `cache_salt`) of a client key's request: derived from the
    key's cache group, or its name, so the engine's prefix cache is shared only within that scope. A salt
    the client sent (`asked`) is folded in: it can split its own cache further, never join another's.
    None without keys (anonymous): the client's own salt, if any, stands."""
    config = caller.config
    if config is None:
        return None
    scope = f"group:{config.cache_group}" if config.cache_group else f"key:{caller.name}"
    extra = asked if isinstance(asked, str) else ""
    return hashlib.blake2b(f"{scope}\0{extra}".encode("utf-8", "backslashreplace"), digest_size=16,
                           person=b"shunter-salt").hexdigest()

ANONYMOUS = Caller(name="anonymous", key_id="none")  # who calls when no key is configured


@dataclass
class KeyRing:
    """The configured keys as digests. `identify` finds the caller of a presented key."""

    entries: list[tuple[bytes, Caller]] = field(default_factory=list)
    enabled: bool = False

    @classmethod
    def load(cls, auth: AuthConfig, canonical: Callable[[str], str],
             environ: Mapping[str, str] | None = None) -> KeyRing:
        """Read every key now. `canonical` maps a model name or alias to the model's name. Raises
        KeySourceError listing every key that cannot be read, and when two sources hold the same key."""
        ring, problems, seen = cls(enabled=auth.enabled), [], {}
        sources: Sequence[tuple[KeySourceConfig, bool]] = [*((k, False) for k in auth.keys),
                                                           *((k, True) for k in auth.admin_keys)]
        for source, admin in sources:
            try:
                key = read_key(source, environ)
            except KeySourceError as exc:
                problems.append(str(exc))
                continue
            hashed = digest(key)
            if hashed in seen:
                problems.append(f"keys {seen[hashed]!r} and {source.name!r} are the same key; give each its own")
                continue
            seen[hashed] = source.name
            models = None
            if isinstance(source, ApiKeyConfig) and source.models:
                models = frozenset(canonical(m) for m in source.models)
            caller = Caller(name=source.name, key_id=hashed.hex()[:12], admin=admin, models=models,
                            config=source if isinstance(source, ApiKeyConfig) else None)
            ring.entries.append((hashed, caller))
        if problems:
            raise KeySourceError("the gateway cannot start: " + "; ".join(problems))
        return ring

    def identify(self, presented: str) -> Caller | None:
        """The caller whose key this is, or None. Every entry is compared, in constant time each."""
        hashed = digest(presented)
        found = None
        for entry_digest, caller in self.entries:
            if hmac.compare_digest(entry_digest, hashed):
                found = caller
        return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str | None) -> bool:
    """Whether an HTTP bind address reaches only this machine (Ray Serve's default host is 127.0.0.1)."""
    if host is None or host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it resolves to some interface, maybe a public one
        return False


def open_public_bind(host: str | None, auth: AuthConfig) -> str | None:
    """Why serving on `host` with `auth` must not start (None: it may): no key at all, an address other
    machines reach, and no explicit `auth.anonymous: true`. Anyone reaching such a gateway could use
    every model and every /admin action (start, pause or roll back a rollout, drain replicas)."""
    if auth.enabled or auth.anonymous or is_loopback(host):
        return None
    return (f"refusing to serve with no API keys on {host}, an address other machines reach: anyone who can "
            "connect could use every model and /admin. Configure `auth.keys` and `auth.admin_keys`, bind "
            "http_options.host to 127.0.0.1, or, behind a proxy that authenticates, say so with "
            "`auth.anonymous: true`")
