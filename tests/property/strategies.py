"""Hypothesis strategies shared by every property test.

Tensors are drawn from a seeded ``torch.Generator`` (``randn``, never ``rand``, which
hides masking bugs) so that Hypothesis draws and shrinks the *shapes and flags*, and a
seed reproduces the values.
"""

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import Tensor

from attnref.devices import dtype_name

MASK_KINDS = (
    "none",
    "bool",
    "float",
    "additive_bool",
    "padding",
    "causal_top_left",
    "causal_bottom_right",
    "bool_and_causal",
)
LAYOUTS = ("contiguous", "transposed", "sliced", "broadcast")
HALF = (torch.float16, torch.bfloat16)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_tensor(
    shape: tuple[int, ...], gen: torch.Generator, layout: str = "contiguous", amp: float = 1.0
) -> Tensor:
    """``amp * randn(shape)`` in float32, stored with the requested memory layout."""
    if layout == "transposed" and len(shape) >= 2:
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return (amp * torch.randn(swapped, generator=gen)).transpose(-1, -2)
    if layout == "sliced":
        wide = amp * torch.randn((*shape[:-1], 2 * shape[-1] + 1), generator=gen)
        return wide[..., 1 : shape[-1] + 1]  # storage offset and a non-unit row stride
    if layout == "broadcast" and len(shape) >= 3:
        one = amp * torch.randn((1, *shape[1:]), generator=gen)
        return one.expand(shape)  # stride 0 on the leading dim
    return amp * torch.randn(shape, generator=gen)


@dataclass
class AttnCase:
    """One call of an SDPA-shaped function, and how to make it."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    is_causal: bool = False
    alignment: str = "top_left"
    scale: float | None = None
    enable_gqa: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """Shapes, strides, flags and seed: the values follow from the seed."""

        def t(x: Tensor | None) -> str:
            if x is None:
                return "None"
            return f"{dtype_name(x.dtype)}{list(x.shape)} stride={x.stride()}"

        return (
            f"AttnCase(query={t(self.query)}, key={t(self.key)}, value={t(self.value)}, "
            f"attn_mask={t(self.attn_mask)}, is_causal={self.is_causal}, "
            f"alignment={self.alignment!r}, scale={self.scale}, enable_gqa={self.enable_gqa}, "
            f"info={self.info})"
        )

    @property
    def scores_shape(self) -> tuple[int, ...]:
        return (*self.query.shape[:-1], self.key.shape[-2])

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`attnref.functional.scaled_dot_product_attention`."""
        return {
            "attn_mask": self.attn_mask,
            "is_causal": self.is_causal,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
            "causal_alignment": self.alignment,
        }

    def visible(self) -> np.ndarray:
        """Which keys each query may see, computed independently of attnref.masks."""
        shape = self.scores_shape
        vis = np.ones(shape, dtype=bool)
        if self.attn_mask is not None:
            m = self.attn_mask
            hidden_by = m if m.dtype == torch.bool else m != float("-inf")
            vis &= np.broadcast_to(hidden_by.numpy(), shape)
        if self.is_causal:
            Tq, Tk = shape[-2], shape[-1]
            offset = 0 if self.alignment == "top_left" else Tk - Tq
            vis &= np.tril(np.ones((Tq, Tk), dtype=bool), k=offset)
        return vis

    def torch_kwargs(self) -> dict[str, Any]:
        """The same call expressed for ``torch.nn.functional.scaled_dot_product_attention``.

        torch knows only top-left causal and refuses ``is_causal`` with a mask, so those
        cases go through an explicit boolean mask.
        """
        simple_causal = self.is_causal and self.alignment == "top_left" and self.attn_mask is None
        if not self.is_causal or simple_causal:
            mask = self.attn_mask
        else:
            mask = torch.from_numpy(self.visible().copy())
        return {
            "attn_mask": mask,
            "is_causal": simple_causal,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
        }


def _mask_shape(draw: st.DrawFn, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``full``: some dims set to 1, some leading dims dropped."""
    kept = tuple(n if draw(st.booleans()) else 1 for n in full[:-2])
    tail = tuple(n if draw(st.integers(0, 3)) else 1 for n in full[-2:])
    shape = kept + tail
    drop = draw(st.integers(0, len(kept)))
    return shape[drop:]


@st.composite
def attention_cases(
    draw: st.DrawFn,
    *,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    mask_kinds: tuple[str, ...] = MASK_KINDS,
    gqa: bool = True,
    layouts: tuple[str, ...] = LAYOUTS,
    max_len: int = 13,
    hot: bool = True,
    max_batch_dims: int = 2,
) -> AttnCase:
    """An SDPA call: odd, prime and unit lengths, Tq != Tk, masks of every form, GQA,
    non-contiguous, offset and stride-0 inputs, "hot" inputs and low precision."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=max_batch_dims)))
    h = draw(st.sampled_from([1, 2, 3, 4, 6]))
    g = draw(st.sampled_from(divisors(h))) if gqa else h
    Tq, Tk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    Dh, Dv = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(dtypes))
    amp = draw(st.sampled_from([1.0, 1.0, 4.0])) if hot else 1.0
    layout = draw(st.sampled_from(layouts))
    q = make_tensor((*batch, h, Tq, Dh), gen, layout, amp)
    k = make_tensor((*batch, g, Tk, Dh), gen, layout, amp)
    v = make_tensor((*batch, g, Tk, Dv), gen, layout)
    full = (*batch, h, Tq, Tk)
    kind = draw(st.sampled_from(mask_kinds))
    mask: Tensor | None = None
    if kind in ("bool", "additive_bool", "bool_and_causal"):
        density = draw(st.sampled_from([0.2, 0.5, 0.9]))
        mask = torch.rand(_mask_shape(draw, full), generator=gen) < density
        if kind == "additive_bool":
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    elif kind == "float":
        shape = _mask_shape(draw, full)
        mask = torch.randn(shape, generator=gen)
        mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.3, float("-inf"))
    elif kind == "padding":
        lens = torch.randint(0, Tk + 1, batch or (1,), generator=gen)
        mask = (torch.arange(Tk) < lens.reshape(-1, 1)).reshape(*batch, 1, 1, Tk)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    alignment = "bottom_right" if kind == "causal_bottom_right" else "top_left"
    if kind == "bool_and_causal":
        alignment = draw(st.sampled_from(["top_left", "bottom_right"]))
    scale = draw(st.sampled_from([None, None, 0.3, 2.0]))
    return AttnCase(
        query=q.to(dtype),
        key=k.to(dtype),
        value=v.to(dtype),
        attn_mask=mask,
        is_causal=kind.startswith("causal") or kind == "bool_and_causal",
        alignment=alignment,
        scale=scale,
        enable_gqa=g != h,
        info={"mask": kind, "layout": layout, "amp": amp, "seed": seed},
    )
