"""Where a backend's jobs run, from the judge's side: the third of the worker's three
parts (`attnref.conformance.worker` has the whole).

`Supervised` is the judge's handle on a worker process forked from the clean forkserver:
it reads every reply frame itself, with a deadline and a size limit (`receive_frame`),
kills a call that never answers, reports a worker that dies with its exit code or
signal, removes the worker's scratch folder when it stops, and starts a fresh worker for
the next call. `InProcess` runs the same jobs in a thread of the judge's own process
(``--in-process``): it then trusts the backend. `start_executor` picks the one a family
asks for (its own, for a family that spreads a call over several processes).
"""

import atexit
import contextlib
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

if sys.platform != "win32":  # (where no supervised worker runs)
    import fcntl

from attnref import _forkserver, _sandbox
from attnref._checking import audit_checking, checking_enabled
from attnref.conformance.declarations import (
    DEFAULT_API,
    Backend,
    BackendError,
    from_declaration,
)
from attnref.conformance.family import FAMILIES
from attnref.conformance.jobs import BackendDied, Job, Probe, Raised, Series, read_reply
from attnref.conformance.sandboxed import OUTPUT_FILE, SHOW_OUTPUT, handle, loader, serve
from attnref.conformance.wire import (
    Arena,
    decode,
    encode,
    encode_shared,
)
from attnref.interpreted import INTERPRETER_VARIABLE, INTERPRETERS, record

__all__ = [
    "Executor",
    "FrameError",
    "InProcess",
    "Meanwhile",
    "Supervised",
    "receive_frame",
    "start_executor",
    "start_forkserver",
]


#: the judge's own work to do while a job runs (`Executor.run`)
Meanwhile = Callable[[], None] | None


@runtime_checkable
class Executor(Protocol):
    """Runs jobs for one backend; ``slowest`` is its slowest answered job, in seconds;
    ``trusted``: whether the backend runs in the judge's own process; ``sandbox``: what
    confines its code (`Supervised.sandbox`)."""

    slowest: float
    trusted: bool
    backend: Backend
    sandbox: dict[str, dict[str, str]]

    def run(
        self, job: Job | Series | Probe | Any, timeout: float, meanwhile: Meanwhile = None
    ) -> Any:
        """What the job returns. Raises `Raised` (what the backend did wrong),
        `BackendDied`, ``TimeoutError`` after ``timeout`` seconds, or `InternalError`.
        ``meanwhile``: the judge's own work, done while the job runs where the executor
        can (a worker, in another process), else after it; it must not raise."""
        ...

    def close(self) -> None: ...


class InProcess:
    """Jobs in a daemon thread of this process; a job still running after its timeout is
    abandoned (the thread cannot be killed). The replies take the same path as a
    worker's (encoded, decoded), so every check holds, but the backend is trusted: its
    code runs in the judge's process."""

    trusted = True

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: nothing is enforced: the backend's code runs in the judge's process
        self.sandbox: dict[str, dict[str, str]] = {
            "enforced": {},
            "missing": {"all": "the backend runs in the judge's own process (--in-process)"},
            "allowed": {},
        }
        self.slowest = 0.0
        #: right outputs of earlier fresh_values calls, with their inputs' digests
        self.history: list[tuple[Tensor, str]] = []

    def run(self, job: Any, timeout: float, meanwhile: Meanwhile = None) -> Any:
        t0 = time.perf_counter()
        result: list[bytearray] = []
        message = decode(encode(job.message()))

        def target() -> None:
            result.append(handle(self.backend, message))

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        if meanwhile is not None:
            meanwhile()
        thread.join(max(0.0, timeout - (time.perf_counter() - t0)))
        if thread.is_alive():
            raise TimeoutError(f"no answer within {timeout:g} s")
        self.slowest = max(self.slowest, time.perf_counter() - t0)
        return read_reply(result[0])

    def close(self) -> None:
        pass


#: the socket buffers of a worker's connection: a case's tensors (megabytes at the long
#: sizes) then cross in a few large writes, not hundreds of the default's (about 200 KB),
#: each a switch between the two processes (a 10 MB round trip: 24 ms -> 9 ms)
PIPE_BUFFER = 4 << 20


def _widen(*conns: multiprocessing.connection.Connection) -> None:
    """Give the sockets of ``conns`` buffers of `PIPE_BUFFER` bytes (as far as the system
    allows: Linux caps them at ``net.core.wmem_max`` and ``rmem_max``); best effort."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=os.dup(conn.fileno()))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIPE_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PIPE_BUFFER)
            finally:
                sock.close()


#: the longest the judge blocks in one wait: the kernel hands a signal sent to the
#: judge's process (Ctrl-C, SIGTERM) to any of its threads, and one that went to
#: another (tqdm's monitor) runs its handler only when the main thread wakes: a judge
#: waiting on a hung worker outlived SIGINT by 30 s
WAKE = 0.5


def wake_poll(conn: Any, seconds: float) -> bool:
    """``conn.poll(seconds)``, waking every `WAKE` seconds so that a signal's handler
    runs (a KeyboardInterrupt raised) within that much of its arrival."""
    end = time.perf_counter() + seconds
    while True:
        left = end - time.perf_counter()
        if conn.poll(max(0.0, min(WAKE, left))):
            return True
        if left <= WAKE:
            return False


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the worker process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the backend's process was killed by {name} (signal {-code})"
    return f"the backend ended its process with exit code {code}"


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """The judge's ``__main__`` hidden while a worker starts: the worker needs only
    attnref, and multiprocessing would otherwise run the judge's script again there."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def start_forkserver() -> None:
    """Start the forkserver now, in the background of whatever the judge does next."""
    _forkserver.start()


class Supervised:
    """Jobs in a worker process behind the trust boundary, restarted after a crash or a
    timeout. The worker starts at once, before any case or oracle value exists.

    Args:
        backend: a spec (``module:function``, a built-in or ``mutant.NAME``), resolved in
            the worker only, its declaration read back as data (`backend`); or a `Backend`
            built by the caller, which the judge keeps (its declaration is the caller's)
            and the worker resolves by its ``spec``.
        api: the API family of a spec (default: sdpa; a built-in has its own).
        threads: torch intra-op threads in the worker.
        memory_limit: bytes of address space the worker may use (None: no limit).
        start_timeout: seconds the worker may take to import the backend.
        env: environment variables the worker sets (None: removes) first (a family's: the
            GPU of a rank).
        network: the worker may open sockets (a family whose processes talk to each
            other); its sandbox says so.
        unix: with ``network``, UNIX sockets too (NCCL's, on a GPU host); otherwise
            TCP only, and no pathname socket on the machine is in the worker's reach.
        jobs: modules the worker imports to take more kinds of job (`HANDLERS`: the
            bench's, ``attnref.bench.worker``).
        interpreter: the interpreter the worker sets up before it imports the backend
            (`attnref.interpreted`; default: what ``ATTNREF_INTERPRETER`` in the judge's
            environment names, else none). A backend given by its spec that declares
            one is restarted with it: its module is imported again, interpreted.

    Raises:
        BackendError: the worker could not resolve the backend (its message says why),
            or sent a declaration the audit does not accept.
    """

    trusted = False

    def __init__(
        self,
        backend: Backend | str,
        api: str | None = None,
        *,
        threads: int = 1,
        memory_limit: int | None = None,
        start_timeout: float = 300.0,
        env: dict[str, str | None] | None = None,
        network: bool = False,
        unix: bool = True,
        jobs: tuple[str, ...] = (),
        interpreter: str | None = None,
    ) -> None:
        self.spec = backend if isinstance(backend, str) else backend.spec or backend.name
        #: whether the declaration is the one the spec resolves to in a worker (another
        #: worker resolving the same spec declares the same: `attnref.conformance.judges`)
        self.from_spec = isinstance(backend, str)
        self.jobs = tuple(jobs)
        self.env = dict(env or {})
        try:
            self.policy = _sandbox.Policy.from_environment(network=network, unix=unix)
        except ValueError as e:
            raise BackendError(str(e)) from None
        #: what the worker's sandbox enforced, as its first frame said (before any code of
        #: the backend's ran): ``{"enforced": {part: how}, "missing": {part: why}, "allowed":
        #: {part: why}}``
        self.sandbox: dict[str, dict[str, str]] = {}
        if interpreter is None:
            interpreter = (
                os.environ.get(INTERPRETER_VARIABLE, "")
                if isinstance(backend, str)
                else backend.capabilities.interpreter
            )
        if interpreter and interpreter not in INTERPRETERS:
            raise BackendError(
                f"unknown interpreter {interpreter!r}: use one of {', '.join(INTERPRETERS)}"
            )
        self.interpreter = interpreter
        #: what the worker's interpreter said of itself before the backend loaded
        #: (`attnref.interpreted.prepare`): {} when it runs natively
        self.interpreted: dict[str, Any] = {}
        self._scratch: str | None = None
        self._lock: int | None = None  # a descriptor of the scratch folder, locked
        self.api = api if isinstance(backend, str) else backend.api
        self.threads = threads
        self.memory_limit = memory_limit
        self.start_timeout = start_timeout
        self.restarts = 0
        self.slowest = 0.0
        #: right outputs of earlier fresh_values calls, with their inputs' digests
        self.history: list[tuple[Tensor, str]] = []
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._arena = Arena()  # the file large jobs' tensors cross in, reused
        #: what the worker said of the backend's declaration (`sandboxed.UNDECLARED_TRITON`)
        self.notes: list[str] = []
        #: bytes the backend wrote to its stdout and stderr, and the last of them
        self.output_bytes = 0
        self._tail = b""
        declared = self._start()
        wanted = declared.capabilities.interpreter
        if self.from_spec and wanted and wanted != self.interpreter:
            # its module declares an interpreter: imported again, interpreted, in a new
            # worker (the interpreter is set up before the module's import)
            self._stop()
            self.interpreter = wanted
            declared = self._start()
        self.backend = declared if isinstance(backend, str) else backend

    def _start(self) -> Backend:
        ctx = _forkserver.context()  # a clean parent, never a fork of the judge
        parent, child = ctx.Pipe()
        _widen(parent, child)
        self._scratch, self._lock = _scratch_folder()
        _forkserver.start()  # running, so that its socket's folder is known to hide
        hidden = _hidden(self._scratch) if self.policy.network else ()
        policy = dataclasses.replace(self.policy, hidden=hidden, kept=_kept(hidden))
        process = ctx.Process(
            target=serve,
            args=(
                child,
                self.spec,
                self.api,
                self.threads,
                self.memory_limit,
                checking_enabled() and audit_checking(),  # as the audit's judge does
                loader(),
                self.env,
                self._scratch,
                policy,
                self.jobs,
                os.environ.get(SHOW_OUTPUT, "").strip() != "show",
                self.interpreter,
            ),
            daemon=True,
        )
        with _main_hidden():
            process.start()
        child.close()
        self._process, self._conn = process, parent
        try:
            if not wake_poll(parent, self.start_timeout):
                raise BackendError(f"{self.spec}: its worker did not start in time")
            self.sandbox, self.interpreted = _read_sandbox(
                receive_frame(parent, time.perf_counter(), DECLARATION_LIMIT), self.policy
            )
            if "error" in self.interpreted:
                raise BackendError(f"{self.spec}: {self.interpreted['error']}")
            if not wake_poll(parent, self.start_timeout):
                raise BackendError(
                    f"{self.spec}: its worker did not finish importing it within "
                    f"{self.start_timeout:g} s"
                )
            first = receive_frame(parent, time.perf_counter(), DECLARATION_LIMIT)
        except FrameError as e:
            self._stop()
            raise BackendError(f"{self.spec}: {e} as its declaration") from None
        except (EOFError, OSError):
            process.join(5)
            self._stop()
            raise BackendError(
                f"{self.spec}: its worker ended while importing it: "
                f"{_describe_exit(process.exitcode)}"
            ) from None
        except BackendError:
            self._stop()
            raise
        try:
            said = read_reply(first)
            if isinstance(said, dict) and isinstance(said.get("note"), str):
                self.notes.append(said.pop("note")[:500])
            if isinstance(said, dict) and "autotuned" in said:  # the worker's word, checked
                tuned = record({"autotuned": said.pop("autotuned")})
                self.interpreted = {**self.interpreted, **tuned}
            return from_declaration(said)
        except Raised as e:
            self._stop()
            error = e.error
            name = getattr(error, "type_name", type(error).__name__)
            text = str(error) if name == "BackendError" else f"{name}: {error}"
            raise BackendError(text) from None
        except (ValueError, TypeError) as e:
            self._stop()
            raise BackendError(f"{self.spec}: its worker sent a bad declaration: {e}") from None

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(Exception):
                if process.pid is not None:
                    os.killpg(process.pid, signal.SIGKILL)  # and whatever it started
            with contextlib.suppress(Exception):
                process.kill()
                process.join(5)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
        self._collect_output()
        scratch, self._scratch = self._scratch, None
        if scratch is not None:  # what the worker wrote: not a byte outlives it
            shutil.rmtree(scratch, ignore_errors=True)
            _SCRATCHES.discard(scratch)
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)

    def _collect_output(self) -> None:
        """Read what the worker wrote to its stdout and stderr since the last job
        (`sandboxed.OUTPUT_FILE`: the backend's bytes, untrusted), keep the last
        `OUTPUT_TAIL` of them and count the rest, and empty the file (the worker appends).
        A link or anything but a plain file there is not read: the judge reads no file
        the backend points it to."""
        if self._scratch is None:
            return
        path = os.path.join(self._scratch, OUTPUT_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                return
            os.lseek(fd, max(0, info.st_size - OUTPUT_TAIL), os.SEEK_SET)
            got = os.read(fd, OUTPUT_TAIL)
            os.ftruncate(fd, 0)
            self.output_bytes += info.st_size
            self._tail = (self._tail + got)[-OUTPUT_TAIL:]
        except OSError:
            return
        finally:
            os.close(fd)

    def output_tail(self) -> str:
        """The last `OUTPUT_TAIL` bytes the backend wrote to its stdout and stderr, as
        text (undecodable bytes replaced, control characters but newlines and tabs
        dropped: the backend's bytes reach a terminal only through this)."""
        text = self._tail.decode("utf-8", errors="replace")
        return "".join(c for c in text if c in "\n\t" or c.isprintable())

    def run(self, job: Any, timeout: float, meanwhile: Meanwhile = None) -> Any:
        # large tensors in a sealed file sent after the message, small ones in it
        message, fd = encode_shared(job.message(), self._arena)
        return read_reply(self.exchange(message, timeout, meanwhile, fd=fd))

    def exchange(
        self,
        message: bytes | bytearray,
        timeout: float,
        meanwhile: Meanwhile = None,
        fd: int | None = None,
    ) -> bytes | bytearray:
        """An encoded job in, the worker's reply out as it came: untrusted bytes, for
        `attnref.conformance.wire.decode` (``run`` decodes them; a relay forwards them).
        ``meanwhile`` runs here while the worker computes; ``timeout`` counts from the
        send, and a reply that came while ``meanwhile`` ran is read at once. ``fd``: the
        sealed file of `attnref.conformance.wire.encode_shared`, sent after the message
        and closed here.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds (the worker was killed).
            BackendDied: the worker's process ended.
        """
        if self._conn is None:
            self._start()
        conn = self._conn
        assert conn is not None
        # what the reply may hold: four times the job (its file's size included)
        limit = REPLY_SLACK + 4 * (len(message) + (0 if fd is None else os.fstat(fd).st_size))
        t0 = time.perf_counter()
        try:
            conn.send_bytes(message)
            if fd is not None:
                multiprocessing.reduction.send_handle(conn, fd, 0)  # (a pid: Windows')
        except OSError:  # the pipe broke: the worker is gone
            raise self._died() from None
        finally:
            if fd is not None:
                os.close(fd)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:  # its reply would be left in the pipe: end the worker
                self._stop()
                raise
        try:
            if not wake_poll(conn, max(0.0, timeout - (time.perf_counter() - t0))):
                self._stop()
                self.restarts += 1
                raise TimeoutError(f"no answer within {timeout:g} s (the worker was killed)")
            data = self._receive(conn, t0 + timeout, limit)
            # from the send: the judge's work meanwhile too, where it took longer
            self.slowest = max(self.slowest, time.perf_counter() - t0)
        except TimeoutError:
            raise
        except (EOFError, OSError):  # the pipe broke: the worker is gone
            raise self._died() from None
        self._collect_output()
        return data

    def _receive(self, conn: Any, deadline: float, limit: int) -> bytes | bytearray:
        """The worker's reply, read on the judge's clock with a size limit
        (`receive_frame`): a frame larger than the job allows, or one that stalls, ends
        the worker and is reported as what it is."""
        try:
            return receive_frame(conn, deadline, limit)
        except FrameError as e:
            self._stop()
            self.restarts += 1
            if e.stalled:  # a call that did not answer in time, as a hang is
                raise TimeoutError(f"{e} (the worker was ended)") from None
            raise BackendDied(f"{e} (the worker was ended)") from None

    def _died(self) -> BackendDied:
        """The worker's process ended (its pipe broke): it is stopped and counted."""
        process = self._process
        if process is not None:
            process.join(5)
        code = None if process is None else process.exitcode
        self._stop()
        self.restarts += 1
        return BackendDied(_describe_exit(code))

    def restart(self) -> None:
        """End the worker now; the next job starts a fresh one (nothing of the calls
        before it is left: its process, memory and scratch folder are new)."""
        self._stop()

    def close(self) -> None:
        self._stop()
        self._arena.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


#: how much of the backend's stdout and stderr the judge keeps (the last bytes)
OUTPUT_TAIL = 4096
#: what a reply may hold beyond four times its job's bytes: outputs, gradients and
#: caches come from the inputs and are no larger, but for a few shapes (many queries
#: against few keys of a tiny head dim)
REPLY_SLACK = 256 * 2**20
#: the largest declaration a worker may send (a few KiB in practice)
DECLARATION_LIMIT = 2**20
#: how fast a worker must write a reply once it has begun (bytes a second), after a
#: grace of `FRAME_GRACE` seconds past the call's deadline
FRAME_RATE = 100 * 2**20
FRAME_GRACE = 5.0


#: the scratch folders of this process's workers not yet removed: what is left of them
#: when the judge exits (a worker never closed) goes then; what a judge killed by
#: SIGKILL leaves, the next judge removes (`_sweep`)
_SCRATCHES: set[str] = set()
SCRATCH_PREFIX = "attnref-worker-"
#: a scratch folder younger than this is never swept: its judge may not have locked it yet
SWEEP_AGE = 60.0
_swept: set[str] = set()  # the temporary folders this process has swept


def _scratch_folder() -> tuple[str, int | None]:
    """A fresh scratch folder for a worker, and a descriptor of it that holds an
    exclusive ``flock`` for as long as this judge uses it. The kernel drops the lock
    when the judge ends however it ends (SIGKILL too), so an unlocked folder of ours is
    one whose judge is gone: the first worker a judge starts removes those (`_sweep`)."""
    _sweep(tempfile.gettempdir())
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    _SCRATCHES.add(scratch)
    if sys.platform == "win32":  # no flock: nothing is swept
        return scratch, None
    lock = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else holds it
    return scratch, lock


def _sweep(folder: str) -> list[str]:
    """Remove the scratch folders in ``folder`` that no live judge holds: ours (this
    user's), older than `SWEEP_AGE`, whose lock can be taken. Once per folder and
    process; returns what it removed."""
    if folder in _swept or sys.platform == "win32":
        return []
    _swept.add(folder)
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(SCRATCH_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                continue
            if time.time() - st.st_mtime < SWEEP_AGE:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live judge holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


@atexit.register
def _remove_scratches() -> None:
    for scratch in list(_SCRATCHES):
        shutil.rmtree(scratch, ignore_errors=True)
    _SCRATCHES.clear()


def _hidden(scratch: str) -> tuple[str, ...]:
    """The folders a worker that may open sockets must not see into: the judge's
    temporary folder (its scratch folder's; the worker keeps that one), where this
    judge's forkserver and any other judge's listen, each forking a process outside any
    sandbox for whoever connects; and this forkserver's folder, wherever it is."""
    folders = [os.path.dirname(scratch)]
    try:
        from multiprocessing import forkserver

        address = forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        address = None
    if isinstance(address, str):
        own = os.path.dirname(address)
        if os.path.commonpath([own, folders[0]]) != folders[0]:
            folders.append(own)
    return tuple(folders)


def _kept(hidden: tuple[str, ...]) -> tuple[str, ...]:
    """What a covered folder (`_hidden`) must still show the worker: the user's
    installation where it lies inside one (a virtual environment or a clone under
    ``$TMPDIR``): the Python prefixes, the interpreter's folder, every folder on
    ``sys.path`` and the working folder. Hiding is for the sockets there, never for the
    user's code. A needed path that is a covered folder itself (the working folder is
    ``$TMPDIR``) keeps that folder's entries instead, but for sockets, folders holding
    one (a forkserver's ``pymp-*``) and other workers' scratch folders."""
    folders = [os.path.realpath(f) for f in hidden]
    needed = {
        os.path.realpath(p or os.getcwd())
        for p in (
            sys.prefix,
            sys.exec_prefix,
            sys.base_prefix,
            os.path.dirname(sys.executable),
            os.getcwd(),
            *sys.path,
        )
    }
    kept: set[str] = set()
    for path in needed:
        if not os.path.exists(path):
            continue
        for folder in folders:
            if path == folder:
                kept.update(_entries_without_sockets(folder))
            elif os.path.commonpath([folder, path]) == folder and not any(
                os.path.commonpath([path, f]) == path for f in folders
            ):
                kept.add(path)
    # the outermost only: a path inside a kept one is kept with it
    return tuple(
        sorted(k for k in kept if not any(o != k and os.path.commonpath([o, k]) == o for o in kept))
    )


def _entries_without_sockets(folder: str) -> list[str]:
    """The entries of ``folder`` that are not sockets, hold none at their top, and are
    not a worker's scratch folder or a multiprocessing folder (``pymp-*``)."""
    found: list[str] = []
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except OSError:
        return found
    for entry in entries:
        if entry.name.startswith((SCRATCH_PREFIX, "pymp-")) or _is_socket(entry):
            continue
        if entry.is_dir(follow_symlinks=False):
            try:
                with os.scandir(entry.path) as inner:
                    if any(_is_socket(e) for e in inner):
                        continue
            except OSError:
                continue
        found.append(entry.path)
    return found


def _is_socket(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return True  # unreadable: not kept


def _read_sandbox(
    frame: bytes | bytearray, policy: _sandbox.Policy
) -> tuple[dict[str, dict[str, str]], dict[str, Any]]:
    """The worker's first frame (its sandbox, and its interpreter's check of itself,
    sent by attnref's code before the backend loaded), checked; what ``policy`` leaves
    open is listed as ``allowed``."""
    try:
        value = read_reply(frame)
    except Raised as e:
        raise BackendError(f"its worker could not enter its sandbox: {e.error}") from None
    try:
        interpreted = record(value.pop("interpreter", {}) if isinstance(value, dict) else {})
    except ValueError as e:
        raise BackendError(f"its worker sent a malformed interpreter record: {e}") from None
    parts = {}
    for key in ("enforced", "missing"):
        part = value.get(key) if isinstance(value, dict) else None
        if not isinstance(part, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in part.items()
        ):
            raise BackendError("its worker sent a malformed sandbox record")
        parts[key] = dict(part)
    parts["allowed"] = policy.allowed()
    return parts, interpreted


class FrameError(Exception):
    """A reply frame that announced more than it may hold, or stalled before it was
    whole (``stalled``; the worker's doing: its own process wrote it)."""

    def __init__(self, message: str, stalled: bool = False) -> None:
        super().__init__(message)
        self.stalled = stalled


def receive_frame(conn: Any, deadline: float, limit: int) -> bytes | bytearray:
    """One frame of ``multiprocessing.connection.Connection.send_bytes`` read from
    ``conn`` without trusting it: the length it announces (4 bytes, or -1 and 8 more) must
    be at most ``limit``, and the whole frame must arrive by ``deadline`` (a
    `time.perf_counter` reading) plus `FRAME_GRACE` seconds and its size at `FRAME_RATE`.
    Where the platform has no ``select`` on the pipe (Windows), ``conn.recv_bytes()``.

    Raises:
        FrameError: it announced more than ``limit``, or stalled (how much came of it).
        EOFError: the pipe closed (the worker is gone).
    """
    if os.name == "nt":  # pragma: no cover - select() takes sockets only there
        data: bytes = conn.recv_bytes()
        return data
    fd = conn.fileno()
    until = deadline + FRAME_GRACE
    (size,) = struct.unpack("!i", _exactly(fd, 4, until, "its header"))
    if size == -1:
        (size,) = struct.unpack("!Q", _exactly(fd, 8, until, "its header"))
    if size < 0 or size > limit:
        raise FrameError(
            f"its worker announced a reply of {size:,} bytes, more than the {limit:,} its "
            "job allows"
        )
    return _exactly(fd, size, until + size / FRAME_RATE, f"a reply of {size:,} bytes")


def _exactly(fd: int, n: int, until: float, what: str) -> bytearray:
    """``n`` bytes from ``fd`` by ``until``, read into one buffer."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = until - time.perf_counter()
        if left <= 0:
            raise FrameError(f"its worker sent {got:,} bytes of {what}, then nothing", True)
        if not select.select([fd], [], [], min(left, WAKE))[0]:
            continue  # awake every WAKE seconds, for a signal's handler
        read = os.readv(fd, [view[got:]])
        if read == 0:
            raise EOFError
        got += read
    return buf


def start_executor(
    backend: Backend | str,
    api: str | None = None,
    *,
    isolate: bool = True,
    threads: int = 1,
    memory_limit: int | None = None,
    world_size: int | None = None,
    require_sandbox: bool = False,
    jobs: tuple[str, ...] = (),
) -> "Executor":
    """Where ``backend``'s code will run, as its family says (`ApiFamily.executor`):
    by default one supervised worker (``isolate``) or a thread of this process.
    ``world_size``: the processes one call runs on, for a family that spreads a call
    over several (None: the family's default). A built-in name given without ``api`` is
    looked up here to find its family (our code: nothing of the backend's runs).

    ``require_sandbox``: a sandbox the platform does not wholly enforce is an error.
    ``jobs``: modules every worker imports to take more kinds of job (`Supervised`).

    Raises:
        BackendError: the backend cannot be resolved or started, ``world_size`` is
            given to a family that runs on one process, or ``require_sandbox`` is not met.
    """
    executor = _start_executor(backend, api, isolate, threads, memory_limit, world_size, jobs)
    missing = executor.sandbox.get("missing") or {}
    if require_sandbox and missing:
        executor.close()
        raise BackendError(
            "--require-sandbox: the backend's worker is not wholly confined: "
            + "; ".join(f"{part}: {why}" for part, why in missing.items())
        )
    return executor


def _start_executor(
    backend: Backend | str,
    api: str | None,
    isolate: bool,
    threads: int,
    memory_limit: int | None,
    world_size: int | None,
    jobs: tuple[str, ...] = (),
) -> "Executor":
    if isinstance(backend, Backend):
        api = backend.api
    elif api is None and ":" not in backend:
        api = loader()(backend, None).api
    family = FAMILIES.get(api or DEFAULT_API)
    if family is not None and family.executor is not None:
        made: Executor = family.executor(
            backend,
            api,
            isolate=isolate,
            threads=threads,
            memory_limit=memory_limit,
            world_size=world_size or family.world_size,
            jobs=jobs,
        )
        return made
    if world_size not in (None, 1):
        raise BackendError(
            f"world size {world_size}: the {api or DEFAULT_API!r} family runs each call on "
            "one process"
        )
    if isolate:
        return Supervised(backend, api, threads=threads, memory_limit=memory_limit, jobs=jobs)
    for module in jobs:  # the judge's own process takes them too
        importlib.import_module(module)
    made = InProcess(loader()(backend, api) if isinstance(backend, str) else backend)
    interpreter = made.backend.capabilities.interpreter or os.environ.get(INTERPRETER_VARIABLE)
    if interpreter:
        raise BackendError(
            f"{made.backend.name}: an interpreted kernel ({interpreter}) runs in a worker, "
            "which sets its interpreter up before its module is imported: audit it "
            "isolated (without --in-process)"
        )
    return made
