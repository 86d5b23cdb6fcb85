"""The load generator notes when each request's last byte went on the wire (`written_s`), so a refusal's
latency can be told apart from the client's own queue: a real socket, as httpx's trace sees one."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from shunter.bench.loadgen import LoadConfig, run_load
from shunter.bench.workloads import Session, Turn

pytestmark = pytest.mark.unit


class Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        body = b'{"error": {"message": "full", "code": "queue_full"}}'
        self.send_response(429)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_each_record_says_when_its_request_was_written_before_its_answer_came():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = LoadConfig(base_url=f"http://127.0.0.1:{server.server_port}/v1", model="m", concurrency=4,
                         max_requests=8, progress=False)
        records, _ = asyncio.run(run_load([Session(i, [Turn("hello", 0, 4)]) for i in range(8)], cfg))
    finally:
        server.shutdown()
    assert [r.status for r in records] == [429] * 8
    assert all(r.written_s is not None and 0 <= r.written_s <= r.head_s for r in records), \
        [(r.written_s, r.head_s) for r in records]
