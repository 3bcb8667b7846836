"""Context-parallel kernels the suite has never seen, and ranks that misbehave.

The first two are written from scratch, not from attnref.distributed or the mutants: an
all-gather kernel that rebuilds the zigzag order as if the chunks were equal (wrong once
the length is not a multiple of ``2W``), and a Ulysses kernel that deals the heads out
round-robin on the way in and back in blocks on the way out. The rest wrap the ring
reference and raise, die or hang on one rank, and name their thread and print the name
(``PLANTED_CP_MARK``; a worker's sandbox lets it write no file, and gives it a PID
namespace of its own, whose ids mean nothing outside), so a test can find their
processes in the machine's ``/proc`` and check that none is left running.
"""

import os
import signal
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnref import distributed as D
from attnref.conformance.declarations import Capabilities
from tests.hostile.marks import mark, unique

CAPS = Capabilities(
    family="context-parallel",
    bool_mask=False,
    float_mask=False,
    causal_alignments=("top_left", "bottom_right"),
    self_attention_only=True,
    dropout=False,
    zero_head_dim=False,
    lse=True,
    refuses=("heads across",),
)


def _attend(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, scale: float | None) -> Tensor:
    """(B, Tq, h, D) against (B, Tk, g, D): softmax in float64 by hand."""
    h, g = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // g, dim=2), v.repeat_interleave(h // g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * (scale or q.shape[-1] ** -0.5)
    s = s.masked_fill(~seen, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double()).to(q.dtype)


def _gather_all(x: Tensor, group: Any) -> list[Tensor]:
    world = dist.get_world_size(group)
    n = torch.tensor([x.shape[1]])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(sizes))
    padded = torch.zeros((x.shape[0], longest, *x.shape[2:]), dtype=x.dtype)
    padded[:, : x.shape[1]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[:, : int(s)] for p, s in zip(parts, sizes, strict=True)]


def zigzag_equal_chunks(
    q: Tensor, k: Tensor, v: Tensor, *, group: Any = None, causal: bool = False,
    softmax_scale: float | None = None, sharding: str = "contiguous", return_lse: bool = False,
) -> Any:  # fmt: skip
    """All-gather attention that places the zigzag chunks at multiples of T // 2W."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ks, vs = _gather_all(k, group), _gather_all(v, group)
    T = sum(x.shape[1] for x in ks)

    def where(r: int, n: int) -> Tensor:
        if sharding == "contiguous":
            start = sum(x.shape[1] for x in ks[:r])
            return torch.arange(start, start + n)
        c = T // (2 * world)  # the bug: equal chunks
        first = torch.arange(r * c, r * c + c)
        second = torch.arange((2 * world - 1 - r) * c, (2 * world - 1 - r) * c + n - c)
        return torch.cat([first, second])[:n]

    pos_k = torch.cat([where(r, x.shape[1]) for r, x in enumerate(ks)])
    pos_q = where(rank, q.shape[1])
    seen = (
        (pos_k.unsqueeze(0) <= pos_q.unsqueeze(1))
        if causal
        else torch.ones(q.shape[1], T, dtype=torch.bool)
    )
    out = _attend(q, torch.cat(ks, 1), torch.cat(vs, 1), seen, softmax_scale)
    if return_lse:
        raise RuntimeError("no LSE here")
    return out


zigzag_equal_chunks.capabilities = replace(CAPS, lse=False)  # type: ignore[attr-defined]


def ulysses_heads_mixed(
    q: Tensor, k: Tensor, v: Tensor, *, group: Any = None, causal: bool = False,
    softmax_scale: float | None = None, sharding: str = "contiguous", return_lse: bool = False,
) -> Any:  # fmt: skip
    """Ulysses attention that sends rank r the heads r, r + W, ... on the way in, and
    puts the results back as if it had held heads r * h / W onwards."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    h, g = q.shape[2], k.shape[2]
    if h % world or g % world:
        raise ValueError("ulysses_heads_mixed splits the heads across ranks")
    qs, ks, vs = (_gather_all(t, group) for t in (q, k, v))  # everything, then my heads
    T = sum(x.shape[1] for x in ks)
    order = torch.cat([D.positions(T, r, world, sharding) for r in range(world)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T)
    whole = [torch.cat(x, 1)[:, inverse] for x in (qs, ks, vs)]
    mine_q = whole[0][:, :, rank::world]
    mine_k, mine_v = whole[1][:, :, rank::world], whole[2][:, :, rank::world]
    pos = torch.arange(T)
    seen = pos.unsqueeze(0) <= pos.unsqueeze(1) if causal else torch.ones(T, T, dtype=torch.bool)
    out = _attend(mine_q, mine_k, mine_v, seen, softmax_scale)  # (B, T, h / W, Dv)
    outs = _gather_all(out, group)  # every rank's heads
    full = torch.cat(outs, dim=2)  # the bug: read back as blocks of heads
    result = full[:, D.positions(T, rank, world, sharding)]
    if return_lse:
        raise RuntimeError("no LSE here")
    return result


ulysses_heads_mixed.capabilities = replace(CAPS, lse=False)  # type: ignore[attr-defined]


_MARK: list[str] = []


def _note_pid() -> None:
    if not _MARK:
        _MARK.append(mark(unique("cprank")))
    print("PLANTED_CP_MARK", _MARK[0], flush=True)


_CALLS = [0]


def raises_on_rank_2(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, but rank 2 raises once its shard is longer than 3 tokens."""
    _note_pid()
    if dist.get_rank(kwargs.get("group")) == 2 and q.shape[1] > 3:
        raise RuntimeError("planted: rank 2 gave up")
    return D.ring_attention(q, k, v, **kwargs)


def dies_on_rank_1(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, but rank 1's process is killed (SIGKILL) at its third call."""
    _note_pid()
    _CALLS[0] += 1
    if dist.get_rank(kwargs.get("group")) == 1 and _CALLS[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return D.ring_attention(q, k, v, **kwargs)


def hangs_on_rank_3(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, but rank 3 never returns from a shard of more than 2 tokens."""
    _note_pid()
    if dist.get_rank(kwargs.get("group")) == 3 and q.shape[1] > 2:
        time.sleep(3600)
    return D.ring_attention(q, k, v, **kwargs)


def dq_doubled(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, but each rank's query gradient doubled on its way back (a
    backward that adds a rank's share twice): the output is right, dQ is not."""
    q = q.view_as(q)
    if q.requires_grad:
        q.register_hook(lambda g: 2 * g)  # type: ignore[no-untyped-call]
    return D.ring_attention(q, k, v, **kwargs)


for _fn in (raises_on_rank_2, dies_on_rank_1, hangs_on_rank_3, dq_doubled):
    _fn.capabilities = CAPS  # type: ignore[attr-defined]


def full_group_only(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference on the process group of every rank; a call on a subgroup (a
    smaller world size) raises, as a library that takes only the default group does
    (or hangs, until gloo's timeout)."""
    group = kwargs.get("group")
    if dist.get_world_size(group) != dist.get_world_size():
        raise RuntimeError("planted: only the default process group")
    return D.ring_attention(q, k, v, **kwargs)


full_group_only.capabilities = replace(CAPS, cp_full_group=True)  # type: ignore[attr-defined]


def contiguous_only(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference on contiguous shards; a zigzag call raises, as a ring library
    of contiguous shards only does (or reads the shards in the wrong order)."""
    if kwargs.get("sharding", "contiguous") != "contiguous":
        raise ValueError("planted: contiguous shards only")
    return D.ring_attention(q, k, v, **kwargs)


contiguous_only.capabilities = replace(CAPS, cp_shardings=("contiguous",))  # type: ignore[attr-defined]


# ------------------------------------------------------------ games with the bench


def wrong_one_in_ten(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, but every tenth call's output is garbage on every rank (never
    the first): a bench that checks two timed calls of ten misses it most of the time."""
    _CALLS[0] += 1
    out = D.ring_attention(q, k, v, **kwargs)
    assert isinstance(out, Tensor)  # no return_lse: the bench asks for none
    return torch.full_like(out, 3.0) if _CALLS[0] % 10 == 0 else out


_real_perf = time.perf_counter
_start = _real_perf()


def _slow_perf() -> float:
    return _start + (_real_perf() - _start) / 10


def slow_clock(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, in a process whose ``time.perf_counter`` runs ten times slow
    (set at its first call): a bench that times with the ranks' clocks reports it ten
    times faster."""
    time.perf_counter = _slow_perf
    return D.ring_attention(q, k, v, **kwargs)


for _fn in (wrong_one_in_ten, slow_clock):
    _fn.capabilities = CAPS  # type: ignore[attr-defined]


def _forkserver_reachable() -> str:
    """Whether this process can connect to a forkserver socket (in a ``pymp-*`` folder
    of the judge's temporary folder, the scratch folder's parent; earlier runs may have
    left dead ones): ``done`` if to any, else ``none``."""
    import glob
    import socket

    judge_tmp = os.path.dirname(os.environ.get("TMPDIR", "/tmp/x"))
    for path in glob.glob(os.path.join(judge_tmp, "pymp-*", "listener-*")):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            return "done"
        except OSError:
            continue
    return "none"


def reaches_forkserver(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The ring reference, after trying to connect to the forkserver's socket (which
    forks, for whoever asks, a process outside any sandbox) and printing how it went:
    ``PLANTED_CP_FORKSERVER done`` or ``none``."""
    # one write of one line, which the ranks' lines cannot split
    os.write(1, f"PLANTED_CP_FORKSERVER {_forkserver_reachable()}\n".encode())
    return D.ring_attention(q, k, v, **kwargs)


reaches_forkserver.capabilities = CAPS  # type: ignore[attr-defined]
