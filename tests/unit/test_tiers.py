"""Complexity tiers without Ray: feature extraction, the score and the class, tier choice (hints,
promotions, a key's allowed models), the monitor's promotion logic on a fake clock, and the config's
checks. (The classifier's cost per request is measured by `shunter bench tiers`.)"""

from __future__ import annotations

import random

import pytest

from shunter.config import ConfigError, parse_config
from shunter.deployments.gateway.tiering import MONITOR_MAX_TOKENS, Tiering, choice_text
from shunter.endpoints import CHAT, EMBEDDING, ENDPOINTS
from shunter.routing.tiers import AgreementMonitor, NoTierAllowed, Tier, TierRouter, cosine, features

from .fake_clock import Clock

SIMPLE = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
CODE = {"messages": [{"role": "user", "content": "Write a Python function that parses ISO dates:\n```python\ndef parse(s):\n```"}]}
REASONING = {"messages": [{"role": "user", "content": "Compare the trade-offs of B-trees and LSM trees, step by step."}]}
MATH = {"messages": [{"role": "user", "content": "Solve for x: 3x + 7 = 22"}]}
LONG = {"messages": [{"role": "user", "content": "Summarise this letter. " + "It was a quiet morning. " * 400}]}
TIERS = [Tier("small", "smol", 0.35, 0.1, 0.2), Tier("medium", "mid", 0.7, 0.5, 1.0), Tier("large", "big", 1.0, 3, 6)]


@pytest.mark.parametrize("body, klass", [(SIMPLE, "simple"), (CODE, "code"), (REASONING, "reasoning"),
                                         (MATH, "math"), (LONG, "long")])
def test_each_kind_of_request_gets_its_class(body, klass):
    assert features(body).request_class == klass


def test_features_count_turns_tokens_and_the_asked_length():
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a" * 400},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "b" * 400}, {"type": "image_url"}]}],
            "max_tokens": 1024}
    found = features(body)
    assert (found.turns, found.prompt_tokens, found.max_tokens) == (2, 203, 1024)  # (9 + 400 + 2 + 400) / 4
    assert features({"prompt": "def f(x):\n    return x", "max_tokens": True}).code
    assert features({"prompt": ["x", 3], "max_tokens": -1}).max_tokens is None


def test_complexity_rises_with_what_makes_a_request_hard_and_stays_in_0_1():
    simple, code, reasoning = (features(b).complexity for b in (SIMPLE, CODE, REASONING))
    assert simple < 0.05 < code and simple < reasoning
    everything = features({"messages": [{"role": "user", "content": "prove 2+2=4 in python step by step " * 2000}] * 9,
                           "max_tokens": 100_000})
    assert everything.complexity == 1.0


@pytest.mark.parametrize("body", [{}, {"messages": "junk"}, {"messages": [1, None, {"content": {"a": 1}}]},
                                  {"prompt": {"x": 1}}, {"prompt": None, "max_tokens": "9"}])
def test_any_body_shape_is_classified_without_error(body):
    assert features(body).request_class == "simple"


def test_a_request_goes_to_the_first_tier_whose_bound_it_is_under():
    router = TierRouter(TIERS)
    assert router.choose(features(SIMPLE)).tier.name == "small"
    assert router.choose(features(REASONING)).tier.name == "small"  # 0.3: a small model may reason briefly
    both = {"messages": [{"role": "user", "content": "Explain why this python code is slow, step by step"}]}
    assert router.choose(features(both)).tier.name == "medium"
    hard = {**both, "max_tokens": 4096, "messages": [*both["messages"], {"role": "user", "content": "3*4=12?"}]}
    decision = router.choose(features(hard))
    assert (decision.tier.name, decision.reason) == ("large", "complexity")


def test_a_hint_names_the_tier_and_a_promotion_raises_a_class():
    router = TierRouter(TIERS)
    assert router.choose(features(SIMPLE), hint="large").reason == "hint"
    router.promote("simple", 1)
    decision = router.choose(features(SIMPLE))
    assert (decision.tier.name, decision.reason) == ("medium", "promoted")
    assert router.choose(features(MATH)).tier.name == "small"  # other classes keep their tier
    router.promote("simple", 99)
    assert router.choose(features(SIMPLE)).tier.name == "large"


def test_a_key_gets_the_nearest_tier_it_may_use_above_then_below():
    router = TierRouter(TIERS)
    assert router.choose(features(SIMPLE), allowed=lambda m: m != "smol").tier.name == "medium"
    decision = router.choose(features(SIMPLE), hint="large", allowed=lambda m: m == "smol")
    assert (decision.tier.name, decision.reason) == ("small", "allowed")
    with pytest.raises(NoTierAllowed):
        router.choose(features(SIMPLE), allowed=lambda m: False)


def test_a_class_is_promoted_once_its_window_falls_below_the_threshold():
    clock = Clock()
    monitor = AgreementMonitor(threshold=0.8, min_samples=3, window_s=60, top_level=2, clock=clock)
    assert monitor.record("code", 0, 0.5) is None and monitor.record("code", 0, 0.6) is None
    promotion = monitor.record("code", 0, 0.7)
    assert (promotion.request_class, promotion.from_level, promotion.to_level) == ("code", 0, 1)
    assert promotion.agreement == pytest.approx(0.6) and promotion.samples == 3
    assert monitor.summary() == {}  # the window judged the tier the class left


def test_agreeing_classes_stay_and_old_samples_leave_the_window():
    clock = Clock()
    monitor = AgreementMonitor(threshold=0.8, min_samples=3, window_s=60, top_level=1, clock=clock)
    for _ in range(5):
        assert monitor.record("simple", 0, 0.95) is None
    monitor.record("math", 0, 0.1)
    clock.now += 61
    assert monitor.record("math", 0, 0.1) is None and monitor.record("math", 0, 0.1) is None  # two in the window
    assert monitor.summary()["math@0"] == {"samples": 2, "mean_agreement": 0.1}
    assert monitor.record("simple", 1, 0.0) is None  # the top tier is never judged


def test_cosine():
    assert cosine([1, 0], [1, 0]) == pytest.approx(1.0)
    assert cosine([1, 0], [0, 1]) == pytest.approx(0.0)
    assert cosine([0, 0], [1, 1]) == 0.0


def test_choice_text_of_chat_and_completion_replies_and_chunks():
    assert choice_text({"choices": [{"message": {"content": "Paris"}}]}) == "Paris"
    assert choice_text({"choices": [{"index": 0, "delta": {"content": "Pa"}}]}) == "Pa"
    assert choice_text({"choices": [{"index": 1, "delta": {"content": "x"}}]}) is None
    assert choice_text({"choices": [{"text": "Paris"}]}) == "Paris"
    assert choice_text({"choices": []}) is None and choice_text({}) is None


# ---- config and the gateway's side --------------------------------------------------------------------

MODELS = [{"name": "smol", "source": "builtin:smollm2-135m-instruct"},
          {"name": "big", "aliases": ["large"], "source": "builtin:smollm2-135m-instruct"},
          {"name": "minilm", "source": "builtin:all-minilm-l6-v2", "task": "embed"}]


def tiers_config(**tiers):
    levels = [{"name": "small", "model": "smol", "max_complexity": 0.3, "cost_per_1k_prompt_tokens": 0.1,
               "cost_per_1k_completion_tokens": 0.2},
              {"name": "large", "model": "large", "cost_per_1k_prompt_tokens": 1, "cost_per_1k_completion_tokens": 2}]
    return parse_config({"models": MODELS, "tiers": {"levels": levels, **tiers}})


@pytest.mark.parametrize("tiers, words", [
    ({"model_name": "smol"}, "already a model name"),
    ({"levels": [{"name": "a", "model": "smol"}, {"name": "b", "model": "minilm"}]}, "not a served generative"),
    ({"levels": [{"name": "a", "model": "smol"}, {"name": "b", "model": "smol"}]}, "same model"),
    ({"levels": [{"name": "a", "model": "smol", "max_complexity": 0.5}, {"name": "b", "model": "big", "max_complexity": 0.2},
                 {"name": "c", "model": "nope"}]}, "must rise"),
    ({"monitor": {"sample_ratio": 0.1}}, "embedding_model"),
    ({"monitor": {"sample_ratio": 0.1, "embedding_model": "smol"}}, "not a served embedding model"),
])
def test_bad_tier_configs_name_the_problem(tiers, words):
    base = {"levels": [{"name": "small", "model": "smol", "max_complexity": 0.3}, {"name": "large", "model": "big"}]}
    with pytest.raises(ConfigError, match=words):
        parse_config({"models": MODELS, "tiers": {**base, **tiers}})


def test_the_gateway_side_resolves_aliases_explains_and_prices():
    tiering = Tiering(tiers_config(), rng=random.Random(0))
    decision = tiering.classify(CHAT, CODE, {}, lambda model: True)
    assert decision.tier.model == "big"  # the alias `large` resolved
    headers = tiering.headers(decision)
    assert headers["x-shunter-tier"] == "large" and "class=code" in headers["x-shunter-tier-reason"]
    assert decision.tier.cost(1000, 500) == pytest.approx(2.0) and tiering.top.cost(0, 1000) == pytest.approx(2.0)
    assert tiering.router.tiers[0].cost(1000, 1000) == pytest.approx(0.3)


@pytest.mark.parametrize("endpoint, headers, status", [("embedding", {}, 400), ("chat", {"x-shunter-tier": "huge"}, 400)])
def test_requests_the_tier_name_cannot_serve_are_refused_clearly(endpoint, headers, status):
    from shunter.errors import ApiError

    with pytest.raises(ApiError) as caught:
        Tiering(tiers_config()).classify(ENDPOINTS[endpoint], SIMPLE, headers, lambda model: True)
    assert caught.value.status == status


def test_the_monitor_samples_only_lower_tiers_at_its_ratio_and_promotes_through_the_gateway_side():
    tiering = Tiering(tiers_config(monitor={"sample_ratio": 0.5, "embedding_model": "minilm", "min_samples": 2,
                                            "agreement_threshold": 0.9}), rng=random.Random(1))
    small = tiering.classify(CHAT, SIMPLE, {}, lambda model: True)
    large = tiering.classify(CHAT, CODE, {}, lambda model: True)
    picks = [tiering.sampled(small) for _ in range(1000)]
    assert 400 < sum(picks) < 600 and not any(tiering.sampled(large) for _ in range(100))
    tiering.record_agreement(small, 0.5)
    tiering.record_agreement(small, 0.6)
    assert tiering.status()["promotions"] == {"simple": "large"}
    assert tiering.classify(CHAT, SIMPLE, {}, lambda model: True).reason == "promoted"


def test_the_judge_asks_both_tiers_greedily_at_its_own_length_then_the_embedding_model():
    import asyncio

    tiering = Tiering(tiers_config(monitor={"sample_ratio": 1, "embedding_model": "minilm"}))
    asked = []

    async def ask(model, endpoint, body):
        asked.append((model, endpoint, body))
        if endpoint is EMBEDDING:
            return {"data": [{"embedding": [1.0, 0.0]}, {"embedding": [1.0, 1.0]}]}
        return {"choices": [{"message": {"content": "Paris" if model == "smol" else "Paris."}}]}

    decision = tiering.classify(CHAT, SIMPLE, {}, lambda model: True)
    # A client's sampling choices (here: wild ones) never reach the comparison.
    body = {**SIMPLE, "model": "smol", "stream": True, "temperature": 2, "seed": 3, "max_tokens": 1,
            "logit_bias": {"9": 100}, "top_p": 0.1}
    agreement = asyncio.run(tiering.judge(decision, CHAT, body, ask))
    assert agreement == pytest.approx(0.7071, abs=1e-3)
    served, reference, (embed, _, vectors) = asked
    assert (served[0], reference[0], embed) == ("smol", "big", "minilm")
    for _, endpoint, question in (served, reference):
        assert endpoint is CHAT
        assert question == {"messages": SIMPLE["messages"], "model": question["model"], "temperature": 0,
                            "max_tokens": MONITOR_MAX_TOKENS}
    assert vectors["input"] == ["Paris", "Paris."]
