"""`shunter batch`: OpenAI's Batch API from the command line, through the official `openai` client.

`submit FILE --endpoint URL` uploads a JSONL file of requests and creates a batch of it (`--wait`: watch it
to its end with a progress bar); `status ID` shows a batch (`--wait` likewise); `results ID` writes its
output and error files; `cancel ID` and `list` do what they say. The batch runs in the cluster: stopping
this command changes nothing, and `status` picks it up again. The client key comes from $SHUNTER_API_KEY
(never a flag: flags end up in shell history and process lists), the gateway from --url or $SHUNTER_URL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0


def add_parser(sub: Any) -> None:
    batch = sub.add_parser("batch", help="OpenAI's Batch API: submit a JSONL file of requests, watch it, fetch "
                           "its results (runs in the cluster, on idle capacity)")
    actions = batch.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="upload FILE and create a batch of it")
    _common(submit)
    submit.add_argument("file", type=Path, help="JSONL, one request a line: custom_id, method, url, body")
    submit.add_argument("--endpoint", required=True, choices=ENDPOINTS, help="what every line calls")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="a metadata pair (up to 16)")
    submit.add_argument("--wait", action="store_true", help="watch the batch to its end with a progress bar")
    submit.set_defaults(func=_submit)
    status = actions.add_parser("status", help="a batch's status and request counts")
    _common(status)
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="watch the batch to its end with a progress bar")
    status.set_defaults(func=_status)
    results = actions.add_parser("results", help="a batch's output (and error) lines")
    _common(results)
    results.add_argument("batch_id")
    results.add_argument("--out", type=Path, help="write the output lines here (default: standard output)")
    results.add_argument("--errors", type=Path, help="write the error lines here (default: standard error)")
    results.set_defaults(func=_results)
    cancel = actions.add_parser("cancel", help="stop a batch: its running lines stop, the rest end as "
                                "batch_cancelled")
    _common(cancel)
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=_cancel)
    listing = actions.add_parser("list", help="this key's batches, newest first")
    _common(listing)
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(func=_list)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("SHUNTER_URL", DEFAULT_URL),
                        help=f"the gateway (default $SHUNTER_URL or {DEFAULT_URL})")


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=os.environ.get("SHUNTER_API_KEY") or "none",
                         max_retries=2, timeout=120)


def _calling(what: str, call: Any) -> Any:
    """The call's answer, or the gateway's error message as the command's exit."""
    import openai

    try:
        return call()
    except openai.APIStatusError as exc:
        error = exc.body.get("message") if isinstance(exc.body, dict) else None
        raise SystemExit(f"{what}: {exc.status_code}: {error or exc.message}") from None
    except openai.APIConnectionError as exc:
        raise SystemExit(f"{what}: cannot reach the gateway: {exc}") from None


def _submit(args: argparse.Namespace) -> int:
    metadata = {}
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--metadata {pair!r}: give KEY=VALUE")
        metadata[key] = value
    if not args.file.is_file():
        raise SystemExit(f"{args.file}: no such file")
    client = _client(args.url)
    with args.file.open("rb") as content:
        uploaded = _calling("upload", lambda: client.files.create(file=(args.file.name, content), purpose="batch"))
    batch = _calling("create the batch", lambda: client.batches.create(
        input_file_id=uploaded.id, endpoint=args.endpoint, completion_window="24h", metadata=metadata or None))
    print(f"batch {batch.id} created from {args.file} ({uploaded.bytes} bytes, file {uploaded.id})")
    if args.wait:
        return _watch(client, batch.id)
    print(f"watch it: shunter batch status {batch.id} --wait")
    return 0


def _status(args: argparse.Namespace) -> int:
    client = _client(args.url)
    if args.wait:
        return _watch(client, args.batch_id)
    _print(_calling("status", lambda: client.batches.retrieve(args.batch_id)))
    return 0


def _watch(client: Any, batch_id: str) -> int:
    """A progress bar of the lines done until the batch ends; 0 when it completed."""
    from tqdm import tqdm

    batch = _calling("status", lambda: client.batches.retrieve(batch_id))
    with tqdm(total=batch.request_counts.total if batch.request_counts else 0, unit="line",
              desc=batch.status, dynamic_ncols=True) as bar:
        while True:
            counts = batch.request_counts
            if counts is not None:
                bar.total = counts.total
                bar.n = counts.completed + counts.failed
                bar.set_postfix(failed=counts.failed, refresh=False)
            bar.set_description(batch.status, refresh=False)
            bar.refresh()
            if batch.status in ENDED:
                break
            time.sleep(POLL_S)
            batch = _calling("status", lambda: client.batches.retrieve(batch_id))
    _print(batch)
    return 0 if batch.status == "completed" else 1


def _print(batch: Any) -> None:
    counts = batch.request_counts
    done = f"{counts.completed} completed, {counts.failed} failed of {counts.total}" if counts else "no lines yet"
    print(f"{batch.id}: {batch.status} ({done}); endpoint {batch.endpoint}")
    if batch.output_file_id or batch.error_file_id:
        print(f"  output file {batch.output_file_id or '-'}, error file {batch.error_file_id or '-'}: "
              f"shunter batch results {batch.id}")
    for error in (batch.errors.data if batch.errors and batch.errors.data else []):
        print(f"  error {error.code}: {error.message}")


def _results(args: argparse.Namespace) -> int:
    client = _client(args.url)
    batch = _calling("status", lambda: client.batches.retrieve(args.batch_id))
    if batch.status not in ENDED:
        raise SystemExit(f"{batch.id} is {batch.status}: its results are written when it ends "
                         f"(shunter batch status {batch.id} --wait)")
    for file_id, path, stream in ((batch.output_file_id, args.out, sys.stdout),
                                  (batch.error_file_id, args.errors, sys.stderr)):
        if file_id is None:
            continue
        content = _calling("results", lambda f=file_id: client.files.content(f).read())
        if path is not None:
            path.write_bytes(content)
        else:
            stream.write(content.decode())
            stream.flush()
    return 0


def _cancel(args: argparse.Namespace) -> int:
    client = _client(args.url)
    _print(_calling("cancel", lambda: client.batches.cancel(args.batch_id)))
    return 0


def _list(args: argparse.Namespace) -> int:
    client = _client(args.url)
    page = _calling("list", lambda: client.batches.list(limit=args.limit))
    for batch in page.data:
        _print(batch)
    return 0
