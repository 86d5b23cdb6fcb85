"""The gateway's side of complexity tiers: `model: auto` resolved to a tier's model, the decision shown
in headers and the trace, tokens and estimated cost per tier, and the quality monitor's sampling and
judgement. The decisions themselves are routing/tiers.py's; the monitor's requests are sent by the
gateway (it owns the handles), through the `ask` callable it gives `judge`.

Promotions live in each gateway replica's memory: they start from the config at every gateway start,
and with several gateway replicas each learns from the samples it took.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from shunter.config import ShunterConfig, TiersConfig
from shunter.deployments.gateway.context import RequestContext
from shunter.endpoints import EMBEDDING, Endpoint
from shunter.errors import ApiError
from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics
from shunter.routing.tiers import (
    AgreementMonitor,
    Decision,
    NoTierAllowed,
    Tier,
    TierRouter,
    cosine,
    features,
)

log = logging.getLogger("ray.serve")

TIER_HEADER = "x-shunter-tier"  # the tier that served the request; on a request, the tier a client asks for
TIER_REASON_HEADER = "x-shunter-tier-reason"  # class, complexity, why this tier, the model
_NAMES = ("shunter_tier_requests_total", "shunter_tier_tokens_total", "shunter_tier_cost_total",
          "shunter_tier_agreement", "shunter_tier_promotions_total", "shunter_tier_class_floor")
_record = LazyMetrics(lambda metrics: build(metrics, _NAMES)).record
# What the monitor takes from a sampled request: the question only. Both tiers answer it greedily, at
# the monitor's own length.
_JUDGED = ("messages", "prompt", "tools")
MONITOR_MAX_TOKENS = 64

Ask = Callable[[str, Endpoint, dict[str, Any]], Awaitable[dict[str, Any] | None]]


class Tiering:
    def __init__(self, cfg: ShunterConfig, rng: random.Random | None = None):
        assert cfg.tiers is not None
        self.config: TiersConfig = cfg.tiers
        self.name = self.config.model_name
        tiers = [Tier(t.name, cfg.find_model(t.model).name, t.max_complexity,  # type: ignore[union-attr]
                      t.cost_per_1k_prompt_tokens, t.cost_per_1k_completion_tokens) for t in self.config.levels]
        self.router = TierRouter(tiers)
        monitor = self.config.monitor
        self.monitor = AgreementMonitor(monitor.agreement_threshold, monitor.min_samples, monitor.window_s,
                                        self.router.top)
        self.embedding_model = (cfg.find_model(monitor.embedding_model).name  # type: ignore[union-attr]
                                if monitor.embedding_model else None)
        self._rng = rng or random.Random()
        self._background: set[asyncio.Task] = set()  # the monitor's comparisons, kept referenced
        log.info("tier routing on `%s`: %s", self.name, ", ".join(f"{t.name}={t.model} (<= {t.max_complexity:g})"
                                                                  for t in tiers))

    @property
    def top(self) -> Tier:
        return self.router.tiers[-1]

    def classify(self, endpoint: Endpoint, body: dict[str, Any], headers: Mapping[str, str],
                 allowed: Callable[[str], bool]) -> Decision:
        """The tier for a request to the tier name. Raises ApiError: 400 for embeddings or an unknown
        hint, 403 when the caller may use no tier."""
        if not endpoint.generates:
            raise ApiError(400, f"model {self.name!r} routes chat and completion requests by complexity; "
                           "embeddings name their model", param="model", code="model_not_supported")
        hint = headers.get(TIER_HEADER)
        if hint is not None and self.router.level_of(hint) is None:
            raise ApiError(400, f"{TIER_HEADER}: {hint!r} is not a tier; tiers: "
                           f"{', '.join(t.name for t in self.router.tiers)}", code="unknown_tier")
        try:
            decision = self.router.choose(features(body), hint, allowed)
        except NoTierAllowed:
            raise ApiError(403, f"this API key may use none of the models behind {self.name!r}", param="model",
                           code="model_not_allowed") from None
        labels = {"tier": decision.tier.name, "class": decision.request_class, "reason": decision.reason}
        _record(lambda m: m["shunter_tier_requests_total"].inc(1, tags=labels))
        return decision

    def follow(self, ctx: RequestContext, span: Any, ask: Ask) -> None:
        """A tier-routed request: its decision on the trace, its tokens and cost when it ends, and, for a
        sampled one, the monitor's comparison of both tiers once it has been answered (with `ask`, the
        gateway's way to send a request of the platform's own)."""
        tier = ctx.tier
        assert tier is not None
        span.set_attributes({"shunter.tier": tier.tier.name, "shunter.tier.class": tier.request_class,
                             "shunter.tier.complexity": tier.complexity, "shunter.tier.reason": tier.reason})
        ctx.on_outcome.append(lambda done: self.finished(tier, done.outcome.status, done.usage.prompt_tokens,  # type: ignore[union-attr]
                                                         done.usage.completion_tokens))
        if not ctx.endpoint.judged or not self.sampled(tier):
            return  # the monitor compares chat and completion answers
        asked, endpoint = dict(ctx.engine_body), ctx.endpoint

        def compare(done: RequestContext) -> None:
            if done.outcome is None or str(done.outcome.status) != "200":
                return
            try:
                task = asyncio.get_running_loop().create_task(self.judge(tier, endpoint, asked, ask))
            except RuntimeError:  # finished outside the event loop: skip the sample
                return
            self._background.add(task)
            task.add_done_callback(self._background_done)

        ctx.on_outcome.append(compare)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tier monitor: a comparison failed: %r", task.exception())

    def headers(self, decision: Decision) -> dict[str, str]:
        return {TIER_HEADER: decision.tier.name, TIER_REASON_HEADER: decision.explain()}

    def sampled(self, decision: Decision) -> bool:
        """Whether the monitor re-asks this request of the top tier (decided before it is sent, so the
        answer's text is collected only for these)."""
        ratio = self.config.monitor.sample_ratio
        return ratio > 0 and decision.level < self.router.top and self._rng.random() < ratio

    def finished(self, decision: Decision, status: int | str, prompt_tokens: int, completion_tokens: int) -> None:
        """Tokens and estimated cost, on the tier that served it and as if the top tier had."""
        if not str(status).startswith("2"):
            return
        tier, top = decision.tier, self.top

        def record(m: dict[str, Any]) -> None:
            for kind, tokens in (("prompt", prompt_tokens), ("completion", completion_tokens)):
                if tokens:
                    m["shunter_tier_tokens_total"].inc(tokens, tags={"tier": tier.name, "kind": kind})
            m["shunter_tier_cost_total"].inc(tier.cost(prompt_tokens, completion_tokens),
                                             tags={"tier": tier.name, "basis": "routed"})
            m["shunter_tier_cost_total"].inc(top.cost(prompt_tokens, completion_tokens),
                                             tags={"tier": tier.name, "basis": "top_tier"})

        _record(record)

    async def judge(self, decision: Decision, endpoint: Endpoint, body: dict[str, Any], ask: Ask) -> float | None:
        """Ask the served tier and the top tier the same request, greedily, with the monitor's own length
        (never the client's sampling: a client choosing temperature 2, max_tokens 1 or a logit_bias would
        otherwise decide the comparison, and one crafted request could promote a class for everyone),
        compare the two answers by embedding, record the agreement, promote the class when its window
        falls short. Returns the agreement (None when a step could not be done: the sample is skipped)."""
        question = {k: body[k] for k in _JUDGED if k in body}
        question.update(temperature=0, max_tokens=MONITOR_MAX_TOKENS)
        served, top = await asyncio.gather(ask(decision.tier.model, endpoint, {**question, "model": decision.tier.model}),
                                           ask(self.top.model, endpoint, {**question, "model": self.top.model}))
        answer, reference = (choice_text(reply) if reply else None for reply in (served, top))
        if not answer or not reference or not answer.strip() or not reference.strip() or self.embedding_model is None:
            return None
        vectors = await ask(self.embedding_model, EMBEDDING, {"model": self.embedding_model,
                                                                 "input": [answer, reference]})
        try:
            first, second = (item["embedding"] for item in vectors["data"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None
        agreement = max(0.0, cosine(first, second))
        return self.record_agreement(decision, agreement)

    def record_agreement(self, decision: Decision, agreement: float) -> float:
        klass, tier = decision.request_class, decision.tier.name
        _record(lambda m: m["shunter_tier_agreement"].observe(agreement, tags={"tier": tier, "class": klass}))
        promotion = self.monitor.record(klass, decision.level, agreement)
        if promotion is not None:
            self.router.promote(klass, promotion.to_level)
            to = self.router.tiers[promotion.to_level].name
            log.warning("tier monitor: class %s promoted from tier %s to %s: mean agreement %.3f with the top tier "
                        "over %d samples, below %.3f", klass, tier, to, promotion.agreement, promotion.samples,
                        self.config.monitor.agreement_threshold)

            def record(m: dict[str, Any]) -> None:
                m["shunter_tier_promotions_total"].inc(1, tags={"class": klass, "from_tier": tier, "to_tier": to})
                m["shunter_tier_class_floor"].set(promotion.to_level, tags={"class": klass})

            _record(record)
        return agreement

    def status(self) -> dict[str, Any]:
        tiers = self.router.tiers
        return {"model_name": self.name,
                "tiers": [{"name": t.name, "model": t.model, "max_complexity": t.max_complexity} for t in tiers],
                "promotions": {k: tiers[level].name for k, level in self.router.floors.items()},
                "monitor": {"sample_ratio": self.config.monitor.sample_ratio,
                            "agreement_threshold": self.config.monitor.agreement_threshold,
                            "windows": self.monitor.summary()}}


def choice_text(data: dict[str, Any]) -> str | None:
    """The text of choice 0 in a reply or a stream chunk: a chat message or delta, or a completion's text."""
    for choice in data.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        part = choice.get("delta") or choice.get("message")
        text = part.get("content") if isinstance(part, dict) else choice.get("text")
        return text if isinstance(text, str) else None
    return None
