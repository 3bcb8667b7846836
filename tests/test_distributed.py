"""attnref.distributed: ring, all-gather and all-to-all attention against the dense reference.

One group of processes (gloo, on this machine's CPU) runs every configuration: worlds 1
to 4 (subgroups of the ranks), both shardings, causal or not, lengths not divisible by
``2W``, GQA, a window, softcap and sinks; each rank compares its shard of the output,
the LSE and the gradients with the dense float64 reference's, and the sinks' gradient
summed over the ranks.
"""

import itertools
import multiprocessing
import os
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from attnref import distributed as D
from attnref import functional as F
from attnref.conformance.families.context_parallel import free_port

FUNCTIONS = ("ring_attention", "allgather_attention", "alltoall_attention")


class Config(NamedTuple):
    name: str
    world: int
    sharding: D.Sharding
    causal: bool
    T: int
    h: int
    g: int
    variant: int  # 0: none, 1: a window and softcap, 2: sinks


#: the default tier's (sharding, causal) at each world size: every pair once per function
_COVER = {1: ("contiguous", False), 2: ("zigzag", True), 3: ("contiguous", True),
          4: ("zigzag", False)}  # fmt: skip


def _configs(slow: bool) -> list[Config]:
    """The slow tier: every combination at four lengths; the default: one length, and at
    each world size one (sharding, causal) pair (`_COVER`)."""
    lengths = (1, 7, 13, 24) if slow else (13,)
    out: list[Config] = []
    for name, world, sharding, causal, T in itertools.product(
        FUNCTIONS, (1, 2, 3, 4), D.SHARDINGS, (False, True), lengths
    ):
        h, g = (4, 4) if name == "alltoall_attention" else (6, 2)
        if name == "alltoall_attention" and 4 % world:
            continue
        if not slow and _COVER[world] != (sharding, causal):
            continue
        out.append(Config(name, world, sharding, causal, T, h, g, (T + world) % 3))
    return out


def _check_one(rank: int, groups: dict[int, dist.ProcessGroup], config: Config) -> str | None:
    name, world, sharding, causal, T, h, g, variant = config
    gen = torch.Generator().manual_seed(T * 31 + world)
    B, Dh, Dv = 2, 8, 5
    q = torch.randn(B, T, h, Dh, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, g, Dh, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, g, Dv, generator=gen, dtype=torch.float64)
    w = torch.randn(B, T, h, Dv, generator=gen, dtype=torch.float64)
    sinks = torch.randn(h, generator=gen, dtype=torch.float64) if variant == 2 else None
    window = (3, 1) if variant == 1 else (-1, -1)
    softcap = 2.0 if variant == 1 else 0.0
    if rank >= world:
        return None
    group = groups[world]
    mine = [D.shard(t, rank, world, sharding).requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    fn = getattr(D, name)
    out, lse = fn(
        *mine, group=group, causal=causal, sharding=sharding, window_size=window,
        softcap=softcap, sinks=s, return_lse=True,
    )  # fmt: skip
    (out * D.shard(w, rank, world, sharding)).sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    rs = None if sinks is None else sinks.clone().requires_grad_()
    fq, fk, fv = (t.transpose(1, 2) for t in full)
    ref, ref_lse = F.scaled_dot_product_attention(
        fq, fk, fv, is_causal=causal, enable_gqa=h != g,
        window=None if window == (-1, -1) else window, softcap=softcap, sinks=rs,
        return_lse=True,
    )  # fmt: skip
    (ref.transpose(1, 2) * w).sum().backward()  # type: ignore[no-untyped-call]
    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = [
        ("output", out, D.shard(ref.transpose(1, 2), rank, world, sharding)),
        ("lse", lse, D.shard(ref_lse.transpose(1, 2), rank, world, sharding).transpose(1, 2)),
    ]
    for what, piece, t in zip(("dq", "dk", "dv"), mine, full, strict=True):
        assert t.grad is not None
        grad = piece.grad
        if grad is None and piece.shape[1] == 0:  # an empty shard: nothing to differentiate
            grad = torch.zeros_like(piece)
        pairs.append((what, grad, D.shard(t.grad, rank, world, sharding)))
    if s is not None:
        assert rs is not None
        total = torch.zeros_like(s) if s.grad is None else s.grad.clone()
        dist.all_reduce(total, group=group)
        pairs.append(("dsinks", total, rs.grad))
    for what, got, want in pairs:
        assert want is not None
        if got is None or not torch.allclose(got, want, atol=1e-10, rtol=1e-9):
            err = "None" if got is None else f"{float((got - want).abs().max()):.3g}"
            return f"{config} rank {rank}: {what} differs by {err}"
    return None


def _run(rank: int, world: int, port: int, slow: bool, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
    torch.set_num_threads(1)
    failures = [f for c in _configs(slow) if (f := _check_one(rank, groups, c)) is not None]
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as out:
        out.write("\n".join(failures))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(tmp_path: object, slow: bool) -> list[str]:
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_run, args=(r, 4, port, slow, str(tmp_path))) for r in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=600)
    assert [p.exitcode for p in ranks] == [0] * 4, "a rank failed; its traceback is above"
    lines: list[str] = []
    for r in range(4):
        with open(os.path.join(str(tmp_path), f"rank{r}.txt")) as f:
            lines += [x for x in f.read().splitlines() if x]
    return lines


@pytest.mark.slow  # 20-32 s on a loaded machine: the default tier ran 240 s of its 180
def test_the_three_agree_with_the_dense_reference_on_every_rank(tmp_path: object) -> None:
    assert _spawn(tmp_path, slow=False) == []


@pytest.mark.slow
def test_the_three_agree_with_the_dense_reference_at_more_lengths(tmp_path: object) -> None:
    assert _spawn(tmp_path, slow=True) == []


def test_the_layout_follows_tensor_split() -> None:
    # 7 tokens in 2 * 3 zigzag chunks of 2 1 1 1 1 1; rank r holds chunks r and 5 - r
    assert D.shard_spans(7, 3, "zigzag") == [[(0, 2), (6, 7)], [(2, 3), (5, 6)], [(3, 4), (4, 5)]]
    # 2 tokens on 3 ranks: the last chunk is empty
    assert D.shard_spans(2, 3, "contiguous") == [[(0, 1)], [(1, 2)], [(2, 2)]]
    assert D.shard_spans(5, 2, "contiguous") == [[(0, 3)], [(3, 5)]]
    x = torch.arange(2 * 7 * 1 * 1, dtype=torch.float64).reshape(2, 7, 1, 1)
    parts = [D.shard(x, r, 3, "zigzag") for r in range(3)]
    assert torch.equal(D.unshard(parts, "zigzag"), x)
    assert D.positions(7, 1, 3, "zigzag").tolist() == [2, 5]


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="sharding must be one of contiguous, zigzag"):
        D.shard_spans(4, 2, "striped")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        D.positions(4, 2, 2, "contiguous")
