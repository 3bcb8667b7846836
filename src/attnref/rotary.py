"""Rotary position embeddings (RoPE, Su et al. 2021), in both of their layouts.

A rotary embedding turns pairs of dims of a query or key at position ``m`` by the angles
``m * theta_i``, ``theta_i = base ** (-2 i / R)`` for ``i < R / 2``, so that the score
``<rope(q, m), rope(k, n)>`` depends on ``m - n`` only. Only the first ``R`` dims turn
(``R <= D``, even); the rest pass through. The two layouts pair the dims differently:

- ``interleaved=True`` (GPT-J): pairs ``(2i, 2i + 1)``;
- ``interleaved=False`` (GPT-NeoX, Llama): pairs ``(i, i + R / 2)``.

They are the same rotation after a fixed permutation of the first ``R`` dims
(`halves_from_interleaved`). FlashAttention takes the angle tables as ``cos``/``sin``
of shape ``(T_ro, R / 2)``; `rotary_tables` builds them.
"""

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from attnref._checking import checked
from attnref.functional import compute_dtype

__all__ = [
    "RotaryEmbedding",
    "check_rotary_dim",
    "halves_from_interleaved",
    "rotary",
    "rotary_tables",
]


def check_rotary_dim(rotary_dim: int, head_dim: int) -> None:
    """A clear error unless ``0 <= rotary_dim <= head_dim`` and ``rotary_dim`` is even."""
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise ValueError(f"rotary dim must be an int, got {rotary_dim!r}")
    if rotary_dim < 0 or rotary_dim % 2:
        raise ValueError(f"rotary dim must be even and >= 0, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary dim {rotary_dim} is larger than the head dim {head_dim}")


@checked
def rotary_tables(
    length: int,
    rotary_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[Float[Tensor, "T half"], Float[Tensor, "T half"]]:
    """``cos`` and ``sin`` of ``t * theta_i`` for positions ``t < length``, ``i < R / 2``
    (FlashAttention's ``rotary_cos``/``rotary_sin``), computed in float64."""
    check_rotary_dim(rotary_dim, rotary_dim)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not base > 1:
        raise ValueError(f"base must be > 1, got {base}")
    half = rotary_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = torch.exp(-math.log(base) * 2 * i / max(rotary_dim, 1))
    angles = torch.arange(length, dtype=torch.float64).unsqueeze(-1) * theta
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


@checked
def rotary(
    x: Float[Tensor, "*shape D"],
    cos: Float[Tensor, "*#shape half"],
    sin: Float[Tensor, "*#shape half"],
    *,
    interleaved: bool = False,
) -> Float[Tensor, "*shape D"]:
    """Rotate the first ``R = 2 * half`` dims of ``x`` by the angles whose cosines and
    sines are ``cos`` and ``sin`` (broadcast over ``x``'s leading dims); computed in
    float32 at least, returned in ``x``'s dtype.

    Raises:
        ValueError: ``R`` is larger than ``x``'s last dim.
    """
    half = cos.shape[-1]
    check_rotary_dim(2 * half, x.shape[-1])
    if half == 0:
        return x
    ctype = compute_dtype(x.dtype)
    rot, rest = x[..., : 2 * half].to(ctype), x[..., 2 * half :]
    c, s = cos.to(ctype), sin.to(ctype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


@checked
def halves_from_interleaved(rotary_dim: int, head_dim: int) -> Int[Tensor, " D"]:
    """The permutation of dims that makes the interleaved layout the halves one:
    ``rotary(x[..., p], interleaved=False) == rotary(x, interleaved=True)[..., p]``."""
    check_rotary_dim(rotary_dim, head_dim)
    pairs = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
    return torch.cat((pairs, torch.arange(rotary_dim, head_dim)))


class RotaryEmbedding(nn.Module):
    """Rotary positions for queries and keys ``(..., T, D)``, at positions
    ``offset .. offset + T - 1`` (``offset``: the tokens already in a KV cache).

    Args:
        rotary_dim: how many leading dims turn (even, at most the head dim).
        base: the frequency base (10000 in RoFormer and Llama).
        interleaved: GPT-J's pairs ``(2i, 2i + 1)`` rather than GPT-NeoX's halves.
    """

    def __init__(self, rotary_dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        check_rotary_dim(rotary_dim, rotary_dim)
        self.rotary_dim, self.base, self.interleaved = rotary_dim, base, interleaved

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base}, interleaved={self.interleaved}"

    @checked
    def forward(
        self, x: Float[Tensor, "*batch T D"], offset: int = 0
    ) -> Float[Tensor, "*batch T D"]:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        T = x.shape[-2]
        cos, sin = rotary_tables(offset + T, self.rotary_dim, self.base, torch.float64, x.device)
        return rotary(x, cos[offset:], sin[offset:], interleaved=self.interleaved)
