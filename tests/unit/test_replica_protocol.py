"""What routers may read from a pending request: the prompt attribute its endpoint has, and route hints."""

from __future__ import annotations

from shunter.replica_protocol import Accepted, ReplicaRequest, RouteHint, find_hint

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_request_exposes_messages_only():
    request = ReplicaRequest(endpoint="chat", body={"messages": MESSAGES, "prompt": "stray"})
    assert hasattr(request, "messages") and request.messages == MESSAGES
    assert not hasattr(request, "prompt")


def test_completion_request_exposes_prompt_only():
    request = ReplicaRequest(endpoint="completion", body={"prompt": "once", "messages": MESSAGES})
    assert hasattr(request, "prompt") and request.prompt == "once"
    assert not hasattr(request, "messages")


def test_the_agent_apis_expose_their_conversation():
    """Ray's prefix router cannot route a request with neither attribute: it would wait out the queue."""
    messages = ReplicaRequest(endpoint="messages", body={"messages": MESSAGES, "max_tokens": 4})
    assert messages.messages == MESSAGES and not hasattr(messages, "prompt")
    responses = ReplicaRequest(endpoint="responses", body={"input": "once"})
    assert responses.prompt == "once" and not hasattr(responses, "messages")


def test_missing_fields_are_not_exposed():
    assert not hasattr(ReplicaRequest(endpoint="chat", body={}), "messages")
    assert not hasattr(ReplicaRequest(endpoint="completion", body={}), "prompt")


def test_embedding_request_exposes_neither():
    request = ReplicaRequest(endpoint="embedding", body={"input": "text"})
    assert not hasattr(request, "messages") and not hasattr(request, "prompt")


def test_embedding_request_with_a_prompt_key_still_exposes_no_prompt():
    assert not hasattr(ReplicaRequest(endpoint="embedding", body={"input": "x", "prompt": "y"}), "prompt")


def test_a_replica_request_is_a_route_hint():
    request = ReplicaRequest(request_id="q1", avoid=("r1",), endpoint="chat", body={"messages": MESSAGES})
    assert isinstance(request, RouteHint) and request.avoid == ("r1",) and request.pin is None


def test_find_hint_in_args_or_kwargs():
    hint = RouteHint(pin="r2")
    assert find_hint(("x", hint), {}) is hint
    assert find_hint((), {"hint": hint, "other": 1}) is hint
    request = ReplicaRequest(endpoint="completion", body={"prompt": "p"})
    assert find_hint([1, 2], {"request": request}) is request


def test_find_hint_without_one():
    assert find_hint(("x", Accepted("r1")), {"a": 1}) is None
    assert find_hint(None, None) is None
    assert find_hint((), {}) is None
