"""Reference context-parallel attention on torch.distributed: the sequence split across ranks.

When a sequence no longer fits one device, attention is split by position. Every rank
holds its shard of the queries, keys and values, ``(B, T_local, h, D)`` (the keys and
values may have ``g`` heads, GQA), and returns its shard of the output; every position is
global, so query ``i`` of the sequence sees key ``j <= i`` under ``causal`` whichever
ranks hold them. Three ways to compute it, each differentiable, with each gradient
arriving on the rank that owns its shard:

- `ring_attention`: the K/V shards travel around the ring of ranks (``isend``/``irecv``
  to the next rank, ``W - 1`` steps); each rank attends its queries to the block it holds
  at each step (the diagonal step under the causal mask, blocks a query cannot see
  skipped) and merges the partial outputs by their log-sum-exps (`merge_attention`). A
  sink is applied once, after the last merge. Each rank sends ``(W - 1) / W`` of K and of
  V: ``2 (W - 1) / W`` of K's size when ``Dv = Dqk``.
- `allgather_attention`: every rank gathers the whole K and V and attends its queries.
- `alltoall_attention` (DeepSpeed-Ulysses): an all-to-all re-shards from positions to
  heads, each rank attends the whole sequence for ``h / W`` of the heads, and a second
  all-to-all shards the output back.

The shards follow ``torch.tensor_split`` (`shard_spans`): ``"contiguous"`` gives rank
``r`` the ``r``-th of ``W`` chunks; ``"zigzag"`` splits the sequence into ``2W`` chunks
and gives rank ``r`` chunks ``r`` and ``2W - 1 - r``, concatenated in that order, which
balances causal work (the ring-flash-attention and torchtitan layout). When ``T`` is not
a multiple of the chunk count the first chunks are one token longer, and a chunk may be
empty. `shard` and `unshard` move a whole tensor to and from that layout.

Communication goes through one differentiable primitive, `exchange` (point-to-point
sends and receives, whose backward sends the gradients back the way the values came), so
the three run on any backend with ``isend``/``irecv`` (gloo on the CPU, NCCL on CUDA).
`sent_bytes` counts what this process has sent, for the benchmark.
"""

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from jaxtyping import Bool, Float, Int
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked

__all__ = [
    "SHARDINGS",
    "allgather_attention",
    "alltoall_attention",
    "chunk_count",
    "exchange",
    "positions",
    "reset_sent_bytes",
    "ring_attention",
    "send_receive",
    "sent_bytes",
    "shard",
    "shard_spans",
    "tie",
    "unshard",
    "visible_keys",
]

Sharding = Literal["contiguous", "zigzag"]
#: the shardings a context-parallel call takes
SHARDINGS: tuple[Sharding, ...] = ("contiguous", "zigzag")
Group = Any  # a torch.distributed ProcessGroup, or None for the default group

_SENT = [0]  # bytes this process has sent through `exchange`


def sent_bytes() -> int:
    """Bytes this process has sent through `exchange` since `reset_sent_bytes`."""
    return _SENT[0]


def reset_sent_bytes() -> None:
    _SENT[0] = 0


# --------------------------------------------------------------------- the layout


def _check_sharding(sharding: str, world: int) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if world < 1:
        raise ValueError(f"the world size must be >= 1, got {world}")


def chunk_count(world: int, sharding: str) -> int:
    """How many chunks ``sharding`` cuts a sequence into over ``world`` ranks: one a
    rank (contiguous), two a rank (zigzag)."""
    return 2 * world if sharding == "zigzag" else world


def shard_spans(T: int, world: int, sharding: str) -> list[list[tuple[int, int]]]:
    """Each rank's spans of the sequence ``[start, end)``, in the order it holds them."""
    _check_sharding(sharding, world)
    chunks = chunk_count(world, sharding)
    bounds = [len(c) for c in torch.arange(T).tensor_split(chunks)]
    starts = [sum(bounds[:i]) for i in range(chunks + 1)]
    span = [(starts[i], starts[i + 1]) for i in range(chunks)]
    if sharding == "contiguous":
        return [[span[r]] for r in range(world)]
    return [[span[r], span[2 * world - 1 - r]] for r in range(world)]


@checked
def positions(T: int, rank: int, world: int, sharding: str) -> Int[Tensor, " T_local"]:
    """The global positions of rank ``rank``'s tokens, in the order it holds them."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    spans = shard_spans(T, world, sharding)[rank]
    return torch.cat([torch.arange(a, b) for a, b in spans])


@checked
def shard(
    x: Float[Tensor, "B T *rest"], rank: int, world: int, sharding: str = "contiguous"
) -> Float[Tensor, "B T_local *rest"]:
    """Rank ``rank``'s shard of ``x`` (positions along dim 1)."""
    return x[:, positions(x.shape[1], rank, world, sharding).to(x.device)]


@checked
def unshard(
    parts: list[Float[Tensor, "..."]], sharding: str = "contiguous", dim: int = 1
) -> Float[Tensor, "..."]:
    """The whole tensor from every rank's shard (``parts[r]`` rank ``r``'s), along ``dim``."""
    world = len(parts)
    T = sum(p.shape[dim] for p in parts)
    order = torch.cat([positions(T, r, world, sharding) for r in range(world)])
    whole = torch.cat(parts, dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T)
    return whole.index_select(dim, inverse.to(whole.device))


# ------------------------------------------------------------ the communication


def _world(group: Group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group: Group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


@checked
def send_receive(
    group: Group,
    sends: list[Float[Tensor, "..."] | None],
    shapes: list[tuple[int, ...] | None],
    like: Float[Tensor, "..."],
) -> list[Float[Tensor, "..."] | None]:
    """``sends[d]`` to rank ``d``, and a tensor of ``shapes[s]`` (of ``like``'s dtype and
    device) from rank ``s`` (None: nothing either way); not differentiable (`exchange`
    is). Every rank posts its sends and receives at once, so the order
    peers answer in cannot deadlock. An empty tensor is neither sent nor received."""
    rank, world = _world(group)
    received: list[Tensor | None] = [None] * world
    ops = []
    for peer in range(world):
        shape = shapes[peer]
        if shape is None:
            continue
        if peer == rank:
            mine = sends[rank]
            received[rank] = None if mine is None else mine.clone()
            continue
        buffer = like.new_empty(shape)
        received[peer] = buffer
        if buffer.numel():
            ops.append(dist.P2POp(dist.irecv, buffer, _peer(group, peer), group))
    for peer, x in enumerate(sends):
        if x is None or peer == rank or not x.numel():
            continue
        x = x.contiguous()
        _SENT[0] += x.numel() * x.element_size()
        ops.append(dist.P2POp(dist.isend, x, _peer(group, peer), group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


class _Exchange(torch.autograd.Function):
    """`exchange` with a backward that sends each gradient back to where its value came
    from (the same point-to-point pattern, reversed)."""

    @staticmethod
    def forward(ctx: Any, group: Group, shapes: list[Any], *sends: Tensor) -> tuple[Tensor, ...]:
        like = next(s for s in sends if s is not None)
        given: list[Tensor | None] = [s if s.dim() else None for s in sends]
        ctx.group = group
        ctx.sent_shapes = [None if s is None else tuple(s.shape) for s in given]
        got = send_receive(group, given, shapes, like)
        ctx.like = like.new_empty(0)
        return tuple(like.new_empty(()) if g is None else g for g in got)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        back: list[Tensor | None] = [g if g.dim() else None for g in grads]
        got = send_receive(ctx.group, back, ctx.sent_shapes, ctx.like)
        return (None, None, *(ctx.like.new_empty(()) if g is None else g for g in got))


class _Tie(torch.autograd.Function):
    """``out`` unchanged, depending on ``others`` with a zero gradient: the backward then
    reaches every exchange, on every rank alike, whether its result was used or not."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *others: Tensor) -> Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, ...]:
        zeros = (torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes)
        return (grad, *zeros)


@checked
def tie(
    out: Float[Tensor, "*shape"], others: list[Float[Tensor, "..."]]
) -> Float[Tensor, "*shape"]:
    """``out``, made to depend on ``others`` with a zero gradient: a ring step's
    exchange then runs in every rank's backward alike, whether the rank read the block
    it received or skipped it (a backward that skips an exchange its peers run
    deadlocks them)."""
    tied: Tensor = _Tie.apply(out, *others)  # type: ignore[no-untyped-call]
    return tied


@checked
def exchange(
    sends: list[Float[Tensor, "..."] | None],
    shapes: list[tuple[int, ...] | None],
    group: Group = None,
) -> list[Float[Tensor, "..."] | None]:
    """Point-to-point all-to-all, differentiable: ``sends[d]`` goes to rank ``d`` and
    ``shapes[s]`` is the shape of what rank ``s`` sends here (None: nothing), received as
    ``result[s]``. Each rank must pass the shapes its peers send (they follow from the
    layout, `shard_spans`). The backward returns every gradient to the rank that sent
    the value."""
    like = next((s for s in sends if s is not None), None)
    if like is None:
        raise ValueError("exchange needs at least one tensor to send (its dtype and device)")
    placeholder = like.new_empty(())
    filled = [placeholder if s is None else s for s in sends]
    got = _Exchange.apply(group, shapes, *filled)  # type: ignore[no-untyped-call]
    return [None if shapes[s] is None else got[s] for s in range(len(shapes))]


def _lengths(group: Group, T_local: int, device: torch.device) -> list[int]:
    """Every rank's local length (an all-gather of one int)."""
    _, world = _world(group)
    mine = torch.tensor([T_local], dtype=torch.int64, device=device)
    everyone = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [int(t) for t in everyone]


# ------------------------------------------------------------- the attention


def _check(
    q: Tensor, k: Tensor, v: Tensor, sharding: str, group: Group, window_size: tuple[int, int]
) -> tuple[int, int, list[int]]:
    rank, world = _world(group)
    _check_sharding(sharding, world)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must be (B, T_local, heads, D), got {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share B and "
            "T_local, k and v their heads, q and k their head dim"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"the key/value heads ({k.shape[2]}) must divide h ({q.shape[2]})")
    if len(window_size) != 2 or min(window_size) < -1:
        raise ValueError(f"window_size must be (left, right), each >= -1, got {window_size}")
    lengths = _lengths(group, q.shape[1], q.device)
    T = sum(lengths)
    expected = [sum(b - a for a, b in spans) for spans in shard_spans(T, world, sharding)]
    if lengths != expected:
        raise ValueError(
            f"the shards' lengths {lengths} are not the {sharding} layout of {T} tokens on "
            f"{world} ranks ({expected}: torch.tensor_split's chunks)"
        )
    return rank, world, lengths


@checked
def visible_keys(
    pos_q: Int[Tensor, " Tq"],
    pos_k: Int[Tensor, " Tk"],
    causal: bool,
    window_size: tuple[int, int],
) -> Bool[Tensor, "Tq Tk"]:
    """Which keys each query sees, by global position: query ``i`` sees key ``j`` when
    ``j <= i`` under ``causal``, and ``i - left <= j <= i + right`` in a window ``(left,
    right)`` (a side of ``-1`` unbounded)."""
    diff = pos_q.unsqueeze(-1) - pos_k.unsqueeze(0)  # i - j
    seen = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    if causal:
        seen &= diff >= 0
    left, right = window_size
    if left >= 0:
        seen &= diff <= left
    if right >= 0:
        seen &= -diff <= right
    return seen


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seen: Tensor,
    scale: float | None,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """``(B, Tq, h, D)`` queries against ``(B, Tk, g, D)`` keys where ``seen``: the
    output ``(B, h, Tq, Dv)`` and LSE ``(B, h, Tq)``, in the queries' (float32 or wider)
    dtype."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=seen.to(q.device),
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
        softcap=softcap,
        return_lse=True,
    )
    return out, lse


def _finish(
    out: Tensor, lse: Tensor, sinks: Tensor | None, dtype: torch.dtype, return_lse: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """The merged ``(B, h, Tq, Dv)`` output with the sink applied once, in ``(B, Tq, h,
    Dv)`` and ``dtype``; the LSE (of the keys, the sink not counted) when asked."""
    if sinks is not None:
        out = F.apply_sinks(out, lse, sinks)
    result = out.transpose(1, 2).to(dtype)
    return (result, lse) if return_lse else result


def _wide(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


Shard = Float[Tensor, "B T_local h D"]
KVShard = Float[Tensor, "B T_local g D"]
VShard = Float[Tensor, "B T_local g Dv"]
Result = (
    Float[Tensor, "B T_local h Dv"]
    | tuple[Float[Tensor, "B T_local h Dv"], Float[Tensor, "B h T_local"]]
)


@checked
def ring_attention(
    q: Shard,
    k: KVShard,
    v: VShard,
    *,
    group: Group = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sharding: str = "contiguous",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> Result:
    """Ring attention: this rank's shard of the output (and of the LSE, ``(B, h,
    T_local)``, with ``return_lse``), the K/V shards passed around the ring of ``group``.

    At step ``s`` this rank holds the K/V shard of rank ``r - s``: it attends its queries
    to the keys of it they see (by global position: the causal diagonal, the window
    ``(left, right)``), skips the step when they see none, merges the partial result with
    `merge_attention`, and passes the shard to rank ``r + 1``. Scores are softcapped in
    every step; the sink (one logit per head) is applied once, after the last merge. The
    partial results are kept in float32 (or the inputs' dtype when wider) and the output
    is rounded to the inputs' dtype once.

    Raises:
        ValueError: shapes that do not match, an unknown sharding, or shards whose
            lengths are not the sharding's layout.
    """
    rank, world, lengths = _check(q, k, v, sharding, group, window_size)
    T = sum(lengths)
    pos_q = positions(T, rank, world, sharding)
    owner_pos = [positions(T, r, world, sharding) for r in range(world)]
    wq = _wide(q)
    D, B, h, Dv = k.shape[-1], q.shape[0], q.shape[2], v.shape[-1]
    # K and V travel as one tensor: one chain of exchanges, whose backward every rank
    # runs in the same order
    kv = torch.cat([_wide(k), _wide(v)], dim=-1)
    held = [kv]
    out = wq.new_zeros((B, h, q.shape[1], Dv))
    lse = wq.new_full((B, h, q.shape[1]), -math.inf)
    for step in range(world):
        owner = (rank - step) % world
        seen = visible_keys(pos_q, owner_pos[owner], causal, window_size)
        if bool(seen.any()):  # a block none of these queries sees is passed on unread
            part, part_lse = _attend(wq, kv[..., :D], kv[..., D:], seen, softmax_scale, softcap)
            out, lse = F.merge_attention(out, lse, part, part_lse)
        if step == world - 1:
            break
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        sends: list[Tensor | None] = [None] * world
        sends[nxt] = kv
        shapes: list[tuple[int, ...] | None] = [None] * world
        shapes[prev] = (B, lengths[(owner - 1) % world], k.shape[2], D + Dv)
        got = exchange(sends, shapes, group)[prev]
        assert got is not None
        kv = got
        held.append(kv)
    out = tie(out, held)  # every exchange in the backward, on every rank
    return _finish(out, lse, sinks, q.dtype, return_lse)


def _gather(x: Tensor, lengths: list[int], sharding: str, group: Group) -> Tensor:
    """Every rank's shard of ``x``, in global order: the whole ``(B, T, ...)``."""
    world = _world(group)[1]
    shapes: list[tuple[int, ...] | None] = [(x.shape[0], n, *x.shape[2:]) for n in lengths]
    parts = exchange([x] * world, shapes, group)
    return unshard([p for p in parts if p is not None], sharding)


@checked
def allgather_attention(
    q: Shard,
    k: KVShard,
    v: VShard,
    *,
    group: Group = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sharding: str = "contiguous",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> Result:
    """All-gather attention: the whole K and V gathered on every rank, then this rank's
    queries attended to the keys they see by global position, in one call (the sink and
    softcap as the dense reference applies them). The gradient of K and V is summed back
    onto the rank that holds each shard."""
    rank, world, lengths = _check(q, k, v, sharding, group, window_size)
    T = sum(lengths)
    keys, values = (
        _gather(_wide(k), lengths, sharding, group),
        _gather(_wide(v), lengths, sharding, group),
    )
    seen = visible_keys(positions(T, rank, world, sharding), torch.arange(T), causal, window_size)
    out, lse = _attend(_wide(q), keys, values, seen, softmax_scale, softcap)
    return _finish(out, lse, sinks, q.dtype, return_lse)


def _to_heads(x: Tensor, lengths: list[int], sharding: str, group: Group) -> Tensor:
    """Sequence-sharded ``(B, T_local, H, D)`` to head-sharded ``(B, T, H / W, D)``
    (``H`` a multiple of the world size: rank ``d`` gets the ``d``-th ``H / W``)."""
    world = _world(group)[1]
    H = x.shape[2]
    part = H // world
    sends: list[Tensor | None] = [x[:, :, d * part : (d + 1) * part] for d in range(world)]
    shapes: list[tuple[int, ...] | None] = [(x.shape[0], n, part, x.shape[3]) for n in lengths]
    got = exchange(sends, shapes, group)
    return unshard([g for g in got if g is not None], sharding)


def _to_sequence(
    x: Tensor, lengths: list[int], sharding: str, group: Group, dim: int = 1
) -> Tensor:
    """Head-sharded, the whole sequence along ``dim`` (heads along ``dim + 1``), back to
    this rank's positions with every head."""
    rank, world = _world(group)
    T = sum(lengths)
    pieces = []
    for r in range(world):
        index = positions(T, r, world, sharding).to(x.device)
        pieces.append(x.index_select(dim, index))
    mine = list(x.shape)
    mine[dim] = lengths[rank]
    shapes: list[tuple[int, ...] | None] = [tuple(mine)] * world
    got = exchange(list(pieces), shapes, group)
    return torch.cat([g for g in got if g is not None], dim=dim + 1)


@checked
def alltoall_attention(
    q: Shard,
    k: KVShard,
    v: VShard,
    *,
    group: Group = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sharding: str = "contiguous",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> Result:
    """Ulysses attention: an all-to-all re-shards Q, K and V from positions to heads
    (each rank gets the whole sequence for ``h / W`` query heads and ``g / W`` key/value
    heads), each rank attends with the dense reference, and an all-to-all shards the
    output (and the LSE) back to positions.

    Raises:
        ValueError: as `ring_attention`, or head counts the world size does not divide.
    """
    rank, world, lengths = _check(q, k, v, sharding, group, window_size)
    h, g = q.shape[2], k.shape[2]
    if h % world or g % world:
        raise ValueError(
            f"alltoall_attention splits the heads across ranks: the world size ({world}) "
            f"must divide h ({h}) and the key/value heads ({g})"
        )
    T = sum(lengths)
    B, T_local, D, Dv = q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]
    # Q, K and V travel as one tensor per pair of ranks (one exchange each way, whose
    # backward every rank runs in the same order): (B, T_local, W, heads of a rank * D)
    hq, hk = h // world, g // world
    together = torch.cat(
        [_wide(t).reshape(B, T_local, world, t.shape[2] // world * t.shape[3]) for t in (q, k, v)],
        dim=-1,
    )
    whole = _to_heads(together, lengths, sharding, group).squeeze(2)  # (B, T, ...)
    qs, ks, vs = torch.split(whole, [hq * D, hk * D, hk * Dv], dim=-1)
    qs, ks, vs = qs.reshape(B, T, hq, D), ks.reshape(B, T, hk, D), vs.reshape(B, T, hk, Dv)
    seen = visible_keys(torch.arange(T), torch.arange(T), causal, window_size)
    out, lse = _attend(qs, ks, vs, seen, softmax_scale, softcap)  # (B, h/W, T, Dv)
    if sinks is not None:
        out = F.apply_sinks(out, lse, sinks[rank * hq : (rank + 1) * hq])
    # the output and the LSE back to positions, together: (B, T, h/W, Dv + 1)
    both = torch.cat([out, lse.unsqueeze(-1).to(out.dtype)], dim=-1).transpose(1, 2)
    mine = _to_sequence(both, lengths, sharding, group)  # (B, T_local, h, Dv + 1)
    result = mine[..., :Dv].to(q.dtype)
    if not return_lse:
        return result
    return result, mine[..., Dv].transpose(1, 2)
