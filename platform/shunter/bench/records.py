"""What one benchmark request measured; the shape every other bench module agrees on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request of a run. Times are seconds; `start_s` is relative to the run's start."""

    index: int
    start_s: float
    ok: bool
    status: int | None  # HTTP status; None when the request never got one (connection error, timeout)
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    head_s: float | None = None  # the response's status line (for a refusal: how long it took)
    # The request's last byte written to the connection. Before it, the time is the client's own (a client
    # sending 256 requests at once writes the last ones a second after it began them on a 2-core machine).
    written_s: float | None = None
    ttft_s: float | None = None  # first content token
    e2e_s: float | None = None  # last byte
    itl_s: list[float] = field(default_factory=list)  # gaps between successive content chunks
    replica: str | None = None  # the replica that answered, where the server says (Shunter's x-shunter-replica)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)  # result files from before `replica` load too: it has a default
