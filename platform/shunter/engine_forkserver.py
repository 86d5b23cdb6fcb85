"""Engine processes forked from a node's pre-imported server instead of spawned (issue 41).

Why: vLLM starts every engine the same way on CPU: the replica imports vLLM and torch, then *spawns* the
engine core (which imports them again), which spawns each worker (again). On a 2-core machine each import
is 6-8 s, so two thirds of a replica's start is the same modules loaded three times. vLLM forces spawn in a
Ray actor (forking a process with Ray's threads is unsafe) and on its CPU platform (libgomp in a child of a
process that ran a parallel region deadlocks).

What: one server per node and Ray session, a plain single-threaded Python process that has imported the
engine core's and the workers' modules and never runs torch, holds no Ray state and no OpenMP pool. A
replica asks it for its engine core; the server forks a child that runs vLLM's own engine-core entry point
with the replica's environment, output files and niceness, and that child forks its workers (it is neither
a Ray actor nor past a parallel region, so fork is safe there, as on vLLM's GPU default). The first replica
on a node starts the server (its imports overlap the replica's own); every later one finds it ready.

What stays as with spawn:
- Each engine runs on its own cores with its own thread count. The OpenMP runtime read its variables when
  the server loaded torch, from the server's environment; vLLM binds a worker by setting them just before
  it starts one. So every process forked below the server applies the ones its own environment names
  (shunter.openmp_env): unbound, two engines ran two threads each on two cores and all but stalled.
- The replica sees its engine core as a process object (`ForkedProcess`): vLLM's own process manager
  watches its sentinel (the server writes the exit code to the replica's connection when the child ends),
  so an engine core's death is still detected and the replica replaced.
- A replica that dies, even by SIGKILL, closes its connection: the server kills its engine core's whole
  process group (the core and its workers), as Ray kills a dead worker's children.
- The server lives as long as the raylet that started its first replica (or the process, outside Ray).

Trust: the socket sits in a directory only this user may enter, and the server checks each peer's uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import importlib
import logging
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shunter import openmp_env

log = logging.getLogger(__name__)

# What an engine core and its CPU workers import, and what a model replica imports of vLLM to configure its
# engine and serve it (shunter.worker_fork forks replicas too); loading them once, here, is the whole point.
PRELOAD = ("torch", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.v1.engine.async_llm", "vllm.engine.arg_utils", "vllm.entrypoints.launchers.cli_args",
           "vllm.entrypoints.launchers.api_server.app_state")
START_TIMEOUT_S = 180.0  # a first server imports the modules above: ~6-8 s on 2 cores, minutes on a cold disk
_HEADER = struct.Struct("!I")


# ---- framing ----------------------------------------------------------------------------------------------

def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = pickle.dumps(message)
    frame = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame[:_HEADER.size]], fds)
        sock.sendall(frame[_HEADER.size:])
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
        if not head:
            raise EOFError("connection closed")
        head += _recv_exact(sock, _HEADER.size - len(head))
    else:
        head, fds = _recv_exact(sock, _HEADER.size), []
    (size,) = _HEADER.unpack(head)
    return pickle.loads(_recv_exact(sock, size)), list(fds)


# ---- where a node's server is -----------------------------------------------------------------------------

def session_pid() -> int:
    """The process the server's life is bound to: the raylet when this is a Ray worker (Ray names it in
    every worker's environment; a worker forked by the server is not the raylet's child), else this
    process."""
    if os.environ.get("RAY_RAYLET_PID", "").isdigit():
        return int(os.environ["RAY_RAYLET_PID"])
    try:
        import psutil

        parent = psutil.Process(os.getppid())
        if "raylet" in parent.name():
            return parent.pid
    except Exception:  # noqa: BLE001 - no psutil or the parent is gone: bind to ourselves
        pass
    return os.getpid()


def server_address(session_pid: int) -> Path:
    """The socket of the server for `session_pid` and this interpreter: another Ray session or another
    virtual environment on the same machine gets a server of its own."""
    directory = Path(tempfile.gettempdir()) / f"shunter-forkserver-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.stat().st_uid != os.getuid() or directory.stat().st_mode & 0o077:
        raise PermissionError(f"{directory} must belong to this user alone (mode 0700)")
    key = hashlib.sha256(f"{sys.executable}\0{session_pid}".encode()).hexdigest()[:16]
    return directory / f"{key}.sock"


# ---- the client side: what vLLM's process manager holds ----------------------------------------------------

class ForkedProcess:
    """An engine core forked by the node's server, with the members vLLM's process manager uses of a
    `multiprocessing.Process` (start, sentinel, exitcode, is_alive, join, terminate, kill)."""

    def __init__(self, address: Path, target: Any, name: str, kwargs: dict[str, Any],
                 env: dict[str, str] | None = None):
        self.address, self.target, self.name, self.kwargs = address, target, name, kwargs
        self.env = env or {}  # set in the child over this process's environment
        self.pid: int | None = None
        self.daemon = True
        self._sock: socket.socket | None = None
        self._exitcode: int | None = None

    def start(self) -> None:
        sock = connect(self.address, START_TIMEOUT_S)
        request = {"target": (self.target.__module__, self.target.__qualname__), "kwargs": self.kwargs,
                   "name": self.name, "env": {**os.environ, **self.env}, "cwd": os.getcwd(),
                   "nice": os.getpriority(os.PRIO_PROCESS, 0)}
        sys.stdout.flush()
        sys.stderr.flush()
        _send(sock, request, [1, 2])  # the child writes where this process writes (Ray's log files)
        sock.settimeout(START_TIMEOUT_S)
        reply, _ = _recv(sock)
        sock.settimeout(None)
        if "error" in reply:
            sock.close()
            raise RuntimeError(f"the engine fork server could not start {self.name}: {reply['error']}")
        self.pid, self._sock = reply["pid"], sock

    @property
    def sentinel(self) -> int:
        assert self._sock is not None, "not started"
        return self._sock.fileno()

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and self._sock is not None:
            self._poll(0)
        return self._exitcode

    def _poll(self, timeout: float | None) -> None:
        import select

        assert self._sock is not None
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return
        try:
            reply, _ = _recv(self._sock)
            self._exitcode = int(reply["exitcode"])
        except (EOFError, OSError, KeyError, pickle.UnpicklingError):
            self._exitcode = -signal.SIGKILL  # the server itself is gone, and with it the child
        self._sock.close()

    def is_alive(self) -> bool:
        return self.pid is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._sock is not None and self._exitcode is None:
            self._poll(timeout)

    def _signal(self, signum: int) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)  # type: ignore[arg-type]

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        if self._sock is not None and self._exitcode is None:
            self._sock.close()


class ForkContext:
    """Stands in for the multiprocessing context vLLM starts its engine cores from."""

    def __init__(self, address: Path):
        self.address = address
        self.made: list[ForkedProcess] = []  # what it made, for the engine to name its processes

    def Process(self, target: Any, name: str = "EngineCore", kwargs: dict[str, Any] | None = None,  # noqa: N802
                **_: Any) -> ForkedProcess:
        # Its workers are forked from it, not spawned: nothing in a child of the server ran a parallel region.
        process = ForkedProcess(self.address, target, name, kwargs or {}, {"VLLM_WORKER_MULTIPROC_METHOD": "fork"})
        self.made.append(process)
        return process

    def Queue(self, *_: Any, **__: Any) -> Any:  # noqa: N802
        raise NotImplementedError("a multiprocessing queue cannot reach a forked engine core; this engine "
                                  "must start its processes by spawn (engine.process_start: spawn)")


def connect(address: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(address))
    sock.settimeout(None)
    return sock


def node_server() -> ForkContext:
    """The fork context of this node's server, starting the server when none answers (one starter at a
    time: the others wait on a lock, then find it). Returns at once: the first fork waits for the imports."""
    session = session_pid()
    address = server_address(session)
    with open(address.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            connect(address, 5.0).close()
        except OSError:
            for stale in (address, ready_marker(address)):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            _launch(address, session)
    return ForkContext(address)


def ready_marker(address: Path) -> Path:
    """The file the server at `address` writes once its modules are imported. It binds before it imports,
    so a request made meanwhile waits in the socket's backlog; this says whether one would wait."""
    return address.with_suffix(".ready")


def _launch(address: Path, session: int) -> None:
    """Start the server detached (its own session, so a signal to the replica's group spares it) and wait
    until it listens; it binds before it imports, so that takes a moment, not the imports. Its own log is
    beside its socket; what the engines it forks print goes to their replicas' files."""
    import subprocess

    with open(address.with_suffix(".log"), "ab") as out:
        # --detach: it forks itself and the first process exits at once, so the server is nobody's child
        # here; Ray kills what a replica leaves behind when it exits, and the server must outlive its
        # first replica.
        subprocess.run([sys.executable, "-m", "shunter.engine_forkserver", "--detach", str(address), str(session)],
                       start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out, close_fds=True,
                       check=True, timeout=30)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if address.exists():
            return
        time.sleep(0.05)
    raise RuntimeError(f"the engine fork server did not bind {address} within 30 s")


# ---- the server ---------------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the server) dies, however it dies (Linux's PR_SET_PDEATHSIG).
    Its replica then sees its engine core gone and is replaced; nothing is left computing unowned."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # it died before the line above
        os._exit(1)


@dataclass
class _Child:
    pid: int
    conn: socket.socket
    pidfd: int


class ForkServer:
    """The node's server: accepts fork requests, watches each child and each requester."""

    def __init__(self, address: Path, session_pid: int):
        self.address = address
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(address))
        os.chmod(address, 0o600)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, _Child] = {}  # by pid
        self.session_fd = os.pidfd_open(session_pid)

    def preload(self, modules: tuple[str, ...] = PRELOAD) -> None:
        """Imports `modules` with Ray kept out. Importing ray builds Ray's native configuration from this
        process's environment, once and for all, and a Ray worker forked from here (shunter.worker_fork)
        must build it from its own: its job id is there. vLLM imports ray only to offer its Ray executor and
        does without it; a module that recorded it missing (its global `ray` is None) is dropped afterwards,
        so a child that needs it imports it afresh, with Ray."""
        if "ray" in sys.modules:
            raise RuntimeError("ray is imported already: a Ray worker forked from here would run on this "
                               "process's Ray configuration")
        sys.modules["ray"] = None  # type: ignore[assignment] # an import of ray fails as if not installed
        gc.disable()  # no collection frees holes into the pages the children will share
        try:
            for module in modules:
                importlib.import_module(module)
        finally:
            gc.enable()
            del sys.modules["ray"]
            for name, loaded in list(sys.modules.items()):
                # vars(), not getattr: a lazy package (transformers) would import on a missing attribute
                if loaded is not None and getattr(loaded, "__dict__", {}).get("ray", False) is None:
                    del sys.modules[name]
                    parent, _, leaf = name.rpartition(".")
                    if parent in sys.modules:
                        vars(sys.modules[parent]).pop(leaf, None)

    def serve(self) -> None:
        self.watch()
        while self.handle(self.selector.select()):
            pass

    def watch(self) -> None:
        """Listen for requests, and for the session's end."""
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        self.selector.register(self.session_fd, selectors.EVENT_READ, ("session", None))

    def handle(self, events: list[tuple[selectors.SelectorKey, int]]) -> bool:
        """One batch of ready events; False once the session has ended.

        A child's two events can be ready at once (its requester closed as it exited). Settling the first
        settles the child, so the second is stale and skipped. Nothing one child does may end the server,
        since every engine on the node dies with it (`PR_SET_PDEATHSIG`): a failure is logged, and the
        server serves on."""
        for key, _ in events:
            kind, child = key.data
            if kind == "session":
                self._stop()
                return False
            if child is not None and self.children.get(child.pid) is not child:
                continue  # settled earlier in this batch
            try:
                if kind == "accept":
                    self._accept()
                elif kind == "exited":
                    self._reap(child)
                elif kind == "requester":
                    self._requester_gone(child)
            except Exception:  # noqa: BLE001 - logged; the other engines on the node keep running
                log.exception("handling %s%s failed; serving on", kind, f" of pid {child.pid}" if child else "")
        return True

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                raise PermissionError(f"uid {uid} may not fork engines here")
            conn.settimeout(30.0)
            request, fds = _recv(conn, max_fds=2)
            conn.settimeout(None)
        except Exception:  # noqa: BLE001 - a probe, a stranger or a broken request: drop it
            conn.close()
            return
        try:
            pid = self._fork(request, fds, conn)
        except Exception as exc:  # noqa: BLE001 - told to the requester
            _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        child = _Child(pid, conn, os.pidfd_open(pid))
        self.children[pid] = child
        _send(conn, {"pid": pid})
        self.selector.register(child.pidfd, selectors.EVENT_READ, ("exited", child))
        self.selector.register(conn, selectors.EVENT_READ, ("requester", child))
        log.info("forked %s as pid %d", request.get("name"), pid)

    def _fork(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> int:
        module, qualname = request["target"]
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        # Everything here so far is left out of the child's collections: a full collection would walk
        # (and, writing each object's gc header, copy) every page of the imports: seconds on 2 cores.
        gc.freeze()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the child: nothing of the server's may stay open in it
            self.listener.close()
            conn.close()
            self.selector.close()
            os.close(self.session_fd)
            for other in self.children.values():
                other.conn.close()
                os.close(other.pidfd)
            for signum in (signal.SIGTERM, signal.SIGINT):  # the server's own handlers are not the engine's
                signal.signal(signum, signal.SIG_DFL)
            os.setsid()  # its own process group: the server kills the core and its workers together
            _die_with_parent()  # a server killed outright (OOM) takes its engines: none runs on unowned
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            os.environ.clear()
            os.environ.update(request["env"])
            openmp_env.adopt()  # the threads and cores its requester's environment names, not the server's
            os.chdir(request["cwd"])
            import multiprocessing

            multiprocessing.current_process().name = request["name"]  # what vLLM's log lines are tagged with
            if request["nice"] > os.getpriority(os.PRIO_PROCESS, 0):
                os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
            target(**request["kwargs"])
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported on the replica's own stderr
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _reap(self, child: _Child) -> None:
        try:
            _, status = os.waitpid(child.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped already: its status is gone with it
            code = -signal.SIGKILL
        self._forget(child)
        with contextlib.suppress(OSError):
            _send(child.conn, {"exitcode": code})
        child.conn.close()

    def _requester_gone(self, child: _Child) -> None:
        """Its replica's connection is readable: nothing is sent after the request, so this is its close
        (it ended, or died): its engine goes with it."""
        try:
            if child.conn.recv(1, socket.MSG_DONTWAIT):
                return  # stray bytes: ignored
        except BlockingIOError:
            return
        except OSError:
            pass
        self._kill(child)

    def _kill(self, child: _Child) -> None:
        """The child's whole process group (the engine core and the workers it forked), then its exit code
        to the requester, if it still listens."""
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(child.pid, signal.SIGKILL)
        self._reap(child)

    def _forget(self, child: _Child) -> None:
        if self.children.pop(child.pid, None) is None:
            return
        self.selector.unregister(child.pidfd)
        self.selector.unregister(child.conn)
        os.close(child.pidfd)

    def _stop(self) -> None:
        """The session ended: every engine still here goes, then the server."""
        for child in list(self.children.values()):
            self._kill(child)
        self.listener.close()
        for path in (self.address, ready_marker(self.address)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def main(argv: list[str] | None = None) -> int:
    """`python -m shunter.engine_forkserver [--detach] ADDRESS SESSION_PID [MODULE,MODULE...]`: the
    modules to preload default to PRELOAD (another list is for tests); --detach returns at once and leaves
    the server running as an orphan."""
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["--detach"]:
        args = args[1:]
        if os.fork():  # a fresh interpreter with no threads yet: forking it is safe
            os._exit(0)
    address, session = args[:2]
    preload = tuple(args[2].split(",")) if len(args) > 2 and args[2] else PRELOAD
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forkserver %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the replicas, which drain
    server = ForkServer(Path(address), int(session))
    signal.signal(signal.SIGTERM, lambda *_: (server._stop(), sys.exit(0)))
    started = time.monotonic()
    server.preload(preload)
    # Every process forked below the server (an engine core's workers too) takes the OpenMP settings its
    # environment names: the runtime the server loaded read the server's environment, once.
    os.register_at_fork(after_in_child=openmp_env.adopt)
    ready_marker(Path(address)).touch()
    log.info("ready: %s imported in %.1f s", ", ".join(preload), time.monotonic() - started)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
