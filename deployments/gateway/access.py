"""Who may call the gateway, for what, and how much: API keys, model allow-lists, admin keys, per-key quotas
and per-request limits. The gateway asks this module at the door; it answers a Caller, a Ticket, or
raises `ApiError` with the OpenAI-shaped refusal (401, 403, 429, 400).

Keys and prompts never reach a log line or a metric from here: a caller is named by its configured name
and its public key id (`shunter.auth.key_id`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shunter.auth import ALL_ADAPTERS, ANONYMOUS, Caller, KeyRing, bearer_token
from shunter.config import LimitsConfig, ShunterConfig
from shunter.deployments.gateway.quotas import KeyQuota, estimate_prompt_tokens
from shunter.endpoints import ParsedRequest
from shunter.errors import ApiError
from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics

log = logging.getLogger("ray.serve")

_NAMES = ("shunter_key_requests_total", "shunter_key_tokens_total", "shunter_rate_limited_total",
          "shunter_auth_failures_total")
_record = LazyMetrics(lambda metrics: build(metrics, _NAMES)).record
_CHALLENGE = {"WWW-Authenticate": "Bearer"}

OPEN_API_WARNING = (
    "NO API KEYS ARE CONFIGURED: every endpoint, /admin (rollouts, traffic weights) included, is open to "
    "anyone who can reach this gateway. Configure `auth.keys` and `auth.admin_keys` (keys come from "
    "environment variables or files) before exposing it beyond this machine.")


def _auth_failure(reason: str) -> None:
    _record(lambda m: m["shunter_auth_failures_total"].inc(1, tags={"reason": reason}))


@dataclass
class Ticket:
    """An admitted request's quota reservation; `settle` once it has ended.

    `default_max_tokens`: the completion tokens per choice the replica gives a request that names none
    (the platform's limit, the model's context and what the key's budget can hold, whichever is least).
    `tokens_at_most`: its prompt estimate plus every completion token it may make (what a key's token quota
    reserves, and what the flow queue's fair shares count the request as)."""

    caller: Caller
    model: str
    quota: KeyQuota | None
    reserved: int
    default_max_tokens: int | None = None
    prompt_estimate: int = 0
    tokens_at_most: int = 0
    _settled: bool = False
    charged: tuple[int, int] | None = None  # once settled: the (prompt, completion) tokens the key was charged

    def settle(self, status: int | str, prompt_tokens: int, completion_tokens: int,
               reached_engine: bool = True) -> None:
        """At the tokens really produced. A stream cut short (the client hung up, an error mid-way) has
        counted the tokens relayed so far, a whole reply whose client left those its replica last reported
        (shunter.deployments.gateway.request_end); one cut before the engine reported anything is charged its
        estimated prompt, which the engine had started on. A request that never reached an engine (refused
        by the model's admission, or its client left while it waited for a slot) is charged nothing: neither
        tokens nor the request."""
        if self._settled:
            return
        self._settled = True
        if not reached_engine:
            prompt_tokens = completion_tokens = 0
        elif not prompt_tokens and str(status) in _CUT_SHORT:
            prompt_tokens = self.prompt_estimate
        self.charged = (prompt_tokens, completion_tokens)
        if self.quota is not None:
            self.quota.settle(self.reserved, prompt_tokens + completion_tokens, request_back=not reached_engine)
        labels = {"key_name": self.caller.name, "key_id": self.caller.key_id, "model": self.model}

        def record(m: dict[str, Any]) -> None:
            m["shunter_key_requests_total"].inc(1, tags={**labels, "status": str(status)})
            if prompt_tokens:
                m["shunter_key_tokens_total"].inc(prompt_tokens, tags={**labels, "kind": "prompt"})
            if completion_tokens:
                m["shunter_key_tokens_total"].inc(completion_tokens, tags={**labels, "kind": "completion"})

        _record(record)


class AccessControl:
    """The gateway's door. Reads every key when constructed (a key that cannot be read stops the
    gateway from starting, with the key's name and source in the error)."""

    def __init__(self, cfg: ShunterConfig, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits: LimitsConfig = cfg.gateway.limits
        self.ring = KeyRing.load(cfg.auth, lambda name: _canonical(cfg, name), environ)
        self._share = 1.0 / cfg.gateway.replicas
        self._clock = clock
        self._quotas: dict[str, KeyQuota] = {}
        if not self.ring.enabled:
            log.warning(OPEN_API_WARNING)
        else:
            clients = [c for _, c in self.ring.entries if not c.admin]
            admins = [c for _, c in self.ring.entries if c.admin]
            log.info("API keys: %d client key(s) (%s), %d admin key(s)%s", len(clients),
                     ", ".join(f"{c.name}={c.key_id}" for c in clients), len(admins),
                     "" if admins else "; /admin is closed to everyone (no admin key configured)")

    # ---- who is calling --------------------------------------------------------------------------

    def client(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a /v1 request. 401 without a valid client key (when keys are configured)."""
        if not self.ring.enabled:
            return ANONYMOUS
        caller = self._identify(headers)
        if caller.admin:
            _auth_failure("admin_key_on_api")
            raise ApiError(403, "an admin key opens /admin only; call /v1 with a client key",
                           code="client_key_required")
        return caller

    def by_key_id(self, key_id: str) -> Caller | None:
        """The client key whose public id this is (a batch's owner; the anonymous caller without keys), or
        None when no configured client key has it (removed since)."""
        if not self.ring.enabled:
            return ANONYMOUS if key_id == ANONYMOUS.key_id else None
        return next((c for _, c in self.ring.entries if c.key_id == key_id and not c.admin), None)

    def admin(self, headers: Mapping[str, str]) -> Caller:
        """The caller of an /admin request: 401 without a key, 403 for a client key or when no admin key
        is configured. Open only when no key of any kind is configured."""
        if not self.ring.enabled:
            return ANONYMOUS
        caller = self._identify(headers)
        if not caller.admin:
            _auth_failure("client_key_on_admin")
            raise ApiError(403, "this endpoint needs an admin key (auth.admin_keys); a client key does not "
                           "open /admin", code="admin_key_required")
        return caller

    def usage_of(self, headers: Mapping[str, str]) -> str | None:
        """Whose usage the caller of the Usage API may read: a client key its own (its name, which the ledger
        records), an admin key every key's (None), as anyone may without keys configured. 401 without a valid
        key of either kind when keys are configured."""
        if not self.ring.enabled:
            return None
        caller = self._identify(headers)
        return None if caller.admin else caller.name

    def sees_details(self, headers: Mapping[str, str]) -> bool:
        """Whether a caller of an open endpoint (/ready) may see the platform's internals: an admin key,
        or anyone when no key is configured. Never refuses, never counts an auth failure."""
        if not self.ring.enabled:
            return True
        token = bearer_token(headers.get("authorization") or "")
        caller = self.ring.identify(token) if token else None
        return caller is not None and caller.admin

    def _identify(self, headers: Mapping[str, str]) -> Caller:
        """The caller of an `Authorization: Bearer <key>` header, or of `x-api-key: <key>` (how Anthropic's
        clients send a key) when there is no Authorization header."""
        authorization = headers.get("authorization")
        if not authorization and headers.get("x-api-key"):
            authorization = f"Bearer {headers['x-api-key']}"
        if not authorization:
            _auth_failure("missing_key")
            raise ApiError(401, "no API key: send it as the header `Authorization: Bearer <key>` (or `x-api-key: "
                           "<key>`)", code="missing_api_key", headers=_CHALLENGE)
        token = bearer_token(authorization)
        if token is None:
            _auth_failure("malformed_header")
            raise ApiError(401, "the Authorization header must be `Bearer <key>`", code="invalid_api_key",
                           headers=_CHALLENGE)
        caller = self.ring.identify(token)
        if caller is None:
            _auth_failure("invalid_key")
            raise ApiError(401, "the API key is not valid", code="invalid_api_key", headers=_CHALLENGE)
        return caller

    # ---- what it may use ---------------------------------------------------------------------------

    def check_model(self, caller: Caller, model: str, base: str | None = None) -> None:
        """403 unless the caller may use `model` (a LoRA adapter of `base`, when `base` is given)."""
        if not caller.may_use(model, base):
            _auth_failure("model_not_allowed")
            raise ApiError(403, f"this API key ({caller.name}) may not use model {model!r}", param="model",
                           code="model_not_allowed")

    def check_limits(self, request: ParsedRequest) -> None:
        """The request's own size limits (400), on its parsed values (a string or a float the engine
        would coerce is held to the limit as the number it becomes)."""
        limits, endpoint = self.limits, request.endpoint
        field = endpoint.prompt_field
        if endpoint.message_list and len(request.messages) > limits.max_messages:
            raise ApiError(400, f"{len(request.messages)} {'input items' if field == 'input' else 'messages'}; this "
                           f"platform takes at most {limits.max_messages} per request", param=field,
                           code="too_many_messages")
        if endpoint.batch_limit is not None:
            most = getattr(limits, endpoint.batch_limit)
            if request.prompts > most:
                raise ApiError(400, f"{request.prompts} {endpoint.batch_noun}; this platform takes at most {most} "
                               "per request", param=field, code="too_many_inputs")
        if request.n > limits.max_n:
            raise ApiError(400, f"n={request.n}; this platform takes at most {limits.max_n}", param="n",
                           code="n_too_large")
        if endpoint.max_tokens_field is not None and request.max_tokens is not None \
                and request.max_tokens > limits.max_tokens:
            name = "max_completion_tokens" if "max_completion_tokens" in request.body \
                else endpoint.max_tokens_field
            raise ApiError(400, f"{name}={request.max_tokens}; this platform generates at most "
                           f"{limits.max_tokens} tokens per request", param=name, code="max_tokens_too_large")

    # ---- how much ----------------------------------------------------------------------------------

    def admit(self, caller: Caller, model: str, request: ParsedRequest, context_len: int | None = None) -> Ticket:
        """Take the request from the caller's quota, or raise 429 with Retry-After and the rate-limit
        headers. The reservation covers every prompt of a batch and every choice, at the completion tokens
        asked for or, when none are, at the default the replica will apply (`context_len`: the model's
        configured context, when known)."""
        quota = self._quota(caller)
        prompt = estimate_prompt_tokens(request.body)
        default = self.limits.max_tokens if context_len is None else min(self.limits.max_tokens, context_len)
        if quota is not None and quota.tokens is not None and request.max_tokens is None:
            # A request that names no max_tokens gets what the key's whole budget can hold at most: a
            # default past the budget would make every such request `request_exceeds_quota`.
            affordable = (int(quota.tokens.capacity) - prompt) // (request.n * request.prompts)
            default = max(1, min(default, affordable))
        if request.endpoint.max_tokens_field is None:  # it generates nothing
            completion = 0
        else:
            per_choice = request.max_tokens if request.max_tokens is not None else default
            completion = per_choice * request.n * request.prompts
        reservation = prompt + completion
        if quota is None:
            return Ticket(caller, model, None, 0, default_max_tokens=default, prompt_estimate=prompt,
                          tokens_at_most=reservation)
        decision = quota.admit(reservation)
        if decision.admitted:
            return Ticket(caller, model, quota, decision.reserved, default_max_tokens=default,
                          prompt_estimate=prompt, tokens_at_most=reservation)
        labels = {"key_name": caller.name, "key_id": caller.key_id}
        if decision.never_fits:
            _record(lambda m: m["shunter_rate_limited_total"].inc(1, tags={**labels, "limit": "too_large"}))
            raise ApiError(429, f"this request needs about {reservation} tokens (prompt estimate plus max_tokens), "
                           f"more than this key's whole budget of {quota.tokens_per_minute} tokens per minute; "
                           "send a shorter prompt or a smaller max_tokens", code="request_exceeds_quota",
                           headers=decision.headers)
        limit = decision.limit or "requests"
        _record(lambda m: m["shunter_rate_limited_total"].inc(1, tags={**labels, "limit": limit}))
        per_minute = quota.requests_per_minute if limit == "requests" else quota.tokens_per_minute
        raise ApiError(429, f"rate limit reached for this key ({caller.name}): {per_minute} {limit} per minute; "
                       f"retry in {decision.retry_after_s}s", code="rate_limit_exceeded",
                       headers={"Retry-After": str(decision.retry_after_s), **decision.headers})

    def rate_headers(self, caller: Caller) -> dict[str, str]:
        """The caller's `x-ratelimit-*` headers as its budgets stand now (none for a key without a quota).
        Read when a response is made, so a whole reply's headers count its own settled usage."""
        quota = self._quota(caller)
        return quota.headers() if quota is not None else {}

    def _quota(self, caller: Caller) -> KeyQuota | None:
        config = caller.config
        if config is None or (config.requests_per_minute is None and config.tokens_per_minute is None):
            return None
        quota = self._quotas.get(caller.key_id)
        if quota is None:
            quota = self._quotas[caller.key_id] = KeyQuota(config.requests_per_minute, config.tokens_per_minute,
                                                           self._share, self._clock)
        return quota


# Statuses of a request that ended before the engine's final usage arrived.
_CUT_SHORT = {"499", "stream_error"}


def _canonical(cfg: ShunterConfig, name: str) -> str:
    """A key's model entry as the name requests are checked against: a model's own name for it or an alias,
    an adapter's own name for it or `<base>:<adapter>`, `<base>:*` for every adapter of a base (the
    config checked that each names something)."""
    model = cfg.find_model(name)
    if model is not None:
        return model.name
    if name.endswith(ALL_ADAPTERS):
        base = cfg.find_model(name[:-len(ALL_ADAPTERS)])
        assert base is not None, name
        return f"{base.name}{ALL_ADAPTERS}"
    found = cfg.find_adapter(name)
    assert found is not None, name
    return found[1].name
