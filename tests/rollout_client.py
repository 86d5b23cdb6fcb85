"""Rollout test helpers shared by tests/integration and tests/e2e: steady load from client threads, and
the admin API calls `shunter rollout` makes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Load:
    """Clients in threads sending until stopped, half of it streamed; each client holds a conversation
    (the `user` field) for five requests, then starts the next."""

    base: str
    model: str
    clients: int = 4
    max_tokens: int | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self, client: int) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                stream = n % 2 == 0
                body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": f"hello number {n} from {client}"}],
                        "stream": stream, "user": f"client-{client}-{n // 5}"}
                if self.max_tokens:
                    body.update(max_tokens=self.max_tokens, temperature=0)
                result: dict[str, Any] = {"conversation": body["user"], "stream": stream}
                try:
                    if stream:
                        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                            text = "".join(resp.iter_text())
                        result.update(status=resp.status_code, whole="data: [DONE]" in text and '"error"' not in text)
                    else:
                        resp = http.post("/v1/chat/completions", json=body)
                        result.update(status=resp.status_code, whole=resp.status_code == 200)
                    result["version"] = resp.headers.get("x-shunter-version")
                except httpx.HTTPError as exc:
                    result.update(status=None, whole=False, error=repr(exc))
                self.results.append(result)

    def failures(self) -> list[dict[str, Any]]:
        """Requests not answered whole; a load that sent nothing is itself a failure (so `not failures()`
        never passes without traffic)."""
        if not self.results:
            return [{"status": None, "whole": False, "error": "the load sent no request"}]
        return [r for r in self.results if r["status"] != 200 or not r["whole"]]

    def start(self) -> list[threading.Thread]:
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self.threads:
            t.start()
        return self.threads

    def answered(self, count: int, timeout_s: float = 120) -> None:
        """Returns once `count` more requests have been answered (or failed) than when called."""
        wanted, deadline = len(self.results) + count, time.monotonic() + timeout_s
        while len(self.results) < wanted:
            assert time.monotonic() < deadline, f"the load got {len(self.results)} answers, not {wanted}"
            time.sleep(0.1)

    def finish(self, timeout_s: float = 120) -> None:
        """Stop sending and wait for every request in flight to end, so `results` holds them all."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a client never finished its last request"

    def conversations(self) -> dict[str, list[str | None]]:
        seen: dict[str, list[str | None]] = {}
        for r in self.results:
            seen.setdefault(r["conversation"], []).append(r["version"])
        return seen


def start_rollout(base: str, model: str, to: str, **overrides: Any) -> dict[str, Any]:
    resp = httpx.post(f"{base}/admin/rollouts/{model}", json={"to": to, **overrides}, timeout=30)
    assert resp.status_code == 202, resp.text
    return resp.json()


def wait_done(base: str, model: str, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{base}/admin/rollouts/{model}", timeout=30).json()
        if status["rollout"] and status["rollout"]["phase"] == "done":
            return status
        time.sleep(1)
    raise AssertionError(f"rollout not done after {timeout_s}s: {status}")


def timeline(status: dict[str, Any]) -> str:
    """The rollout's history as `shunter rollout status` prints it: time, phase, weights, reason, gates."""
    from shunter.cli.rollout import event_line

    rollout = status["rollout"]
    return "\n".join(event_line(rollout, e) for e in rollout["history"])
