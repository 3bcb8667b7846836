"""The ``context-parallel`` family: attention with the sequence split across the ranks of a
torch.distributed process group (ring attention, all-gather, Ulysses; docs/distributed.md).

A function of the family is called on every rank with that rank's shard of the
sequence: ``fn(q, k, v, *, group, causal=False, softmax_scale=None,
sharding="contiguous", return_lse=False)`` (``window_size``, ``softcap`` and ``sinks``
where declared), ``(B, T_local, h, D)`` tensors, every position global
(`attnref.distributed` has the layout and three references). Returns the rank's shard
of the output ``(B, T_local, h, Dv)``, and ``lse (B, h, T_local)`` with ``return_lse``.

How the audit runs it: the judge stays one process, and starts one supervised worker per
rank (`RankGroup`, the family's executor), each behind the trust boundary. The workers
form their own process group (gloo on the CPU, NCCL on CUDA) at a port the judge picks;
every call of a case is cut into the ranks' shards by the judge, each rank's worker
calls the backend with its shard and the group (`ApiFamily.invoke` here), and the judge
puts the shards of the output, the LSE and the gradients back together and judges them
as one dense call, against the single-device float64 oracle with the usual bounds,
search and shrinking. A rank that raises, hangs or dies fails the case with its rank
named; the group is then started again, so the audit goes on, and closing it kills every
rank's process.

Everything of the family is here: the convention, the executor, the preset
(`CONTEXT_PARALLEL`), the built-in backends (the three references), the properties only
sharded calls can have and the class-30 mutants.
"""

import contextlib
import json
import math
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from jaxtyping import Float
from torch import Tensor

from attnref import distributed as D
from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context, agree_grads, law
from attnref.conformance.declarations import Backend, BackendError, Capabilities
from attnref.conformance.families.flash import flash_back, flash_layout
from attnref.conformance.family import ApiFamily, Arguments, pair, variant_kwargs
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import close
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property, some_variants
from attnref.conformance.strategies import case_strategy
from attnref.conformance.verdicts import Failure, Skip, one_line
from attnref.conformance.wire import encode
from attnref.conformance.worker import (
    BackendDied,
    Job,
    Meanwhile,
    Probe,
    Raised,
    RemoteError,
    Series,
    Supervised,
    Unaccepted,
    read_reply,
)

__all__ = ["CONTEXT_PARALLEL", "FAMILY", "Launch", "RankGroup", "launched", "serve_rank"]

NAME = "context-parallel"
#: the ranks an audit starts when ``--world-size`` names none
DEFAULT_WORLD = 4
#: the ``context-parallel`` family's preset: the convention of docs/variants.md, self-
#: attention (one sequence, queries and keys alike), causal by global position, no mask,
#: the LSE through ``return_lse``; no variants, no dropout
CONTEXT_PARALLEL = Capabilities(
    family=NAME,
    bool_mask=False,
    float_mask=False,
    causal_alignments=("top_left", "bottom_right"),  # one and the same when Tq = Tk
    self_attention_only=True,
    dropout=False,
    zero_head_dim=False,
    lse=True,
)


# ----------------------------------------------------------------- the convention


def _build(caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]) -> Arguments:
    """The whole sequence's call, ``(B, T, h, D)`` tensors and the keywords; the executor
    cuts it into the ranks' shards. A dense case runs on every rank, sharded zigzag when
    causal (the layout that balances causal work) and contiguous otherwise; a property
    of the family picks the world size (``_world``) and the sharding itself."""
    if inputs.attn_mask is not None:
        raise Skip("attn_mask: the context-parallel convention takes no mask")
    if inputs.query.shape[-2] != inputs.key.shape[-2]:
        raise Skip("Tq != Tk: context-parallel attention is one sequence's self-attention")
    kwargs: dict[str, Any] = {
        "causal": inputs.causal is not None,
        "softmax_scale": inputs.scale,
        "sharding": _sharding(caps, inputs),
    }
    kwargs.update(variant_kwargs(caps, inputs))
    if inputs.window is not None:
        kwargs["window_size"] = inputs.window
    if lse:
        kwargs["return_lse"] = True
    kwargs.update(overrides)
    args = tuple(flash_layout(t, inputs) for t in (inputs.query, inputs.key, inputs.value))
    return args, kwargs


def _sharding(caps: Capabilities, inputs: Inputs) -> str:
    """A dense case's sharding (`sharding_for`)."""
    return sharding_for(caps, inputs.query.shape[-2], inputs.causal is not None)


def sharding_for(caps: Capabilities, T: int, causal: bool) -> str:
    """The sharding of a call of ``T`` tokens: zigzag when causal, contiguous otherwise,
    of those declared (`Capabilities.cp_shardings`); with equal chunks declared,
    contiguous for an odd length, which no zigzag cuts evenly."""
    want = "zigzag" if causal else "contiguous"
    if caps.cp_equal_shards and T % 2:
        want = "contiguous"
    return want if want in caps.cp_shardings else caps.cp_shardings[0]


def fitted_world(caps: Capabilities, T: int, world: int, sharding: str) -> int | None:
    """The world size a call of length ``T`` runs at, ``world`` asked, inside the
    declaration: with `Capabilities.cp_equal_shards`, the largest at most ``world`` that
    cuts ``T`` into equal chunks (only ``world`` itself with `cp_full_group`); None when
    there is none (the call is outside the declaration)."""
    if not caps.cp_equal_shards:
        return world
    for w in range(world, 0 if not caps.cp_full_group else world - 1, -1):
        if T % D.chunk_count(w, sharding) == 0:
            return w
    return None


def _outside(caps: Capabilities, T: int, world: int, sharding: str) -> Skip:
    how = "at the world size started (cp_full_group)" if caps.cp_full_group else "at any world size"
    return Skip(
        f"T = {T} cuts into no equal {sharding} chunks {how} up to {world}: "
        "equal shards only declared (cp_equal_shards)"
    )


def _read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    """The whole sequence's output ``(B, T, h, Dv)`` (and LSE ``(B, h, T)``), as the
    executor put it together, in the audit's layouts."""
    first, lse_out = pair(out, "return_lse=True") if lse else (out, None)
    shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
    B, h, T = math.prod(shape[:-3]), shape[-3], shape[-2]
    if isinstance(first, Tensor):
        if tuple(first.shape) != (B, T, h, shape[-1]):
            raise Failure(f"returned shape {tuple(first.shape)}, expected {(B, T, h, shape[-1])}")
        first = first.transpose(1, 2).reshape(shape)
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (B, h, T):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected {(B, h, T)}"
            )
        lse_out = lse_out.reshape(shape[:-1])
    return first, lse_out


def _native_causal(caps: Capabilities, inputs: Inputs) -> bool:
    return inputs.causal is not None


# ------------------------------------------------------------- in each rank's worker

#: this worker's process group: (port, the subgroups of the first n ranks, by n)
_GROUP: dict[str, Any] = {}


def _group(
    rank: int, ranks: int, where: tuple[str, int], timeout: float, world: int, cuda: bool
) -> Any:
    """The subgroup of the first ``world`` of the ``ranks`` ranks, the process group
    joined first (at ``where``, an address and port; every rank makes every subgroup, in
    one order)."""
    addr, port = where
    if _GROUP.get("port") != where:
        if dist.is_initialized():
            dist.destroy_process_group()
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # shorter than the judge's timeout: a rank waiting for a peer that hangs answers
        # with an error of its group first, and the hung one is found out (a subgroup
        # has a timeout of its own: without it, 30 minutes)
        wait = timedelta(seconds=max(timeout / 2, 1.0))
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=ranks,
            timeout=wait,
        )
        _GROUP.clear()
        _GROUP["port"] = where
        _GROUP["sub"] = {
            n: dist.new_group(list(range(n)), timeout=wait) for n in range(1, ranks + 1)
        }
    return _GROUP["sub"][world]


def _invoke(backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One rank's call: join the group if this worker has not (the judge's first job to
    every rank does only that), then the backend on this rank's shard and its group."""
    kwargs = dict(kwargs)
    setup = {k: kwargs.pop(k) for k in ("_rank", "_ranks", "_addr", "_port", "_timeout", "_world")}
    joining = kwargs.pop("_join", False)
    group = _group(
        setup["_rank"],
        setup["_ranks"],
        (str(setup["_addr"]), int(setup["_port"])),
        setup["_timeout"],
        setup["_world"],
        args[0].is_cuda,
    )
    if joining:
        dist.barrier(group=group)
        return args[0].new_zeros(())
    if kwargs.pop("_count", False):  # the bytes one call hands torch.distributed to send
        with torch.no_grad(), _Counted(group) as counted:
            backend(*args, group=group, **kwargs)
        return torch.tensor([float(counted.sent)], dtype=torch.float64)
    return backend(*args, group=group, **kwargs)


#: the keywords a rank's share of a call carries: where its group meets
SETUP = ("_rank", "_ranks", "_addr", "_port", "_timeout", "_world")


def share_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], share: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A rank's share of the whole call ``args, kwargs``: its shard of Q, K and V, and the
    keywords its group meets by (``share``: `SETUP`'s, as `RankGroup` sets them;
    `ApiFamily.share`, for the bench's jobs)."""
    rank, world = int(share["_rank"]), int(share["_world"])
    sharding = str(kwargs.get("sharding", "contiguous"))
    shards = tuple(
        D.shard(a, rank, world, sharding) if i < 3 and isinstance(a, Tensor) else a
        for i, a in enumerate(args)
    )
    return shards, {**kwargs, **{k: share[k] for k in SETUP}}


class _Counted:
    """Bytes this rank hands torch.distributed to send, while entered: the point-to-point
    sends (``isend``, ``send``, and so ``batch_isend_irecv``'s) exactly, and the
    collectives by what a ring algorithm sends (all-gather and all-to-all: what goes to
    the other ranks; all-reduce: ``2 (W - 1) / W`` of the tensor). The functions are
    wrapped where torch.distributed defines them; a kernel that holds a reference to one
    taken before the bench ran is not seen."""

    NAMES = ("isend", "send", "all_gather", "all_to_all", "all_reduce")

    def __init__(self, group: Any) -> None:
        self.world = dist.get_world_size(group)
        self.sent = 0
        self.saved: dict[str, Any] = {}

    @staticmethod
    def _bytes(t: Any) -> int:
        return int(t.numel() * t.element_size()) if isinstance(t, Tensor) else 0

    def __enter__(self) -> "_Counted":
        from torch.distributed import distributed_c10d as c10d

        w = self.world
        counts: dict[str, Callable[..., int]] = {
            "isend": lambda t, *a, **k: self._bytes(t),
            "send": lambda t, *a, **k: self._bytes(t),
            "all_gather": lambda out, t, *a, **k: self._bytes(t) * (w - 1),
            "all_to_all": lambda out, ins, *a, **k: sum(map(self._bytes, ins)) * (w - 1) // w,
            "all_reduce": lambda t, *a, **k: 2 * (w - 1) * self._bytes(t) // w,
        }
        for name in self.NAMES:
            real = getattr(c10d, name)
            self.saved[name] = real

            def counted(*a: Any, _real: Any = real, _n: str = name, **k: Any) -> Any:
                self.sent += counts[_n](*a, **k)
                return _real(*a, **k)

            setattr(c10d, name, counted)  # where P2POp checks its op
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        from torch.distributed import distributed_c10d as c10d

        for name, real in self.saved.items():
            setattr(c10d, name, real)
            setattr(dist, name, real)


# ---------------------------------------------------------------- the judge's side


def nccl_possible() -> bool:
    """Whether the ranks may meet over NCCL (a CUDA device here), which opens UNIX
    sockets of its own (its proxy, the exchange of memory handles): only then may a
    rank's worker open one. Without CUDA the ranks meet over gloo and TCP, and a UNIX
    socket is refused (`attnref._sandbox.Policy.unix`), so that no pathname socket on
    the machine (a forkserver's, a local service's) is in a rank's reach."""
    return bool(torch.cuda.is_available())


def _ephemeral_low() -> int:
    """The lowest port of the range the kernel draws the local ports of outgoing
    connections (and of a bind to port 0) from: Linux's ``ip_local_port_range``, else
    its default."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for the group's store to listen at, drawn below the ephemeral
    range where one is: a port of that range is also what every outgoing connection
    (gloo's between ranks, another audit's) takes for its own end, and one taken in the
    moment between this check and the store's bind fails the group with EADDRINUSE.
    The check-then-bind race remains (`ContextParallel._join` starts again on a new
    port when it is lost)."""
    low = _ephemeral_low()
    for _ in range(64) if low > 11024 else ():
        port = 10000 + secrets.randbelow(low - 10000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_taken(error: BaseException) -> bool:
    """Whether a group failed to form because its store's port was taken meanwhile."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


# ------------------------------------------------------------------ under torchrun
#
# torchrun starts one process per rank, each running ``attnref audit``. The process of
# rank 0 is the judge; every other one hosts its rank's worker (`serve_rank`). They meet
# in torchrun's process group (gloo, from its environment), where rank 0 says at which
# port it listens, with a token; each host connects and then relays: a job's bytes to
# its worker, the worker's reply bytes back, undecoded (the judge decodes them, as from
# a worker of its own). The listening socket is closed before any worker starts. The
# workers form their own group, as when attnref starts them, at rank 0's address.


@dataclass(frozen=True)
class Launch:
    """This process's place among the processes torchrun started (its environment)."""

    rank: int
    world: int
    local_rank: int
    #: where the judge (rank 0) listens and the workers' group meets: MASTER_ADDR, or
    #: ATTNREF_JUDGE_ADDR where rank 0 runs on another host than torchrun's store
    addr: str


def launched() -> Launch | None:
    """This process's `Launch` when torchrun (or a launcher that sets its variables:
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) started it, else None.

    Raises:
        BackendError: a variable is set to something other than what torchrun sets.
    """
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    except ValueError:
        raise BackendError(
            f"RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r}, LOCAL_RANK="
            f"{env.get('LOCAL_RANK')!r}: torchrun's variables must be integers"
        ) from None
    if not 0 <= rank < world or local < 0:
        raise BackendError(f"RANK={rank} must be in [0, WORLD_SIZE={world}), LOCAL_RANK >= 0")
    return Launch(rank, world, local, env.get("ATTNREF_JUDGE_ADDR") or env["MASTER_ADDR"])


def _judges() -> None:
    """Join torchrun's process group (the processes' own, not the workers') once."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=900))


#: torchrun's variables, which a rank's worker does not get: its group is its own (and
#: with TORCHELASTIC_USE_AGENT_STORE every rank would wait for a store no one serves),
#: and a backend has no business with the judges' store
_TORCHRUN_ONLY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")  # fmt: skip


def _worker_env(local_rank: int) -> dict[str, str | None]:
    """A rank's worker under torchrun: without torchrun's variables, and seeing its GPU
    only (so ``cuda:0`` there is that rank's)."""
    env: dict[str, str | None] = dict.fromkeys(_TORCHRUN_ONLY)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if ids:
        env["CUDA_VISIBLE_DEVICES"] = ids[local_rank % len(ids)]
    return env


_FRAME = struct.Struct("<QQ")
_MAX_HEAD = 1 << 20


def _send(link: socket.socket, head: dict[str, Any], payload: bytes | bytearray = b"") -> None:
    text = json.dumps(head).encode()
    link.sendall(_FRAME.pack(len(text), len(payload)) + text)
    if payload:
        link.sendall(payload)


def _exactly(link: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = link.recv_into(view[got:])
        if k == 0:
            raise EOFError("the connection closed")
        got += k
    return bytes(buf)


def _receive(link: socket.socket) -> tuple[dict[str, Any], bytes]:
    n, m = _FRAME.unpack(_exactly(link, _FRAME.size))
    if n > _MAX_HEAD:
        raise EOFError(f"a frame header of {n} bytes")
    head = json.loads(_exactly(link, n))
    if type(head) is not dict:
        raise EOFError("a frame header that is not an object")
    return head, _exactly(link, m)


def serve_rank(spec: str, *, threads: int = 1, memory_limit: int | None = None) -> int | None:
    """The family's ``serve``: under torchrun, on a rank other than 0, host this rank's
    worker until the judge hangs up (the exit code: 0); None where this process is the
    judge or torchrun did not start it.

    The judge's requests (``start``, ``job``, ``close``) are answered in order; ``stop``
    is acted on as it arrives (a reader thread), so that a worker still busy with a job
    whose group broke is killed at once, and that job answered as died."""
    launch = launched()
    if launch is None or launch.rank == 0:
        return None
    _judges()
    meeting = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(meeting, src=0)
    port, token = (int(x) for x in meeting)
    link = socket.create_connection((launch.addr, port), timeout=120)
    link.settimeout(None)
    env = _worker_env(launch.local_rank)
    requests: queue.Queue[tuple[dict[str, Any], bytes] | None] = queue.Queue()
    current: list[Supervised | None] = [None]
    lock = threading.Lock()

    def stop() -> None:
        with lock:
            worker, current[0] = current[0], None
        if worker is not None:
            worker.close()

    def read() -> None:
        try:
            while True:
                head, payload = _receive(link)
                if head.get("op") == "stop":
                    stop()
                    continue
                requests.put((head, payload))
        except (EOFError, OSError, ValueError):
            pass  # the judge hung up, or is gone
        finally:
            requests.put(None)

    try:
        _send(link, {"token": token, "rank": launch.rank, "local_rank": launch.local_rank})
        threading.Thread(target=read, daemon=True).start()
        while (request := requests.get()) is not None:
            head, payload = request
            op = head.get("op")
            if op == "close":
                break
            if op == "start":
                stop()
                try:
                    started = Supervised(
                        spec, NAME, threads=threads, memory_limit=memory_limit, env=env,
                        network=True, unix=nccl_possible(),  # the ranks meet over TCP
                    )  # fmt: skip
                except BackendError as e:
                    _send(link, {"status": "error", "message": str(e)})
                    continue
                with lock:
                    current[0] = started
                _send(link, {"status": "ok"})
            elif op == "job":
                worker = current[0]
                if worker is None:
                    _send(link, {"status": "died", "message": "its worker was stopped"})
                    continue
                try:
                    reply = worker.exchange(payload, float(head.get("timeout", 60.0)))
                except TimeoutError as e:
                    _send(link, {"status": "timeout", "message": str(e)})
                except BackendDied as e:
                    _send(link, {"status": "died", "message": str(e)})
                else:
                    _send(link, {"status": "ok"}, reply)
            else:
                _send(link, {"status": "error", "message": f"an unknown request {op!r}"})
    except OSError:
        pass  # the judge is gone: so is this rank
    finally:
        stop()
        with contextlib.suppress(OSError):
            link.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


def _meet_hosts(launch: Launch, wait: float = 120.0) -> "list[_Host]":
    """Rank 0: listen, say where in torchrun's group, and take each host's connection."""
    _judges()
    listener = socket.create_server(("", 0))
    token = secrets.randbits(62)
    port = int(listener.getsockname()[1])
    dist.broadcast(torch.tensor([port, token], dtype=torch.int64), src=0)
    hosts: dict[int, _Host] = {}
    listener.settimeout(wait)
    try:
        while len(hosts) < launch.world - 1:
            try:
                link, _ = listener.accept()
            except TimeoutError:
                missing = sorted(set(range(1, launch.world)) - set(hosts))
                raise BackendError(
                    f"under torchrun: rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} did not connect within {wait:g} s"
                ) from None
            link.settimeout(wait)
            try:
                head, _ = _receive(link)
            except (EOFError, OSError, ValueError):
                link.close()
                continue
            rank = head.get("rank")
            if head.get("token") != token or type(rank) is not int or not 0 < rank < launch.world:
                link.close()  # not one of torchrun's processes
                continue
            local = head.get("local_rank")
            hosts[rank] = _Host(rank, link, local if type(local) is int else 0)
    finally:
        listener.close()
    return [hosts[r] for r in range(1, launch.world)]


class _Host:
    """Rank ``rank``'s worker as the judge sees it: on the process torchrun started for
    that rank, which relays each job to it and its reply back, as bytes."""

    def __init__(self, rank: int, link: socket.socket, local_rank: int) -> None:
        self.rank, self.link, self.local_rank = rank, link, local_rank
        self.slowest = 0.0
        self.restarts = 0
        self.broken = False
        self._asking = threading.Lock()  # one request and its answer at a time
        self._sending = threading.Lock()  # and a stop may go out between them

    def _ask(
        self, head: dict[str, Any], payload: bytes | bytearray, wait: float
    ) -> tuple[dict[str, Any], bytes]:
        with self._asking:
            return self._ask_now(head, payload, wait)

    def _ask_now(
        self, head: dict[str, Any], payload: bytes | bytearray, wait: float
    ) -> tuple[dict[str, Any], bytes]:
        if self.broken:
            raise BackendDied(f"the process torchrun started for rank {self.rank} is gone")
        self.link.settimeout(wait)
        try:
            with self._sending:
                _send(self.link, head, payload)
            answer, data = _receive(self.link)
        except TimeoutError:
            self.broken = True
            raise TimeoutError(
                f"the process torchrun started for rank {self.rank} did not answer within "
                f"{wait:g} s"
            ) from None
        except (EOFError, OSError, ValueError):
            self.broken = True
            raise BackendDied(
                f"the process torchrun started for rank {self.rank} is gone"
            ) from None
        if type(answer.get("status")) is not str:
            raise BackendDied(f"rank {self.rank}'s process sent a malformed answer")
        return answer, data

    def start(self) -> None:
        answer, _ = self._ask({"op": "start"}, b"", 360.0)
        if answer["status"] != "ok":
            raise BackendError(str(answer.get("message", "its worker did not start")))

    def run(self, job: Any, timeout: float, meanwhile: Meanwhile = None) -> Any:
        t0 = time.perf_counter()
        answer, data = self._ask({"op": "job", "timeout": timeout}, encode(job.message()),
                                 timeout + 60.0)  # fmt: skip
        status, message = answer["status"], str(answer.get("message", ""))
        if status == "timeout":
            self.restarts += 1
            raise TimeoutError(message)
        if status == "died":
            self.restarts += 1
            raise BackendDied(message)
        if status != "ok":
            raise BackendDied(f"rank {self.rank}'s process: {message}")
        self.slowest = max(self.slowest, time.perf_counter() - t0)
        if meanwhile is not None:  # after: the rank's answer comes through a relay
            meanwhile()
        return read_reply(data)  # the worker's bytes, decoded here

    def close(self) -> None:
        """Stop the worker now, even while it runs a job (the connection stays, for the
        next start; the job is answered as died)."""
        with contextlib.suppress(OSError), self._sending:
            _send(self.link, {"op": "stop"})

    def hang_up(self) -> None:
        with contextlib.suppress(OSError), self._sending:
            _send(self.link, {"op": "close"})
        with contextlib.suppress(OSError):
            self.link.close()


def _is_communication(error: BaseException) -> bool:
    """Whether a rank's error is its group failing it (a peer that died or left), not a
    fault of its own."""
    text = str(error)
    return any(w in text for w in ("gloo", "Gloo", "NCCL", "Connection", "connection", "peer"))


def _ranked(rank: int, error: BaseException) -> str:
    """``error``'s message with the rank it happened on; an error with no message (a
    library's bare assert) keeps where it was raised (`one_line`)."""
    name = getattr(error, "type_name", type(error).__name__)
    said = str(error).strip() or one_line(error).removeprefix(f"{name} ")
    return f"rank {rank}: {said}"


def _named(rank: int, error: BaseException) -> BaseException:
    """``error`` with the rank it happened on in its message."""
    if isinstance(error, Raised):
        inner = error.error
        if isinstance(inner, RemoteError):
            return Raised(RemoteError(inner.type_name, _ranked(rank, inner), inner.traceback_text))
        return Raised(type(inner)(_ranked(rank, inner)))
    if isinstance(error, TimeoutError | BackendDied):
        return type(error)(f"rank {rank}: {error}")
    return error


class RankGroup:
    """The family's executor: one supervised worker per rank, behind the trust boundary.

    ``world_size`` workers are started (each imports the backend, and the first sends its
    declaration), then joined into a process group at a free local port. `run` cuts a
    job into the ranks' shards (``sharding`` and ``_world`` in its keywords), runs them
    at once, and puts the results back together. After a rank fails, every rank is
    started again before the next job, in a new group: a group a rank left is broken.
    """

    trusted = False

    def __init__(
        self,
        backend: Backend | str,
        api: str | None = None,
        *,
        isolate: bool = True,
        threads: int = 1,
        memory_limit: int | None = None,
        world_size: int = DEFAULT_WORLD,
        launch: Launch | None = None,
        jobs: tuple[str, ...] = (),
    ) -> None:
        if not isolate:
            raise BackendError(
                "the context-parallel family runs one process per rank: --in-process (a "
                "thread of the judge) cannot host a process group"
            )
        if not 1 <= world_size <= 64:
            raise BackendError(f"--world-size must be between 1 and 64, got {world_size}")
        self.spec = backend if isinstance(backend, str) else backend.spec or backend.name
        self.world_size = world_size if launch is None else launch.world
        self.threads, self.memory_limit = threads, memory_limit
        self.jobs = tuple(jobs)  # modules each rank's worker imports for more kinds of job
        self.slowest = 0.0
        self.restarts = 0
        self.history: list[tuple[Tensor, str]] = []
        self._ranks: list[Any] = []  # Supervised, or under torchrun a _Host from rank 1 on
        self._port = 0
        self._joined = -1
        self._launch = launch
        self._addr = "127.0.0.1" if launch is None else launch.addr
        self._env: dict[str, str | None] = {} if launch is None else _worker_env(launch.local_rank)
        self._hosts = [] if launch is None else _meet_hosts(launch)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        declared = self._ranks[0].backend
        #: the sandbox of the judge's own host's ranks (all alike: the first one's)
        self.sandbox: dict[str, dict[str, str]] = self._ranks[0].sandbox
        self.backend = declared if isinstance(backend, str) else backend
        if self.backend.api != NAME:
            self.close()
            raise BackendError(f"{self.spec} is a backend of the {self.backend.api!r} family")

    def _start(self) -> None:
        self._stop()
        # under torchrun the other ranks' workers reach rank 0's from their hosts
        self._port = free_port("127.0.0.1" if self._launch is None else "")
        local = 1 if self._launch is not None else self.world_size
        try:
            for _ in range(local):
                self._ranks.append(
                    Supervised(self.spec, NAME, threads=self.threads,
                               memory_limit=self.memory_limit, env=self._env,
                               network=True, unix=nccl_possible(),  # over TCP
                               jobs=self.jobs)
                )  # fmt: skip
            for host in self._hosts:
                host.start()
                self._ranks.append(host)
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        ranks, self._ranks = self._ranks, []
        for r in ranks:
            r.close()

    def close(self) -> None:
        self._stop()
        hosts, self._hosts = self._hosts, []
        for host in hosts:
            host.hang_up()
        if self._launch is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop()

    # ------------------------------------------------------------------ the jobs

    def _setup(self, rank: int, world: int, timeout: float) -> dict[str, Any]:
        return {
            "_rank": rank,
            "_ranks": self.world_size,
            "_addr": self._addr,
            "_port": self._port,
            "_timeout": timeout,
            "_world": world,
        }

    def _shard_call(self, job: Job, rank: int, world: int, timeout: float) -> Job:
        kwargs = dict(job.kwargs)
        kwargs.pop("_world", None)
        sharding = kwargs.get("sharding", "contiguous")
        args, kwargs = share_arguments(job.args, kwargs, self._setup(rank, world, timeout))
        if job.d_out is not None and not isinstance(job.d_out, Tensor):
            raise TypeError("a context-parallel call's backward takes one upstream gradient")
        d_out = None if job.d_out is None else D.shard(job.d_out, rank, world, sharding)
        return Job(args, kwargs, d_out, job.writable, job.recheck, job.leaves)

    def world_of(self, job: Job) -> int:
        """The world size ``job`` runs at: the one it asks for (``_world``) or every rank
        started, at most those, and inside the declaration (`fitted_world`); what a bug
        report's repro.py starts its ranks at.

        Raises:
            Skip: no world size cuts the sequence as the backend declares it takes.
        """
        asked = max(1, min(int(job.kwargs.get("_world") or self.world_size), self.world_size))
        caps = self.backend.capabilities
        T = job.args[0].shape[1] if job.args and isinstance(job.args[0], Tensor) else 0
        sharding = str(job.kwargs.get("sharding", "contiguous"))
        world = fitted_world(caps, T, asked, sharding)
        if world is None:
            raise _outside(caps, T, asked, sharding)
        return world

    def _gang(self, jobs: list[Any], timeout: float) -> list[Any]:
        """Each rank's job at once (``jobs[r]`` for rank ``r``); the results, or the
        failure of the rank that caused it (with its rank). A rank's failure stops the
        rest: they are killed, and every rank is started again before the next job."""
        answers: queue.Queue[tuple[int, bool, Any]] = queue.Queue()
        ranks = self._ranks

        def work(r: int) -> None:
            try:
                answers.put((r, True, ranks[r].run(jobs[r], timeout)))
            except BaseException as e:
                answers.put((r, False, e))

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(jobs))]
        for t in threads:
            t.start()
        results: dict[int, Any] = {}
        failed: dict[int, BaseException] = {}
        while len(results) + len(failed) < len(jobs):
            try:
                r, ok, value = answers.get(timeout=timeout + 30)
            except queue.Empty:  # a worker's own timeout should have come first
                failed.setdefault(-1, TimeoutError(f"no rank answered within {timeout:g} s"))
                break
            if ok:
                results[r] = value
                continue
            failed[r] = value
            if not (isinstance(value, Raised) and _is_communication(value.error)):
                # a fault of its own: the others may be waiting for it; a moment, then stop
                with contextlib.suppress(queue.Empty):
                    while len(results) + len(failed) < len(jobs):
                        r2, ok2, value2 = answers.get(timeout=1.0)
                        (results if ok2 else failed)[r2] = value2
                break
            # its group failed it: wait for the rank at fault to answer, raise, die or
            # time out (the group's own timeout is half the judge's)
        if not failed:
            self.slowest = max(self.slowest, *(x.slowest for x in ranks[: len(jobs)]))
            return [results[r] for r in range(len(jobs))]
        own = all(isinstance(e, Raised) and not _is_communication(e.error) for e in failed.values())
        if own and len(failed) == len(jobs):
            # every rank raised an error of its own and none waits for another (a
            # declared refusal, checked before any message): the group still stands
            raise self._cause(failed)
        self._stop()  # the group is broken: every rank starts again, in a new one
        self.restarts += 1
        for t in threads:
            t.join(10)
        raise self._cause(failed)

    @staticmethod
    def _cause(failed: dict[int, BaseException]) -> BaseException:
        """The failure that names the rank at fault: one that died, then one that raised
        an error of its own, then one that hung, then one its group failed."""

        def rank_of(item: tuple[int, BaseException]) -> tuple[int, int]:
            r, e = item
            if isinstance(e, BackendDied):
                order = 0
            elif isinstance(e, Raised) and not _is_communication(e.error):
                order = 1
            elif isinstance(e, TimeoutError):
                order = 2
            else:
                order = 3
            return order, r

        r, error = min(failed.items(), key=rank_of)
        others = sorted(x for x in failed if x not in (r, -1))
        named = _named(r, error) if r >= 0 else error
        if others and isinstance(named, Raised | BackendDied | TimeoutError):
            also = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})"
            if isinstance(named, Raised):
                inner = named.error
                if isinstance(inner, RemoteError):
                    return Raised(
                        RemoteError(inner.type_name, f"{inner}{also}", inner.traceback_text)
                    )
                return Raised(type(inner)(f"{inner}{also}"))
            return type(named)(f"{named}{also}")
        return named

    def _join(self, timeout: float, device: torch.device) -> None:
        """The first job of a group: every rank joins it (the backend is not called)."""
        like = torch.zeros((1, 1, 1, 1), device=device)
        for attempt in range(3):
            jobs = [
                Job((like, like, like), {**self._setup(r, self.world_size, timeout), "_join": True})
                for r in range(self.world_size)
            ]
            try:
                self._gang(jobs, timeout)
                break
            except Exception as e:
                if attempt == 2 or not _port_taken(e):
                    raise
                # another process took the port after it was found free: a new one
                self._start()
        self._joined = self._port

    def _ensure(self, timeout: float, device: torch.device) -> None:
        if not self._ranks:
            self._start()
        if self._joined != self._port:
            self._join(timeout, device)

    def run(self, job: Any, timeout: float, meanwhile: Meanwhile = None) -> Any:
        try:
            return self._run(job, timeout)
        finally:  # after: the ranks answer through their relays (and a call that failed
            if meanwhile is not None:  # is judged too: a bug report reads its oracle)
                meanwhile()

    def _run(self, job: Any, timeout: float) -> Any:
        if isinstance(job, Probe):
            if not self._ranks:
                self._start()
            return self._ranks[0].run(job, timeout)
        if str(job.message().get("job", "")).startswith("bench_"):
            return self._bench_job(job, timeout)
        first = job.calls[0] if isinstance(job, Series) else job
        self._ensure(timeout, first.args[0].device)
        if isinstance(job, Series):
            world = max(self.world_of(c) for c in job.calls)
            per_rank = [
                Series(tuple(self._shard_call(c, r, world, timeout) for c in job.calls), job.into)
                for r in range(world)
            ]
            replies = self._gang(per_rank, timeout)
            return [
                self._combine(job.calls[i], [rep[i] for rep in replies], series=True)
                for i in range(len(job.calls))
            ]
        assert isinstance(job, Job)
        world = self.world_of(job)
        parts = self._gang(
            [self._shard_call(job, r, world, timeout) for r in range(world)], timeout
        )
        return self._combine(job, parts)

    def _bench_job(self, job: Any, timeout: float) -> Any:
        """One of the bench's jobs (`attnref.bench.worker`: plain data, a case and a
        seed) on every rank, each with its share (``"_share"`` in its case, which the
        worker applies with `share_arguments`); their replies as one process's: the
        outputs put back together, a call's time the slowest rank's, the peak the
        largest rank's. A dry job's output (the backend's first) is cut into shards too."""
        case = dict(job.case)
        T = int(case["Tq"])
        caps = self.backend.capabilities
        sharding = sharding_for(caps, T, bool(case.get("causal")))  # as the ranks' calls are
        world = fitted_world(caps, T, self.world_size, sharding)
        if world is None:
            raise _outside(caps, T, self.world_size, sharding)
        self._ensure(timeout, torch.device(str(case["device"])))
        jobs = []
        for r in range(world):
            share = {**case, "_share": self._setup(r, world, timeout)}
            output = getattr(job, "output", None)
            if isinstance(output, Tensor):
                output = D.shard(output, r, world, sharding)
            jobs.append(replace(job, case=share, output=output))
        replies = self._gang(jobs, timeout)
        lengths = [len(D.positions(T, r, world, sharding)) for r in range(world)]
        B, h, Dv = int(case["B"]), int(case["h"]), int(case["Dh"])
        try:
            return _bench_reply(replies, lengths, sharding, (B, h, Dv))
        except (_BadPartError, KeyError, TypeError, ValueError) as e:
            raise Raised(Unaccepted(f"a rank's bench reply: {e}")) from None

    # --------------------------------------------------------------- the answers

    def _combine(self, job: Job, parts: list[Any], series: bool = False) -> Any:
        """The ranks' results as one call's: the output (and LSE) of the whole sequence,
        or its gradients. In a series each part is a reply the caller reads."""
        if series:
            failed = [
                (r, p)
                for r, p in enumerate(parts)
                if type(p) is not dict or p.get("status") != "ok"
            ]
            if failed:
                r, p = failed[0]
                if type(p) is dict and type(p.get("message")) is str:
                    error = RemoteError(str(p.get("type", "")), p["message"],
                                        str(p.get("traceback", "")))  # fmt: skip
                    p = {**p, "message": _ranked(r, error)}
                return p
            parts = [p["value"] for p in parts]
        sharding = job.kwargs.get("sharding", "contiguous")
        B, T, h = job.args[0].shape[:3]
        Dv = job.args[2].shape[-1]
        world = len(parts)
        lengths = [len(D.positions(T, r, world, sharding)) for r in range(world)]
        try:
            value = self._gather(job, parts, lengths, sharding, (B, h, Dv))
        except _BadPartError as e:
            if series:
                return {"status": "unaccepted", "message": str(e)}
            raise Raised(Unaccepted(str(e))) from None
        return {"status": "ok", "value": value} if series else value

    def _gather(
        self,
        job: Job,
        parts: list[Any],
        lengths: list[int],
        sharding: str,
        dims: tuple[int, int, int],
    ) -> Any:
        B, h, Dv = dims
        ranked = list(enumerate(zip(parts, lengths, strict=True)))
        if job.d_out is not None:
            grads: list[Tensor | None] = []
            for i, arg in enumerate(job.args[:3]):
                pieces = [_piece(p, i, r, (B, n, *arg.shape[2:])) for r, (p, n) in ranked]
                # a rank with an empty shard has nothing to differentiate: its zeros
                pieces = [
                    arg.new_zeros((B, 0, *arg.shape[2:])) if x is None and n == 0 else x
                    for x, (_, (_, n)) in zip(pieces, ranked, strict=True)
                ]
                whole = [x for x in pieces if x is not None]
                grads.append(D.unshard(whole, sharding) if len(whole) == len(pieces) else None)
            sinks = job.kwargs.get("sinks")
            if isinstance(sinks, Tensor):
                each = [_sink_grad(p, r, tuple(sinks.shape)) for r, (p, _) in ranked]
                each = [
                    sinks.new_zeros(sinks.shape) if x is None and n == 0 else x
                    for x, (_, (_, n)) in zip(each, ranked, strict=True)
                ]
                given = [x for x in each if x is not None]
                grads.append(torch.stack(given).sum(0) if len(given) == len(each) else None)
            return tuple(grads)
        if job.kwargs.get("return_lse"):
            outs, lses = [], []
            for r, (p, n) in ranked:
                if not isinstance(p, tuple | list) or len(p) < 2:
                    kind = type(p).__name__
                    raise _BadPartError(
                        f"rank {r}: asked for the log-sum-exp (return_lse=True), returned {kind}"
                    )
                outs.append(_tensor(p[0], r, (B, n, h, Dv), "output (B, T_local, h, Dv)"))
                lses.append(_tensor(p[1], r, (B, h, n), "log-sum-exp (B, h, T_local)"))
            return D.unshard(outs, sharding), D.unshard(lses, sharding, dim=2)
        what = "output (B, T_local, h, Dv)"
        return D.unshard([_tensor(p, r, (B, n, h, Dv), what) for r, (p, n) in ranked], sharding)


class _BadPartError(Exception):
    """A rank returned something that cannot be put together with the others."""


def _bench_reply(
    replies: list[Any], lengths: list[int], sharding: str, dims: tuple[int, int, int]
) -> Any:
    """The ranks' replies to a bench job as one (see `RankGroup._bench_job`)."""
    B, h, Dv = dims
    if replies[0] is None:  # a dry loop's set-up
        return None
    what = "output (B, T_local, h, Dv)"

    def whole(parts: list[object]) -> Tensor:
        shards = [
            _tensor(p, r, (B, n, h, Dv), what)
            for r, (p, n) in enumerate(zip(parts, lengths, strict=True))
        ]
        return D.unshard(shards, sharding)

    if "output" in replies[0]:  # prepare: the first output, the largest peak
        peaks = [r["peak"] for r in replies]
        peak = None if any(p is None for p in peaks) else max(int(p) for p in peaks)
        return {"output": whole([r["output"] for r in replies]), "peak": peak}
    runs = len(replies[0]["times"])
    if any(len(r["times"]) != runs or len(r["outputs"]) != runs for r in replies):
        raise ValueError("the ranks timed different numbers of calls")
    return {
        "times": [max(float(r["times"][i]) for r in replies) for i in range(runs)],
        "outputs": [whole([r["outputs"][i] for r in replies]) for i in range(runs)],
    }


def _tensor(x: object, rank: int, shape: tuple[int, ...], what: str) -> Tensor:
    """A rank's part, if it is a floating-point tensor of ``shape``."""
    if not isinstance(x, Tensor):
        raise _BadPartError(f"rank {rank}: returned a {type(x).__name__} as its {what}")
    if tuple(x.shape) != shape:
        got = tuple(x.shape)
        raise _BadPartError(f"rank {rank}: returned a {what} of shape {got}, expected {shape}")
    if not x.is_floating_point():
        raise _BadPartError(f"rank {rank}: returned a {what} of dtype {x.dtype}")
    return x


def _piece(p: object, i: int, rank: int, shape: tuple[int, ...]) -> Tensor | None:
    """A rank's gradient of argument ``i`` (None where it gave none)."""
    if not isinstance(p, tuple | list) or len(p) < 3:
        raise _BadPartError(f"rank {rank}: its backward returned {type(p).__name__}")
    g = p[i]
    return None if g is None else _tensor(g, rank, shape, f"{('dQ', 'dK', 'dV')[i]} shard")


def _sink_grad(p: object, rank: int, shape: tuple[int, ...]) -> Tensor | None:
    if not isinstance(p, tuple | list) or len(p) < 4 or p[3] is None:
        return None
    return _tensor(p[3], rank, shape, "dSinks")


def _bench_note(executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                timeout: float) -> str:  # fmt: skip
    """What the bench adds to a verified row (`ApiFamily.bench_note`): the bytes the
    busiest rank hands torch.distributed to send in one call (point-to-point sends
    exactly; collectives by what a ring algorithm sends), against a ring's ``2 (W - 1) /
    W`` of K (K and V when ``Dv = D``). A measure of the backend's processes: its word,
    shown, not judged."""
    if not isinstance(executor, RankGroup):
        return ""
    job = Job(args, {**kwargs, "_count": True})
    try:
        executor._ensure(timeout, args[0].device)
        world = executor.world_of(job)
        jobs = [executor._shard_call(job, r, world, timeout) for r in range(world)]
        parts = executor._gang(jobs, timeout)
        sent = max(float(_tensor(p, r, (1,), "byte count")[0]) for r, p in enumerate(parts))
    except (_BadPartError, Raised, BackendDied, TimeoutError, BackendError, Skip) as e:
        return f"sent/rank not counted: {str(e)[:120]}"  # a note, never the row's verdict
    k = args[1]
    ring = 2 * (world - 1) / world * k.numel() * k.element_size()  # K and V, Dv = D
    ratio = f", x{sent / ring:.2f}" if ring else ""
    return f"sent/rank {sent / 2**20:.3f} MiB (ring {ring / 2**20:.3f} MiB{ratio})"


def _executor(backend: Backend | str, api: str | None, **options: Any) -> RankGroup:
    """The ranks: started here, or under torchrun the processes it started (this one
    rank 0's, the judge; the others serve theirs, `serve_rank`)."""
    launch = launched()
    if launch is not None and launch.rank != 0:
        raise BackendError(
            f"under torchrun rank 0 judges; rank {launch.rank} serves its worker "
            "(attnref audit does that, or serve_rank)"
        )
    return RankGroup(backend, api, launch=launch, **options)


# ---------------------------------------------------------------- the builtins


def _caps(**changes: Any) -> Capabilities:
    return replace(
        CONTEXT_PARALLEL, window=True, softcap=True, sinks=True, masked_nan="contained", **changes
    )


#: what torch's own context parallelism refuses: its load balancer cuts ``2W`` chunks
_TORCH_CP_LENGTHS = "torch's context_parallel takes a length divisible by 2W"


@checked
def torch_context_parallel(
    q: Float[Tensor, "B T h D"],
    k: Float[Tensor, "B T g D"],
    v: Float[Tensor, "B T g Dv"],
    *,
    group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sharding: str = "contiguous",
    return_lse: bool = False,
) -> Float[Tensor, "B T h Dv"]:
    """torch's own context parallelism, through its public API
    (`torch.distributed.tensor.experimental.context_parallel`), in this family's
    convention: the rank's shards are gathered into the global Q, K and V, which
    ``context_parallel`` shards again its own way (head-tail chunks) while SDPA runs in
    it, on torch's ring; ``context_parallel_unshard`` gathers the output, and the rank
    returns its shard of it. No LSE, and no gradient (the unshard is not differentiable).

    Raises:
        RuntimeError: not on CUDA: torch dispatches SDPA to its ring only from the flash,
            memory-efficient and cuDNN kernels (a message the audit's probe reports).
        ValueError: a length not divisible by ``2W`` (declared: a refusal).
    """
    if not q.is_cuda:
        raise RuntimeError(
            "torch's context_parallel hands SDPA to its ring only from the flash, "
            "memory-efficient and cuDNN kernels, which run on CUDA (with NCCL); not on "
            f"{q.device.type} (with gloo)"
        )
    if return_lse:
        raise ValueError("torch's context_parallel does not return the log-sum-exp")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    h, g = q.shape[2], k.shape[2]
    if group is None:  # the probe: one device, no group
        return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale,
                    enable_gqa=h != g).transpose(1, 2)  # fmt: skip
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lengths = torch.tensor([q.shape[1]], device=q.device)
    everyone = [torch.zeros_like(lengths) for _ in range(world)]
    dist.all_gather(everyone, lengths, group=group)
    T = int(sum(int(n) for n in everyone))
    if T % (2 * world):
        raise ValueError(f"{_TORCH_CP_LENGTHS} = {2 * world}, got {T}")

    @checked_internal
    def whole(x: Float[Tensor, "B t n d"]) -> Float[Tensor, "B n T d"]:
        """A rank's shard, gathered from every rank into SDPA's layout, whole."""
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return D.unshard(parts, sharding).transpose(1, 2).contiguous()

    qg, kg, vg = whole(q), whole(k), whole(v)
    if h != g:
        kg, vg = kg.repeat_interleave(h // g, dim=1), vg.repeat_interleave(h // g, dim=1)
    mesh = DeviceMesh.from_group(group, "cuda")
    buffers = [qg, kg, vg]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers=set(buffers)):  # fmt: skip
        out = sdpa(qg, kg, vg, is_causal=causal, scale=softmax_scale)
    (full,) = context_parallel_unshard(mesh, [out], [2])
    return D.shard(full.transpose(1, 2), rank, world, sharding)


def _builtins() -> list[Backend]:
    return [
        Backend(
            "ring-reference",
            D.ring_attention,
            "attnref.distributed.ring_attention: K/V blocks around the ring, merged by LSE",
            _caps(),
            api=NAME,
        ),
        Backend(
            "allgather-reference",
            D.allgather_attention,
            "attnref.distributed.allgather_attention: K and V gathered on every rank",
            _caps(),
            api=NAME,
        ),
        Backend(
            "alltoall-reference",
            D.alltoall_attention,
            "attnref.distributed.alltoall_attention (Ulysses): heads re-sharded by all-to-all",
            _caps(refuses=("splits the heads across ranks",)),
            api=NAME,
        ),
        Backend(
            "torch-context-parallel",
            torch_context_parallel,
            "torch.distributed.tensor.experimental.context_parallel: torch's ring, through "
            "its public API (CUDA and NCCL only: skipped elsewhere, with the reason)",
            replace(
                CONTEXT_PARALLEL,
                lse=False,
                gradients=False,
                dtypes=(torch.float32, torch.bfloat16, torch.float16),
                refuses=(_TORCH_CP_LENGTHS,),
            ),
            probe=True,
            api=NAME,
        ),
    ]


# ---------------------------------------------------------------- the properties


def _cases(name: str) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """One sequence's self-attention (GQA, any length: often not a multiple of ``2W``),
    causal or not, with the declared variants, at a world size of 1 to 4 (those above
    ``--world-size`` run at it; half the time with as many KV heads as ranks) and either
    sharding."""

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        # small cases: every rank's shard is judged whole (long ones are the dense
        # families' business, where the judge samples rows)
        dense = case_strategy(
            name,
            p,
            c,
            sizes=("small",),
            causal=st.sampled_from((None, "bottom_right")),
            variants=some_variants(replace(c, alibi=False)),
        )

        @st.composite
        def draw(draw: st.DrawFn) -> Case:
            case = draw(dense)
            world = draw(st.integers(1, 4))
            if world > 1 and draw(st.booleans()):
                # KV heads a head-sharding kernel (Ulysses) can split across the ranks:
                # half the cases, so that one that declares it refuses others is judged
                case = replace(case, g=world, h=world * (case.h // case.g))
            sharding = draw(st.sampled_from(c.cp_shardings))
            T = case.Tk
            if c.cp_equal_shards:  # declared: a length the chunks cut evenly
                chunks = D.chunk_count(world, sharding)
                T = max(chunks, T - T % chunks)
            options = (("world", world), ("sharding", sharding))
            return replace(case, Tq=T, Tk=T, options=options)

        return draw()

    return cases


def _over(ctx: Context, case: Case) -> tuple[dict[str, Any], str]:
    """The world size and sharding ``case`` names, inside the declaration: at most the
    ranks started (all of them with `cp_full_group`), a sharding declared, chunks of
    equal lengths where declared (`fitted_world`)."""
    caps = ctx.caps
    started = int(getattr(ctx.executor, "world_size", 1))
    world = min(int(case.option("world", started)), started)
    if caps.cp_full_group:  # declared: every rank's group, never a subgroup
        world = started
    sharding = str(case.option("sharding", "contiguous"))
    if sharding not in caps.cp_shardings:
        sharding = caps.cp_shardings[0]
    fitted = fitted_world(caps, case.Tk, world, sharding)
    if fitted is None:
        raise _outside(caps, case.Tk, world, sharding)
    return {"_world": fitted, "sharding": sharding}, f"world size {fitted}, {sharding}"


def _alone(caps: Capabilities, T: int) -> str | None:
    """The sharding of one rank holding the whole sequence, inside the declaration (None:
    there is none, a zigzag-only kernel with equal chunks and an odd length)."""
    for sharding in ("contiguous", "zigzag"):
        if sharding in caps.cp_shardings and fitted_world(caps, T, 1, sharding) == 1:
            return sharding
    return None


def _agreement(ctx: Context, case: Case) -> None:
    """The output (and the LSE) put together from every rank's shard agree with the
    single-device oracle."""
    inputs = ctx.build(case)
    over, where = _over(ctx, case)
    if not ctx.caps.lse:
        ctx.agree(inputs, f"output ({where})", **over)
        return
    out, got = ctx.run_lse(inputs, **over)
    exp = ctx.expect(inputs)
    with ctx.naming_the_row(inputs):
        close(
            out.to(torch.float64),
            exp.value,
            *exp.bounds(),
            f"output ({where})",
            exp.known,
            semantic=exp.semantic,
        )
    want = ctx.expect_lse(inputs)
    finite = torch.isfinite(want.value)
    with ctx.naming_the_row(inputs):
        close(
            got.to(torch.float64),
            want.value,
            *want.bounds(finite),
            f"log-sum-exp ({where})",
            sel=want.sel(finite),
        )


def _gradients(ctx: Context, case: Case) -> None:
    """dQ, dK and dV put together from every rank's shard (and dSinks summed over the
    ranks) agree with the oracle's: each gradient arrived on the rank that owns it."""
    agree_grads(ctx, case, ctx.build(case), **_over(ctx, case)[0])


def _world_invariance(ctx: Context, case: Case) -> None:
    """The output does not depend on the world size or the sharding: the drawn one
    against one rank holding the whole sequence."""
    caps = ctx.caps
    inputs = ctx.build(case)
    over, where = _over(ctx, case)
    started = int(getattr(ctx.executor, "world_size", 1))
    T = case.Tk
    if caps.cp_full_group:
        # no subgroup of one rank to hold the whole sequence: the two shardings on every
        # rank, against each other
        if started == 1 or len(caps.cp_shardings) == 1:
            raise Skip("one rank started, or one sharding declared: nothing to compare on "
                       "a full group")  # fmt: skip
        for sharding in ("contiguous", "zigzag"):
            if fitted_world(caps, T, started, sharding) is None:
                raise _outside(caps, T, started, sharding)
        contiguous = ctx.run(inputs, _world=started, sharding="contiguous")
        zigzag = ctx.run(inputs, _world=started, sharding="zigzag")
        law(ctx, zigzag, inputs, contiguous, inputs, f"world size {started}, zigzag "
            "against contiguous")  # fmt: skip
        return
    alone = _alone(caps, T)
    if alone is None:  # zigzag only, and an odd length
        raise _outside(caps, T, 1, caps.cp_shardings[0])
    if over["_world"] == 1:  # the drawn call is one rank's: spread it over them all
        for sharding in ("zigzag", "contiguous"):
            world = fitted_world(caps, T, started, sharding)
            if sharding in caps.cp_shardings and world is not None and world > 1:
                over = {"_world": world, "sharding": sharding}
                where = f"world size {world}, {sharding}"
                break
    if over["_world"] == 1:
        raise Skip("one rank started, or no larger world size inside the declaration: "
                   "no other world size to compare")  # fmt: skip
    alone_out = ctx.run(inputs, _world=1, sharding=alone)
    spread = ctx.run(inputs, **over)
    law(ctx, spread, inputs, alone_out, inputs, f"{where} against one rank")


def _needs_gradients(caps: Capabilities) -> str | None:
    return None if caps.gradients else "gradients not declared"


def _examples(p: Profile, c: Capabilities) -> list[Case]:
    """Where the class-30 bugs show: lengths that leave the last shard short or empty,
    causal zigzag (the diagonal blocks and the chunk order), GQA, every world size."""
    base = [
        Case("cp_zigzag_causal", batch=(1,), h=4, g=2, Tq=13, Tk=13, causal="bottom_right",
             options=(("world", 4), ("sharding", "zigzag"))),
        Case("cp_contiguous_causal", batch=(2,), h=2, g=2, Tq=9, Tk=9, causal="bottom_right",
             options=(("world", 3), ("sharding", "contiguous"))),
        Case("cp_short_last", batch=(1,), h=2, g=1, Tq=10, Tk=10,
             options=(("world", 4), ("sharding", "contiguous"))),
        Case("cp_empty_chunk", batch=(1,), h=2, g=2, Tq=7, Tk=7, causal="bottom_right",
             options=(("world", 4), ("sharding", "zigzag"))),
        Case("cp_hot", batch=(1,), h=2, g=2, Tq=12, Tk=12, amp=6.0, causal="bottom_right",
             options=(("world", 2), ("sharding", "zigzag"))),
    ]  # fmt: skip
    if c.sinks:
        base.append(
            Case("cp_sinks", batch=(1,), h=2, g=2, Tq=11, Tk=11, sinks=True,
                 options=(("world", 4), ("sharding", "zigzag")))
        )  # fmt: skip
    return [replace(x, seed=400 + i) for i, x in enumerate(base)]


PROPERTIES: tuple[Property, ...] = (
    Property(
        "cp_agreement",
        "the output and LSE put together from every rank's shard agree with the "
        "single-device oracle, at world sizes 1 to 4 and both shardings",
        (30,),
        _cases("cp_agreement"),
        _agreement,
        examples=_examples,
        families=(NAME,),
    ),
    Property(
        "cp_gradients",
        "dQ, dK, dV put together from every rank's shard (dSinks summed) agree with "
        "the oracle's: each gradient arrives on the rank that owns its shard",
        (30,),
        _cases("cp_gradients"),
        _gradients,
        requires=_needs_gradients,
        examples=_examples,
        gradient=True,
        families=(NAME,),
    ),
    Property(
        "cp_world_size",
        "the output does not depend on the world size or the sharding: the same as one "
        "rank holding the whole sequence",
        (30,),
        _cases("cp_world_size"),
        _world_invariance,
        examples=_examples,
        families=(NAME,),
    ),
)


# ------------------------------------------------------------------- the mutants


class _BackwardMisrouted(torch.autograd.Function):
    """A ring step whose backward sends the K/V gradient on to the next rank instead of
    back to the previous one, where the block came from: each rank's dK and dV end up
    summed from another block's gradients (``back``: the shape the misrouted gradient
    arrives in, made to fit)."""

    @staticmethod
    def forward(
        ctx: Any, group: Any, shape: tuple[int, ...], back: tuple[int, ...], kv: Tensor
    ) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        sends: list[Tensor | None] = [None] * world
        sends[nxt] = kv
        shapes: list[tuple[int, ...] | None] = [None] * world
        shapes[prev] = shape
        got = D.send_receive(group, sends, shapes, kv)[prev]
        assert got is not None
        ctx.group, ctx.back, ctx.shape = group, back, tuple(kv.shape)
        return got

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        group = ctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        sends: list[Tensor | None] = [None] * world
        sends[nxt] = grad  # the bug: on, not back
        shapes: list[tuple[int, ...] | None] = [None] * world
        shapes[prev] = ctx.back
        got = D.send_receive(group, sends, shapes, grad)[prev]
        assert got is not None
        fitted = grad.new_zeros(ctx.shape)
        n = min(fitted.shape[1], got.shape[1])
        fitted[:, :n] = got[:, :n]
        return None, None, None, fitted


@checked
def _planted_ring(
    q: Float[Tensor, "B T_local h D"],
    k: Float[Tensor, "B T_local g D"],
    v: Float[Tensor, "B T_local g Dv"],
    *,
    bugs: frozenset[str],
    group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sharding: str = "contiguous",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> Any:
    """Ring attention as `attnref.distributed.ring_attention` computes it, with the
    class-30 bugs ``bugs`` names planted (the switches of the mutants below)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.tensor([q.shape[1]], device=q.device)
    everyone = [torch.zeros(1, dtype=torch.int64, device=q.device) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    lengths = [int(t) for t in everyone]
    T = sum(lengths)
    layout = "contiguous" if "sharding_ignored" in bugs else sharding

    def pos(r: int) -> Tensor:
        spans = D.shard_spans(T, world, layout)[r] if layout == sharding else None
        if spans is None:  # the shards read as contiguous ones of the same lengths
            start = sum(lengths[:r])
            return torch.arange(start, start + lengths[r])
        if "zigzag_swapped" in bugs and sharding == "zigzag":
            spans = spans[::-1]
        return torch.cat([torch.arange(a, b) for a, b in spans])

    wide = torch.promote_types(q.dtype, torch.float32)
    wq = q.to(wide)
    Dh, B, h, Dv = k.shape[-1], q.shape[0], q.shape[2], v.shape[-1]
    kv = torch.cat([k.to(wide), v.to(wide)], dim=-1)
    held = [kv]
    out = wq.new_zeros((B, h, q.shape[1], Dv))
    lse = wq.new_full((B, h, q.shape[1]), -math.inf)
    pos_q = pos(rank)
    for step in range(world):
        owner = (rank - step) % world
        diagonal = "diagonal_unmasked" in bugs and owner == rank
        seen = D.visible_keys(pos_q, pos(owner), causal and not diagonal, window_size)
        if "last_shard_short" in bugs and owner == world - 1 and seen.shape[-1] > 0:
            seen[:, -1] = False
        if bool(seen.any()):
            qh = wq.transpose(1, 2)
            kh, vh = kv[..., :Dh].transpose(1, 2), kv[..., Dh:].transpose(1, 2)
            part, part_lse = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=seen, scale=softmax_scale, enable_gqa=h != k.shape[2],
                softcap=softcap, return_lse=True,
            )  # fmt: skip
            if "sink_every_rank" in bugs and sinks is not None:
                part = F.apply_sinks(part, part_lse, sinks)
            if "merge_unstable" in bugs:
                e1, e2 = lse.to(q.dtype).exp(), part_lse.to(q.dtype).exp()
                total = e1 + e2
                out = e1.unsqueeze(-1) * out.to(q.dtype) + e2.unsqueeze(-1) * part.to(q.dtype)
                out = (out / total.unsqueeze(-1)).to(wide).nan_to_num(0.0)
                lse = total.log().to(wide)
            else:
                out, lse = F.merge_attention(out, lse, part, part_lse)
        if step == world - 1:
            break
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        shape = (B, lengths[(owner - 1) % world], k.shape[2], Dh + Dv)
        if "grad_wrong_rank" in bugs:  # what the previous rank got the step before
            back = (B, lengths[(owner - 2) % world], k.shape[2], Dh + Dv)
            kv = _BackwardMisrouted.apply(group, shape, back, kv)  # type: ignore[no-untyped-call]
        else:
            sends: list[Tensor | None] = [None] * world
            sends[nxt] = kv
            shapes: list[tuple[int, ...] | None] = [None] * world
            shapes[prev] = shape
            got = D.exchange(sends, shapes, group)[prev]
            assert got is not None
            kv = got
        held.append(kv)
    out = D.tie(out, held)
    if sinks is not None and "sink_every_rank" not in bugs:
        out = F.apply_sinks(out, lse, sinks)
    result = out.transpose(1, 2).to(q.dtype)
    return (result, lse) if return_lse else result


def _mutant_fn(m: Mutant) -> Callable[..., Any]:
    bugs = frozenset(m.switches)

    def planted(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
        return _planted_ring(q, k, v, bugs=bugs, **kwargs)

    planted.__name__ = planted.__qualname__ = m.name
    planted.__doc__ = f"Class {m.bug_class}: {m.summary}"
    planted.capabilities = m.capabilities  # type: ignore[attr-defined]
    return planted


_LIKE: dict[str, Any] = {"api": NAME, "capabilities": _caps()}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("zigzag_chunks_swapped", 30, "zigzag shards read with their two chunks in the "
           "wrong order (chunk 2W - 1 - r first)", {"zigzag_swapped": True}, **_LIKE),
    Mutant("cp_sharding_ignored", 30, "zigzag shards read as contiguous ones: every "
           "position after the first chunk is wrong", {"sharding_ignored": True}, **_LIKE),
    Mutant("diagonal_full_mask", 30, "the diagonal step (a rank's own block) attended "
           "without the causal mask", {"diagonal_unmasked": True}, **_LIKE),
    Mutant("merge_without_max", 30, "partial results merged as exp(lse) weights in the "
           "inputs' dtype, no max subtracted: overflow", {"merge_unstable": True}, **_LIKE),
    Mutant("last_shard_short", 30, "the last rank's shard is read one token short (its "
           "last key never seen)", {"last_shard_short": True}, **_LIKE),
    Mutant("sink_on_every_rank", 30, "the sink is added to every step's partial result, "
           "not once after the merge", {"sink_every_rank": True}, **_LIKE),
    Mutant("dkv_on_wrong_rank", 30, "the backward sends each K/V block's gradient on to "
           "the next rank instead of back to its owner", {"grad_wrong_rank": True}, **_LIKE),
)  # fmt: skip


def _repro_script(title: str, spec: str, api: str) -> str:
    """repro.py for a finding of this family: the generic one
    (`attnref.conformance.bugreports.REPRO`), each call made on its ranks (`RUN_RANKS`)."""
    from attnref.conformance.bugreports import repro_text

    return repro_text(title, spec, api, RUN_RANKS)


#: how repro.py makes a call of this family: one process a rank, in a process group of
#: their own on this machine (plain torch.distributed, as `RankGroup` runs the audit's)
RUN_RANKS = r'''def positions(T, rank, world, sharding):
    """The global positions of rank ``rank``'s tokens, in the order it holds them: the
    sequence cut into ``world`` chunks (contiguous: rank r holds the r-th) or ``2 world``
    (zigzag: the r-th and the (2 world - 1 - r)-th), as torch.tensor_split cuts."""
    chunks = 2 * world if sharding == "zigzag" else world
    sizes = [len(c) for c in torch.arange(T).tensor_split(chunks)]
    starts = [sum(sizes[:i]) for i in range(chunks + 1)]
    mine = [rank] if sharding != "zigzag" else [rank, 2 * world - 1 - rank]
    return torch.cat([torch.arange(starts[c], starts[c + 1]) for c in mine])


def unshard(parts, sharding, dim):
    """The whole sequence from each rank's part (``parts[r]``, its tokens along ``dim``)."""
    world, T = len(parts), sum(p.shape[dim] for p in parts)
    order = torch.cat([positions(T, r, world, sharding) for r in range(world)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T)
    return torch.cat(parts, dim=dim).index_select(dim, inverse.to(parts[0].device))


#: seconds the ranks' processes may take to start and meet, beyond TIMEOUT
STARTUP = 120
import re  # noqa: E402 (what the ranks' runner alone needs)

#: what a rank that gave up waiting for another says (torch.distributed's timeouts)
WAITING = re.compile(r"DistBackendError|DistNetworkError|[Tt]imed out|Connection (closed|reset)")


def run(fn, args, kwargs, record):
    """One call of the context-parallel convention: ``fn(q, k, v, *, group, causal,
    softmax_scale, sharding, return_lse, ...)`` with ``(B, T_local, h, D)`` shards. The
    sequence is cut into the world size the audit ran the call at, each rank's call made
    by a process of its own (`rank_main`, this script again) in one process group on
    this machine (gloo; NCCL on CUDA), as torchrun would start them; the ranks' outputs
    (LSE, gradients) are put back together as one call's."""
    import socket
    import subprocess

    kwargs = dict(kwargs)
    kwargs.pop("_world", None)
    world = int(record.get("world") or 1)
    sharding = kwargs.get("sharding", "contiguous")
    with tempfile.TemporaryDirectory() as tmp:

        def said_by(r):  # what rank r printed
            return (Path(tmp) / f"rank{r}.log").read_text(errors="replace")

        torch.save({"args": args, "kwargs": kwargs, "d_out": record.get("d_out"),
                    "leaves": record.get("leaves"), "world": world}, Path(tmp) / "call.pt")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mark(f"starting the ranks of call {CALL}")  # not timed: the processes start
        ranks = []
        for r in range(world):
            log = open(Path(tmp) / f"rank{r}.log", "w")
            ranks.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--call", tmp,
                 "--port", str(port), "--backend", BACKEND, "--timeout", str(TIMEOUT)],
                stdout=log, stderr=subprocess.STDOUT))
            log.close()
        # a rank is ready once in the group: the call is timed from then, its start not.
        # A rank that gave up waiting for another (its group's timeout, half the call's)
        # is not the one to blame: the one it waited for is
        started, ready, failure, waited = time.monotonic(), False, None, []
        while failure is None and any(p.poll() is None for p in ranks):
            for r, p in enumerate(ranks):
                if p.poll() not in (None, 0) and r not in waited:
                    if p.returncode > 0 and WAITING.search(said_by(r)):
                        waited.append(r)
                        continue
                    failure = (r, p.returncode)
                    break
            if not ready and all((Path(tmp) / f"ready{r}").exists() for r in range(world)):
                ready, started = True, time.monotonic()
                mark(f"call {CALL}, on its {world} ranks")
            limit = TIMEOUT if ready else TIMEOUT + STARTUP
            if failure is None and time.monotonic() - started > limit:
                # the ranks that wait for a hung one give up at their group's timeout:
                # a while more to let them say so, so that the hung one is named
                grace = time.monotonic() + max(TIMEOUT / 2, 5)
                while True:
                    running = [r for r, p in enumerate(ranks) if p.poll() is None]
                    hung = [r for r in running if not WAITING.search(said_by(r))]
                    if len(hung) <= 1 or time.monotonic() > grace:
                        break
                    time.sleep(0.1)
                waited += [r for r in running if r not in hung and r not in waited]
                failure = ((hung or running or [0])[0], None)
            time.sleep(0.02)
        if failure is None:  # every rank that failed gave up waiting: the first of them
            failure = next(((r, p.returncode) for r, p in enumerate(ranks) if p.returncode), None)
        for p in ranks:  # a rank that failed leaves the others waiting for it
            if p.poll() is None:
                p.kill()
            p.wait()
        if failure is not None:
            r, code = failure
            said = said_by(r).strip()
            print(f"rank {r}'s output:\n{said[-3000:]}")
            if code is None:
                then = f" (ranks {waited} gave up waiting)" if waited else ""
                raise BugShows(f"rank {r} gave no answer within {TIMEOUT:g} s{then}")
            if code < 0:
                raise BugShows(f"rank {r}'s process was killed by {signal.Signals(-code).name}")
            last = said.splitlines()[-1] if said else f"exit code {code}"
            raise BugShows(f"rank {r}: {last}")
        parts = []
        for r in range(world):
            try:
                parts.append(torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True))
            except Exception as e:
                raise BugShows(f"rank {r}'s result could not be read back: {e}") from None
    try:
        if record.get("d_out") is not None:  # each leaf's gradient: the sinks' a sum
            names = record.get("leaves") or [0, 1, 2] + (
                ["sinks"] if isinstance(kwargs.get("sinks"), torch.Tensor) else [])
            return tuple(
                torch.stack([p[j] for p in parts]).sum(0) if name == "sinks"
                else unshard([p[j] for p in parts], sharding, 1)
                for j, name in enumerate(names))
        if kwargs.get("return_lse"):
            return (unshard([p[0] for p in parts], sharding, 1),
                    unshard([p[1] for p in parts], sharding, 2))
        return unshard(parts, sharding, 1)
    except Exception as e:  # a rank returned no tensor, or one of another shape
        raise BugShows(f"the ranks' results do not fit together: {type(e).__name__}: {e}") \
            from None


def rank_main():
    """One rank of a call (`run`): its shard of the saved call, in the process group."""
    from datetime import timedelta

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    for option in ("--rank", "--port"):
        parser.add_argument(option, type=int)
    parser.add_argument("--call")
    parser.add_argument("--backend")
    parser.add_argument("--timeout", type=float)
    a = parser.parse_args()
    saved = torch.load(Path(a.call) / "call.pt", weights_only=True)
    args, kwargs, world = list(saved["args"]), dict(saved["kwargs"]), saved["world"]
    cuda = args[0].is_cuda
    if cuda:
        torch.cuda.set_device(a.rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                            rank=a.rank, world_size=world,
                            timeout=timedelta(seconds=max(a.timeout / 2, 1.0)))
    (Path(a.call) / f"ready{a.rank}").touch()
    mine = positions(args[0].shape[1], a.rank, world, kwargs.get("sharding", "contiguous"))
    mine = mine.to(args[0].device)
    args = [x[:, mine] if i < 3 else x for i, x in enumerate(args)]
    fn = resolve(a.backend)
    if saved["d_out"] is None:
        out = fn(*args, group=dist.group.WORLD, **kwargs)
    else:
        chosen = make_leaves(args, kwargs, saved["leaves"])
        out = fn(*args, group=dist.group.WORLD, **kwargs)
        out = gradients_of(out, saved["d_out"][:, mine], chosen)
        if not mine.numel():  # a rank with no token has nothing to differentiate: zeros
            out = tuple(torch.zeros_like(c) if g is None else g for g, c in zip(out, chosen))

    def plain(x):
        if isinstance(x, torch.Tensor):
            return x.detach()
        if isinstance(x, (tuple, list)):
            return tuple(plain(item) for item in x)
        return x

    torch.save(plain(out), Path(a.call) / f"rank{a.rank}.pt")
    dist.destroy_process_group()
    return 0'''


FAMILY = ApiFamily(
    name=NAME,
    summary="attention sharded across the ranks of a torch.distributed group: (B, T_local, "
    "h, D) on each rank, contiguous or zigzag, positions global (ring, all-gather, Ulysses)",
    signature="fn(q, k, v, *, group, causal=False, softmax_scale=None, "
    "sharding='contiguous', window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False)",
    positional=3,
    keywords=("group", "sharding"),
    defaults=CONTEXT_PARALLEL,
    build=_build,
    read=_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=_native_causal,
    dropout=False,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
    invoke=_invoke,
    executor=_executor,
    world_size=DEFAULT_WORLD,
    share=share_arguments,
    reference="ring-reference",
    bench_backends=("ring-reference", "allgather-reference", "alltoall-reference"),
    bench_note=_bench_note,
    serve=serve_rank,
    repro_script=_repro_script,
)
