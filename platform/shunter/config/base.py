"""What every config section shares: strict models (unknown keys are errors, no NaN) and the name
patterns."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"


VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


def closest(value: str, known: Iterable[str]) -> str | None:
    """The known name `value` was most likely meant to be (for "did you mean" hints), or None."""
    hint = difflib.get_close_matches(value, sorted(known), n=1)
    return hint[0] if hint else None


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, values are checked on assignment."""

    # allow_inf_nan: NaN passes every bound (NaN > 0 and NaN < 0 are both false); no setting wants it.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)
