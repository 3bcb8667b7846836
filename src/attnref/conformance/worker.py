"""Where backend code runs: a supervised worker process behind a trust boundary.

The process that judges (draws cases, computes the oracle, writes the report, decides the
exit code) never runs a line of backend code. A backend under audit may do anything to
the process it runs in: exit, segfault, hang, patch torch, register ``atexit`` hooks,
start threads, return objects that run code when read. So:

- The backend's module is imported in the worker only. The worker is forked from a
  forkserver, a clean interpreter that has imported torch and attnref and nothing else
  (spawned where there is no forkserver), never from the judge, which holds cases and
  expected outputs. Its first message is the backend's declaration, as plain data
  (`attnref.conformance.backends.declaration`), which the judge validates.
- Everything crosses as data through `attnref.conformance.wire`: jobs one way; outputs,
  errors (type name, message, traceback text) and verdicts of the worker's own checks
  the other. Nothing is unpickled.
- The worker checks, around each call, that the backend left its inputs as it got them
  (bit for bit, but for the arguments it may write, `Job.writable`), snapshots the output
  the moment the call returns, and, when the backend left a thread running (or the job
  asks, `Job.recheck`), reads the output again a moment later: a backend still writing
  after it returned is caught, and its thread named.

Before it loads the backend, the worker enters a sandbox (`attnref._sandbox`, Linux):
it writes only in a scratch folder of its own, which the judge removes when the worker
stops; it opens no socket, signals no process outside it, and everything it starts ends
with it. Its first frame, sent before any code of the backend's runs, says what the
platform enforced (`Supervised.sandbox`); docs/untrusted.md has the threat model.

`Supervised` is the judge's handle on such a worker: a call that never answers is killed
after its timeout, a worker that dies is reported with its exit code or signal, and a
fresh worker serves the next call. `InProcess` runs the same jobs in a thread of the
judge's own process (``--in-process``, for debugging with pdb or a profiler): it then
trusts the backend.

The worker is three modules, as the trust boundary cuts it, and this one names them all:

- `attnref.conformance.jobs`: the jobs (`Job`, `Series`, `Probe`) and the verdicts that
  come back (`Raised`, `BackendDied`, ..., `read_reply`, `outcome`): plain data both ways;
- `attnref.conformance.sandboxed`: what runs in the worker's process, behind the
  sandbox (its loop `serve`, the job handlers, the input check and the snapshot);
- `attnref.conformance.executors`: the judge's side (`Supervised`, `InProcess`, the
  frames it reads, `start_executor`).
"""

from attnref.conformance.executors import (
    DECLARATION_LIMIT,
    FRAME_GRACE,
    FRAME_RATE,
    PIPE_BUFFER,
    REPLY_SLACK,
    Executor,
    FrameError,
    InProcess,
    Meanwhile,
    Supervised,
    receive_frame,
    start_executor,
    start_forkserver,
)
from attnref.conformance.jobs import (
    BackendDied,
    InternalError,
    Job,
    LateWrite,
    ModifiedInputs,
    Probe,
    Raised,
    RemoteError,
    Series,
    Unaccepted,
    error_reply,
    outcome,
    read_reply,
    series_outcomes,
)
from attnref.conformance.sandboxed import (
    HANDLERS,
    Loader,
    handle,
    invoke_backend,
    loader,
    rewrite,
    serve,
    set_loader,
    snapshot,
)

__all__ = [
    "DECLARATION_LIMIT",
    "FRAME_GRACE",
    "FRAME_RATE",
    "HANDLERS",
    "PIPE_BUFFER",
    "REPLY_SLACK",
    "BackendDied",
    "Executor",
    "FrameError",
    "InProcess",
    "InternalError",
    "Job",
    "LateWrite",
    "Loader",
    "Meanwhile",
    "ModifiedInputs",
    "Probe",
    "Raised",
    "RemoteError",
    "Series",
    "Supervised",
    "Unaccepted",
    "error_reply",
    "handle",
    "invoke_backend",
    "loader",
    "outcome",
    "read_reply",
    "receive_frame",
    "rewrite",
    "series_outcomes",
    "serve",
    "set_loader",
    "snapshot",
    "start_executor",
    "start_forkserver",
]
