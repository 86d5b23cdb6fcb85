"""Pydantic errors turned into lines that name the field path and the fix (no URLs, no raw dumps)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from shunter.config.base import closest


def format_config_error(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: `path: what is wrong (got X); fix`. No pydantic URLs, no raw dumps."""
    lines = [f"invalid Shunter config ({exc.error_count()} problem{'s' if exc.error_count() > 1 else ''}):"]
    for err in exc.errors(include_url=False):
        loc = _loc_to_path(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(root, err["loc"][:-1])
            key = str(err["loc"][-1])
            hint = closest(key, allowed)
            fix = f"did you mean {hint!r}?" if hint else f"allowed keys here: {', '.join(allowed)}"
            lines.append(f"  {loc}: unknown key; {fix}")
        elif kind == "missing":
            lines.append(f"  {loc}: required field is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            secret = any(part in ("key_env", "key_file") for part in err["loc"])  # a misplaced key, maybe
            shown = "" if isinstance(got, dict | list) or secret else f" (got {got!r})"
            lines.append(f"  {loc or '(top level)'}: {msg}{shown}")
    return "\n".join(lines)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("int", "literal['auto']", "str", "none"):  # union branch names add nothing
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc`, by walking the model classes (list indexes skipped)."""
    cls: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return []
        cls = _section_class(field.annotation)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return sorted(cls.model_fields)
    return []


def _section_class(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", None)
    if args:  # list[ModelConfig] and friends
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return annotation
