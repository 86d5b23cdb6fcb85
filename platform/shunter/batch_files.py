"""The Batch API's file contents, and a batch input file read into its lines.

`FileBlobs` keeps each uploaded file's bytes under its id: in a folder on the head node by default, or in an
object store (`s3://bucket/prefix`, `gs://...`) through Arrow's filesystem layer, the one model weights and
LoRA adapters come through (shunter.object_store), with credentials from the node's environment. A blob is
written to a temporary name and renamed into place on a local disk, so a reader never sees half a file; an
object store's put is whole by itself.

`read_input` turns a batch input file (JSONL, one request per line in OpenAI's shape: `custom_id`, `method`,
`url`, `body`) into its lines. What makes a whole file unusable fails the batch (not UTF-8, no lines, more
lines than allowed); a line that is not a request of the batch's endpoint becomes that line's error line,
and the other lines run.

A batch's results are written in OpenAI's line format: per input line, `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}` for an answer (in the output file when 200, else in
the error file), or `{"id", "custom_id", "response": null, "error": {"code", "message"}}` for a line that
never ran (not a request, cancelled, expired).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shunter.object_store import filesystem, is_remote

# The endpoints a batch may run (shunter.endpoints' names), by the `endpoint` a batch names: OpenAI's list
# (the Messages API has batches of its own shape, not this one).
BATCH_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                   "/v1/embeddings": "embedding", "/v1/responses": "responses"}


class FileBlobs:
    def __init__(self, root: str):
        """`root`: a local folder (`~` expanded, made on first use) or an `s3://` / `gs://` prefix."""
        self.remote = is_remote(root)
        if self.remote:
            self._fs, self._prefix = filesystem(root)
            self._prefix = self._prefix.rstrip("/")
        else:
            self._dir = Path(root).expanduser()
            self._dir.mkdir(parents=True, exist_ok=True)

    def put(self, file_id: str, content: bytes) -> None:
        if self.remote:
            with self._fs.open_output_stream(f"{self._prefix}/{file_id}") as out:
                out.write(content)
            return
        fd, staging = tempfile.mkstemp(dir=self._dir, prefix=f".{file_id}.")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(content)
            os.replace(staging, self._dir / file_id)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise

    def get(self, file_id: str) -> bytes:
        """The file's bytes; FileNotFoundError when there are none."""
        if self.remote:
            try:
                with self._fs.open_input_stream(f"{self._prefix}/{file_id}") as src:
                    return src.read()
            except OSError as exc:  # Arrow reports a missing object as an OSError of its own
                raise FileNotFoundError(file_id) from exc
        return (self._dir / file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        """Removes the file's bytes; nothing to remove is not an error (a delete retried)."""
        if self.remote:
            try:
                self._fs.delete_file(f"{self._prefix}/{file_id}")
            except (FileNotFoundError, OSError):
                pass
            return
        (self._dir / file_id).unlink(missing_ok=True)


class BatchInputError(ValueError):
    """A batch input file that cannot run at all; `code` is OpenAI's error code for it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class InputLine:
    line: int  # 1-based
    custom_id: str
    body: dict[str, Any] | None  # None: the line is not a usable request (`error` says why)
    error: dict[str, str] | None = None  # OpenAI's {"code", "message"}

    @property
    def valid(self) -> bool:
        return self.error is None


def read_input(content: bytes, endpoint_url: str, max_lines: int) -> list[InputLine]:
    """The lines of a batch input file for `endpoint_url` (`/v1/chat/completions`, ...). Blank lines are
    skipped (a trailing newline is not a request); the numbers are the file's own."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchInputError("invalid_file", f"the input file is not UTF-8 text (byte {exc.start})") from None
    numbered = [(i, raw) for i, raw in enumerate(text.splitlines(), start=1) if raw.strip()]
    if not numbered:
        raise BatchInputError("empty_file", "the input file has no requests")
    if len(numbered) > max_lines:
        raise BatchInputError("too_many_requests",
                              f"the input file has {len(numbered)} requests; a batch takes at most {max_lines}")
    seen: set[str] = set()
    lines = []
    for number, raw in numbered:
        lines.append(_read_line(number, raw, endpoint_url, seen))
    return lines


def _read_line(number: int, raw: str, endpoint_url: str, seen: set[str]) -> InputLine:
    def bad(code: str, message: str, custom_id: str = "") -> InputLine:
        return InputLine(number, custom_id, None, {"code": code, "message": f"line {number}: {message}"})

    try:
        item = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:
        return bad("invalid_json_line", f"not a JSON object ({exc})")
    if not isinstance(item, dict):
        return bad("invalid_json_line", "not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "`custom_id` must be a non-empty string")
    if len(custom_id) > 512:
        return bad("invalid_custom_id", "`custom_id` is longer than 512 characters", custom_id[:512])
    if custom_id in seen:
        return bad("duplicate_custom_id", f"`custom_id` {custom_id!r} is on an earlier line too", custom_id)
    seen.add(custom_id)
    if item.get("method") != "POST":
        return bad("invalid_method", "`method` must be \"POST\"", custom_id)
    if item.get("url") != endpoint_url:
        return bad("mismatched_url", f"`url` must be the batch's endpoint {endpoint_url!r}", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "`body` must be a JSON object", custom_id)
    return InputLine(number, custom_id, body)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def result_line(batch_id: str, line: int, custom_id: str, status: int, body: Any, request_id: str) -> dict[str, Any]:
    """The result of a line that was answered (any status)."""
    return {"id": _line_id(batch_id, line), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def error_line(batch_id: str, line: int, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The result of a line that never ran."""
    return {"id": _line_id(batch_id, line), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    """One JSON object a line; non-ASCII escaped, so a custom_id holding a lone surrogate still encodes."""
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def _line_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"
