"""`BatchService`: the Serve deployment that owns the Files and Batch APIs' records and bytes, and runs the
batches, on the Ray head node.

One replica, no CPU reserved, pinned to the head node like the usage ledger (shunter.deployments.ledger), so
a SQLite state file and a local files folder stay on one node across restarts (a KubeRay head pod's
persistent volume holds both). Gateways call it for every /v1/files request, with the caller's key id as
the owner: it never sees a key, and a key's files are invisible to every other key. The store's and the
blobs' calls run in a thread, so an upload being written never holds the replica's event loop.

The batches run here (shunter.deployments.batch.runner), started with the replica: a replica that replaces
one, or a redeployed app's, carries on every batch not yet ended. Their lines go through a gateway replica
(its `check_batch_lines` and `run_batch_line`, by the gateway deployment's handle), the path interactive
requests take.

An upload writes the bytes first, then the record: a file listed always has its bytes, and a failure in
between leaves only unlisted bytes. A delete removes the record first: a deleted file is gone from the
API at once, and its bytes follow.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from shunter.batch_files import BATCH_ENDPOINTS, FileBlobs
from shunter.batch_store import JobStore, new_id
from shunter.config.batch import BatchConfig
from shunter.deployments.batch.runner import BatchRunner, RunnerLimits
from shunter.deployments.ledger.deployment import head_node_options
from shunter.serve_plan import GATEWAY_DEPLOYMENT

log = logging.getLogger("ray.serve")

BATCH_OPTIONS = head_node_options("batch_service", 64)
WINDOWS = {"24h": 24 * 3600}  # OpenAI's completion windows


def refused(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    """A refusal, as data (an exception's class would not cross the handle whole): the gateway answers it."""
    return {"refused": {"status": status, "message": message, "param": param, "code": code}}


class GatewayLines:
    """The gateway deployment, as the runner calls it: by its handle, found once it exists (the app's
    deployments start together, the gateway maybe after this one)."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self._handle: Any = None

    def _gateway(self) -> Any:
        if self._handle is None:
            self._handle = serve.get_deployment_handle(GATEWAY_DEPLOYMENT, self.app_name)
        return self._handle

    async def check(self, owner: str, url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        return await self._gateway().check_batch_lines.remote(owner, url, bodies)

    async def run(self, owner: str, url: str, body: dict[str, Any], line_id: str) -> dict[str, Any]:
        response = self._gateway().run_batch_line.remote(owner, url, body, line_id)
        try:
            return await response
        except asyncio.CancelledError:  # the batch was cancelled: the gateway stops the line too
            response.cancel()
            raise


@serve.deployment
class BatchService:
    async def __init__(self, config: dict[str, Any]):
        """`config`: the config's `batch` section; its paths resolved here, on the head node."""
        cfg = BatchConfig.model_validate(config)
        self.store = JobStore(cfg.state)
        self.blobs = FileBlobs(cfg.files)
        log.info("batch files: records in %s, bytes in %s", "PostgreSQL" if not self.store.sqlite else cfg.state,
                 cfg.files)
        self.runner = BatchRunner(self.store, self.blobs, GatewayLines(serve.get_replica_context().app_name),
                                  RunnerLimits(cfg.max_lines, cfg.max_lines_in_flight, cfg.max_lines_in_flight_per_key))
        self._running = asyncio.get_running_loop().create_task(self.runner.run_forever())

    async def put_file(self, owner: str, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        file_id = new_id("file-")
        await asyncio.to_thread(self.blobs.put, file_id, content)
        stored = await asyncio.to_thread(self.store.add_file, owner, filename, purpose, len(content), file_id)
        return stored.to_openai()

    async def get_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """The file object; None when `owner` has no file of that id (or it was deleted), as below."""
        stored = await asyncio.to_thread(self.store.get_file, file_id, owner)
        return None if stored is None else stored.to_openai()

    async def list_files(self, owner: str | None, purpose: str | None, after: str | None, limit: int,
                         newest_first: bool) -> dict[str, Any]:
        """OpenAI's file list of `owner`'s files; None: every owner's, each file with its `owner` (the admin's)."""
        files, more = await asyncio.to_thread(self.store.list_files, owner, purpose, after, limit, newest_first)
        data = [f.to_openai() if owner is not None else {**f.to_openai(), "owner": f.owner} for f in files]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        stored = await asyncio.to_thread(self.store.get_file, file_id, owner)
        if stored is None:
            return None
        return await asyncio.to_thread(self.blobs.get, file_id)

    async def delete_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        if not await asyncio.to_thread(self.store.delete_file, file_id, owner):
            return None
        await asyncio.to_thread(self.blobs.delete, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches --------------------------------------------------------------------------------------

    async def create_batch(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
                           metadata: dict[str, str] | None) -> dict[str, Any]:
        """A new batch of `owner`'s input file; a refusal (`refused`) when the file is not theirs or not a
        batch input."""
        if endpoint not in BATCH_ENDPOINTS or completion_window not in WINDOWS:
            raise ValueError("the gateway checks endpoint and completion_window")
        stored = await asyncio.to_thread(self.store.get_file, input_file_id, owner)
        if stored is None:
            return refused(404, f"No such File object: {input_file_id}", "input_file_id", "file_not_found")
        if stored.purpose != "batch":
            return refused(400, f"file {input_file_id} has purpose {stored.purpose!r}; a batch's input file is "
                           "uploaded with purpose `batch`", "input_file_id", "invalid_file_purpose")
        batch = await asyncio.to_thread(self.store.create_batch, owner, input_file_id, endpoint, completion_window,
                                        WINDOWS[completion_window], metadata)
        self.runner.wake()
        return batch.to_openai()

    async def get_batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        batch = await asyncio.to_thread(self.store.get_batch, batch_id, owner)
        return None if batch is None else batch.to_openai()

    async def list_batches(self, owner: str | None, after: str | None, limit: int) -> dict[str, Any]:
        batches, more = await asyncio.to_thread(self.store.list_batches, owner, after, limit)
        data = [b.to_openai() if owner is not None else {**b.to_openai(), "owner": b.owner} for b in batches]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    async def cancel_batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        """The batch, now cancelling (its running lines are stopped, and no new one starts); None when
        `owner` has no such batch; a refusal (409) when it has ended or is writing its results."""
        if await asyncio.to_thread(self.store.get_batch, batch_id, owner) is None:
            return None
        if await asyncio.to_thread(self.store.set_status, batch_id, "cancelling", ("validating", "in_progress")):
            self.runner.wake()
        batch = await asyncio.to_thread(self.store.get_batch, batch_id, owner)
        assert batch is not None
        if batch.status in ("cancelling", "cancelled"):
            return batch.to_openai()
        return refused(409, f"batch {batch_id} is {batch.status}; only a batch still validating or in progress "
                       "can be cancelled", None, "batch_not_cancellable")

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
