"""Error bodies are OpenAI-shaped and never carry pydantic's raw dump."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from shunter.errors import error_body, validation_error_body


class _Req(BaseModel):
    model: str
    max_tokens: int


def test_shape_and_types():
    body = error_body("nope", 404, param="model", code="model_not_found")
    assert body == {"error": {"message": "nope", "type": "not_found_error", "param": "model",
                              "code": "model_not_found"}}
    assert error_body("x", 400)["error"]["type"] == "invalid_request_error"
    assert error_body("x", 429)["error"]["type"] == "rate_limit_error"
    assert error_body("x", 503)["error"]["code"] == 503


def test_validation_errors_name_fields_without_dump():
    try:
        _Req.model_validate({"max_tokens": "many"})
    except ValidationError as exc:
        body = validation_error_body(exc)
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert "model: Field required" in err["message"] and "max_tokens" in err["message"]
    assert "pydantic" not in err["message"] and "input_value" not in err["message"]
    assert err["param"] in ("model", "max_tokens")
