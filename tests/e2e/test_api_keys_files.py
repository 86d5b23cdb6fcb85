"""OpenAI's Files API on the keyed app, driven with the official `openai` client: a key's files are its own
(another key gets the same 404 as for an id that never existed), an upload past `batch.max_file_bytes` is a
413, a purpose other than `batch` a 400, and every malformed request a clear OpenAI-shaped error."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from shunter.auth import key_id

from .keyed_app import ADMIN, CHAT_ONLY, FULL, MAX_FILE_BYTES, TIMEOUT_S

pytestmark = pytest.mark.own_app

LINES = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}}).encode()
                 + b"\n" for i in range(3))


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


def _client(app: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def test_a_keys_file_is_its_own_from_upload_to_delete(app):
    mine, other = _client(app, FULL), _client(app, CHAT_ONLY)
    uploaded = mine.files.create(file=("requests.jsonl", LINES), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(LINES), "requests.jsonl", "batch")
    assert mine.files.retrieve(uploaded.id) == uploaded
    assert mine.files.content(uploaded.id).read() == LINES
    assert uploaded.id in [f.id for f in mine.files.list()]
    assert uploaded.id in [f.id for f in mine.files.list(purpose="batch", limit=1, order="desc")]
    # Another key learns nothing of it: not its content, not that it exists, and cannot delete it.
    for attempt in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                    lambda: other.files.delete(uploaded.id)):
        with pytest.raises(openai.NotFoundError) as hidden:
            attempt()
        assert hidden.value.body["code"] == "file_not_found"
    assert uploaded.id not in [f.id for f in other.files.list()]
    # An admin key sees every key's files, with their owner.
    every = httpx.get(f"{app}/admin/files", headers={"authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT_S).json()
    assert {"id": uploaded.id, "owner": key_id(FULL)}.items() <= next(
        f for f in every["data"] if f["id"] == uploaded.id).items()
    deleted = mine.files.delete(uploaded.id)
    assert deleted.id == uploaded.id and deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        mine.files.delete(uploaded.id)


def test_files_are_listed_a_page_at_a_time_newest_first(app):
    client = _client(app, FULL)
    ids = [client.files.create(file=(f"{i}.jsonl", LINES), purpose="batch").id for i in range(3)]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    rest = client.files.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    for file_id in ids:
        client.files.delete(file_id)


def test_an_upload_past_the_limit_or_for_another_purpose_is_refused(app):
    client = _client(app, FULL)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as other_purpose:
        client.files.create(file=("tune.jsonl", LINES), purpose="fine-tune")
    assert other_purpose.value.body["code"] == "invalid_purpose"
    with pytest.raises(openai.BadRequestError) as empty:
        client.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert empty.value.body["code"] == "empty_file"


@pytest.mark.parametrize(("headers", "content", "status", "code"), [
    ({"content-type": "application/json"}, b'{"purpose": "batch"}', 400, "invalid_content_type"),
    ({"content-type": "multipart/form-data; boundary=x"}, b"--x\r\nnot a part", 400, None),
    ({"content-type": "multipart/form-data; boundary=x"},
     b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--x--\r\n', 400, "missing_field"),
])
def test_a_malformed_upload_gets_a_clear_error(app, headers, content, status, code):
    answer = httpx.post(f"{app}/v1/files", headers={"authorization": f"Bearer {FULL}", **headers}, content=content,
                        timeout=TIMEOUT_S)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and (code is None or error["code"] == code)


def test_the_files_api_needs_a_client_key_and_checks_its_query(app):
    assert httpx.get(f"{app}/v1/files", timeout=TIMEOUT_S).status_code == 401
    assert httpx.get(f"{app}/v1/files", headers={"authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT_S).status_code == 403
    for query in ("limit=0", "limit=abc", "limit=1e3", "order=sideways"):
        answer = httpx.get(f"{app}/v1/files?{query}", headers={"authorization": f"Bearer {FULL}"}, timeout=TIMEOUT_S)
        assert answer.status_code == 400 and answer.json()["error"]["param"] in ("limit", "order"), (query, answer.text)
