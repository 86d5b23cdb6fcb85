"""Batch input files read into lines (a bad line is its own error, a bad file fails the batch), and the
files' bytes kept whole."""

from __future__ import annotations

import json

import pytest

from shunter.batch_files import BatchInputError, FileBlobs, read_input

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def _line(custom_id, url=CHAT, method="POST", body=None):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body if body is not None else {"model": "m", "messages": []}})


def test_good_lines_are_requests_and_each_bad_line_says_why():
    content = "\n".join([
        _line("a"),
        "{not json",
        _line("b", url="/v1/embeddings"),
        _line("a"),
        _line("c", method="GET"),
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),
        _line("d", body=[1]),
        '{"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": {"temperature": NaN}}',
        "",
        _line("f"),
    ]).encode()
    lines = read_input(content, CHAT, max_lines=100)
    assert [(x.line, x.custom_id, x.valid) for x in lines] == [
        (1, "a", True), (2, "", False), (3, "b", False), (4, "a", False), (5, "c", False), (6, "", False),
        (7, "d", False), (8, "", False), (10, "f", True)]
    codes = [x.error["code"] for x in lines if not x.valid]
    assert codes == ["invalid_json_line", "mismatched_url", "duplicate_custom_id", "invalid_method",
                     "missing_custom_id", "invalid_body", "invalid_json_line"]
    assert lines[0].body == {"model": "m", "messages": []}
    assert all(x.error["message"].startswith(f"line {x.line}:") for x in lines if not x.valid)


@pytest.mark.parametrize(("content", "code"), [
    (b"", "empty_file"), (b"\n  \n", "empty_file"), (b"\xff\xfe{}", "invalid_file"),
    ("\n".join(_line(str(i)) for i in range(4)).encode(), "too_many_requests"),
])
def test_a_file_that_cannot_run_at_all_fails_the_batch(content, code):
    with pytest.raises(BatchInputError) as refused:
        read_input(content, CHAT, max_lines=3)
    assert refused.value.code == code


def test_blobs_are_kept_whole_read_back_and_deleted_twice_without_error(tmp_path):
    blobs = FileBlobs(str(tmp_path / "files"))
    blobs.put("file-1", b"x" * 1000)
    blobs.put("file-1", b"y" * 10)  # a retried upload replaces, whole
    assert blobs.get("file-1") == b"y" * 10
    assert [p.name for p in (tmp_path / "files").iterdir()] == ["file-1"], "no staging file left"
    blobs.delete("file-1")
    blobs.delete("file-1")
    with pytest.raises(FileNotFoundError):
        blobs.get("file-1")
