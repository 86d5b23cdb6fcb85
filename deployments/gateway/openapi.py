"""The gateway's OpenAPI document (`GET /openapi.json`), from the models that really validate.

Each API's request body is described by the schema of the very model the gateway validates it with:
vLLM's own request model, named by the endpoint's descriptor (shunter.endpoints); the admin bodies by
their own typed models (shunter.deployments.gateway.admin_schema). There is no second, hand-written
schema to drift from what is accepted, and the schema fuzzers exercise exactly what the engine takes.
The routes read their bodies themselves (so size limits hold before parsing and every error keeps the
API's envelope), hence each route's `requestBody` is added here rather than inferred by FastAPI.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from shunter.deployments.gateway.admin_schema import ADMIN_BODIES
from shunter.endpoints import ENDPOINTS, Endpoint

BEARER = "bearer"
_REF = "#/components/schemas/{model}"


def schema_name(endpoint: Endpoint) -> str:
    """The components name of an endpoint's request body: its model's class name."""
    return endpoint.request_model.rpartition(":")[2]


def request_body(body: Endpoint | type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is an API's request (or an admin body), with a key."""
    name = schema_name(body) if isinstance(body, Endpoint) else body.__name__
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=name)}}}},
            "security": [{BEARER: []}]}


def add_components(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the request models and the bearer scheme to a generated OpenAPI document. A model that defines
    a sub-model of the same name differently from one already added (vLLM has a few) keeps its own under
    prefixed names."""
    components = schema.setdefault("components", {})
    schemas: dict[str, Any] = components.setdefault("schemas", {})
    bodies = [(schema_name(e), e.validator.json_schema) for e in ENDPOINTS.values()]
    bodies += [(m.__name__, m.model_json_schema) for m in ADMIN_BODIES]
    for name, generate in bodies:
        body = generate(ref_template=_REF)
        defs = body.pop("$defs", {})
        if any(k in schemas and schemas[k] != v for k, v in defs.items()):
            body = generate(ref_template=_REF.replace("{model}", f"{name}.{{model}}"))
            defs = {f"{name}.{k}": v for k, v in body.pop("$defs", {}).items()}
        schemas.update(defs)
        schemas[name] = body
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http", "scheme": "bearer",
        "description": "An API key from auth.keys (/v1) or auth.admin_keys (/admin), when keys are configured."}
    return schema
