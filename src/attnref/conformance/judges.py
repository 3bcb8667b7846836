"""More judges: an audit's (property, dtype) searches shared among processes, one per core.

An audit is almost all judging (drawing cases, the float64 oracle, comparisons): its
backend's calls are a sixth of its time or less, and one judge keeps one core busy. Each
search is seeded from the audit's seed, its property and its dtype alone
(`attnref.conformance.runner.property_seed`), so it finds, shrinks and reports the same
whichever process runs it, and in whatever order (for a backend whose answers depend on
its inputs alone: one with state sees the calls of its own worker only). `Judges`
starts ``n`` more judge processes, each with a supervised worker of its own for the
backend (its own sandbox, the same spec resolved there); every judge, the audit's own
process included, takes the next search from one shared counter, and the helpers send
each result back.

The helpers are the judge's code, not the backend's: they are forked from the workers'
forkserver (torch and attnref imported already), end when it ends (it ends with the
audit: `attnref._forkserver_init`), and each ends its own worker as the audit's process
does. What crosses from a helper is a `PropertyResult` the audit trusts as its own.
"""

import contextlib
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnref._checking import audit_checking, set_checking
from attnref._dies_with_parent import die_with_parent
from attnref.conformance.calls import TIMED_OUT
from attnref.conformance.executors import WAKE
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import get_property
from attnref.conformance.report import PropertyResult

__all__ = ["Judges", "Setup", "wait_after_timeout"]


def wait_after_timeout(timeout: float, slowest: float) -> float:
    """How long a judge waits for each call after its backend's first timeout: ten times
    the slowest answer it has had (``slowest``, seconds), at least 1 s, at most
    ``timeout``; one rule for the audit's own process and its helpers."""
    return min(timeout, max(1.0, 10 * slowest))


@dataclass(frozen=True)
class Setup:
    """What a helper judge needs to run searches as the audit's own process does."""

    spec: str  # the backend, resolved by each helper's own worker
    api: str | None
    work: tuple[tuple[str, torch.dtype], ...]  # the (property, dtype) searches, in order
    device: str
    profile: Profile
    seed: int
    timeout: float
    threads: int
    memory_limit: int | None
    require_sandbox: bool
    budget: float | None  # seconds each search may take (`run_property`'s ``budget``)
    deadline: float | None  # seconds left of the audit's deadline when the helper starts


#: the helper's executor, for `_terminate` (None in the audit's own process)
_executor: Any = None


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM in a helper (the audit stops: a deadline, ``--fail-fast``): end its worker
    and the helper itself, here. An exception raised from a signal handler would land
    wherever Python happened to be, in a gc callback or a ``__del__`` among them, where
    Python prints it and goes on: the helper would not stop, and a clean run would show a
    traceback. What the helper had not sent is lost either way (`Judges.close`)."""
    try:
        if _executor is not None:
            _executor.close()
    finally:
        os._exit(0)


def _take(counter: Any, total: int, stop: Any) -> int | None:
    """The next search's index, or None when every search is taken or the audit stops."""
    if stop.is_set():
        return None
    with counter.get_lock():
        i = int(counter.value)
        if i >= total:
            return None
        counter.value = i + 1
    return i


def _helper(
    conn: Any, counter: Any, stop: Any, setup: Setup, run_property: Callable[..., PropertyResult]
) -> None:
    """A helper judge's life: a worker of its own, then searches (``run_property``, the
    runner's, handed over so that this module needs no import of it) until none is left.
    Messages to the audit: ``("take", i)``, ``("result", i, result, note)``, and last
    ``("done", None)`` or ``("failed", why)``."""
    from attnref.conformance.worker import start_executor

    global _executor
    die_with_parent()  # the forkserver, which ends with the audit
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the audit's to handle
    signal.signal(signal.SIGTERM, _terminate)
    executor = None
    try:
        start = time.perf_counter()
        stop_at = None if setup.deadline is None else start + setup.deadline
        executor = start_executor(
            setup.spec,
            setup.api,
            threads=setup.threads,
            memory_limit=setup.memory_limit,
            require_sandbox=setup.require_sandbox,
        )
        _executor = executor
        backend = executor.backend
        torch.set_num_threads(setup.threads)
        if not audit_checking():
            set_checking(False)
        wait = setup.timeout
        while (i := _take(counter, len(setup.work), stop)) is not None:
            conn.send(("take", i))
            prop, dtype = setup.work[i]
            result = run_property(
                backend,
                get_property(prop),
                dtype,
                device=setup.device,
                profile=setup.profile,
                seed=setup.seed,
                timeout=wait,
                executor=executor,
                stop_at=stop_at,
                budget=setup.budget,
            )
            note = None
            if result.message.startswith(TIMED_OUT) and wait == setup.timeout:
                wait = wait_after_timeout(setup.timeout, executor.slowest)
                note = f"later calls of this judge wait at most {wait:.3g} s"
            conn.send(("result", i, result, note))
        conn.send(("done", None))
    except BaseException as e:  # attnref's own failure: the audit runs this judge's share
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(e).__name__}: {e}"))
    finally:
        _executor = None
        if executor is not None:
            executor.close()
        conn.close()


class Judges:
    """``n`` helper judges sharing ``setup.work`` with the audit's own process, each
    running its searches with ``run`` (`attnref.conformance.runner.run_property`).

    The audit takes searches with `take` and runs them itself; `results` hands over what
    the helpers finished, as ``(index, result, note)``. A helper that ended without
    finishing its search (killed, out of memory) gives that search back: `take` returns
    it to the audit's process, so nothing is lost.
    """

    def __init__(self, n: int, setup: Setup, run: Callable[..., PropertyResult]) -> None:
        from attnref import _forkserver

        ctx = _forkserver.context()
        self.total = len(setup.work)
        self._counter = ctx.Value("q", 0)
        self._stop = ctx.Event()
        self._returned: list[int] = []  # searches a helper took and never finished
        self.failures: list[str] = []  # why a helper could not judge
        self._helpers: list[tuple[Any, Any, list[int | None]]] = []
        try:
            self._start(ctx, n, setup, run)
        except BaseException:  # none left running: the audit goes on without them
            self.close()
            raise

    def _start(self, ctx: Any, n: int, setup: Setup, run: Callable[..., PropertyResult]) -> None:
        from attnref.conformance.executors import _main_hidden

        for _ in range(n):
            mine, theirs = ctx.Pipe(duplex=False)
            # not a daemon: a daemon may not start the worker it needs
            args = (theirs, self._counter, self._stop, setup, run)
            process = ctx.Process(target=_helper, args=args)
            with _main_hidden():  # the caller's script is not run again there
                process.start()
            theirs.close()
            self._helpers.append((process, mine, [None]))  # [the search it runs]

    def take(self) -> int | None:
        """The next search for the audit's own process (one a helper gave back first),
        or None when none is left to take now."""
        if self._returned and not self._stop.is_set():
            return self._returned.pop(0)
        return _take(self._counter, self.total, self._stop)

    def busy(self) -> bool:
        """Whether a helper may still send something (a result, or a search given back)."""
        return any(not c.closed for _, c, _ in self._helpers)

    def results(self, block: bool = False) -> list[tuple[int, PropertyResult, str | None]]:
        """Every result the helpers have sent and the audit has not read, as ``(index,
        result, note)``, read until no pipe has more; ``block``: first wait until some
        helper has said something. Called once more before `close`, so that a result
        that came in time is kept."""
        got: list[tuple[int, PropertyResult, str | None]] = []
        # blocking, it wakes every WAKE seconds: a signal handed to another thread of
        # the judge's runs its handler only when this one wakes
        timeout = WAKE if block else 0
        heard = False
        while live := {c: (p, c, now) for p, c, now in self._helpers if not c.closed}:
            ready = multiprocessing.connection.wait(list(live), timeout=timeout)
            if not ready and block and not heard:
                continue
            if not ready:
                break
            heard = True
            for conn in ready:
                self._read(*live[conn], got)
            timeout = 0
        return got

    def _read(
        self,
        process: Any,
        conn: Any,
        now: list[int | None],
        got: list[tuple[int, PropertyResult, str | None]],
    ) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # gone without a word: its search is given back
            conn.close()
            process.join(5)
            if now[0] is not None:
                self._returned.append(now[0])
                self.failures.append(
                    f"a helper judge ended (exit code {process.exitcode}) in the middle of "
                    "a search; the audit's own process ran it again"
                )
            return
        kind = message[0]
        if kind == "take":
            now[0] = message[1]
        elif kind == "result":
            now[0] = None
            got.append((message[1], message[2], message[3]))
        else:  # "done" or "failed": it takes no more
            if kind == "failed":
                self.failures.append(f"a helper judge stopped: {message[1]}")
            conn.close()
            process.join(5)

    def stop(self) -> None:
        """No search is taken after this; searches running in the helpers go on."""
        self._stop.set()

    def close(self) -> None:
        """End every helper now (what they were running is lost) and their workers."""
        self._stop.set()
        for process, _, _ in self._helpers:
            if process.is_alive():
                process.terminate()  # SIGTERM: it closes its worker on the way out
        for process, conn, _ in self._helpers:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
            if not conn.closed:
                conn.close()
