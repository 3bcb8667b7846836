"""Masks: which keys may each query see.

Polarity everywhere in attnref: a boolean mask is ``True`` where the query **may attend**
to the key (torch SDPA and the Annotated Transformer); an additive float mask holds ``0``
there and ``-inf`` where it may not. ``valid_lens`` follows D2L: shape ``(B,)`` gives one
length per sample, ``(B, Tq)`` one length per query.

Causal alignment when ``Tq != Tk``:

- ``"top_left"`` (torch's ``is_causal``): query ``i`` sees keys ``j <= i``.
- ``"bottom_right"`` (FlashAttention, KV-cache decoding): query ``i`` sits at position
  ``Tk - Tq + i`` and sees keys ``j <= Tk - Tq + i``.
"""

import math
from typing import Literal, get_args

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from attnref._checking import checked, checked_internal

__all__ = [
    "Alignment",
    "additive_mask",
    "causal_block",
    "causal_mask",
    "causal_offset",
    "check_alignment",
    "check_valid_lens",
    "check_window",
    "make_std_mask",
    "padding_mask",
    "sequence_mask",
    "sliding_window_mask",
    "subsequent_mask",
    "valid_lens_to_mask",
    "window_block",
]

Alignment = Literal["top_left", "bottom_right"]
ALIGNMENTS: tuple[str, ...] = get_args(Alignment)


def check_alignment(alignment: str) -> None:
    """Raise ``ValueError`` unless ``alignment`` is a known causal alignment."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {alignment!r}")


def causal_offset(num_queries: int, num_keys: int, alignment: str) -> int:
    """Query ``i`` may see key ``j`` iff ``j <= i + offset``; this returns ``offset``."""
    check_alignment(alignment)
    return 0 if alignment == "top_left" else num_keys - num_queries


@checked
def causal_block(
    num_queries: int,
    start: int,
    stop: int,
    offset: int,
    device: torch.device | str | None = None,
    rows: Int[Tensor, " n"] | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Causal visibility of every query against the block of keys ``start .. stop - 1``.

    The one place the causal diagonal is computed: a full mask is the block ``0 .. Tk``;
    chunked attention asks for one block at a time (``Tk`` is then the block's width).
    Query ``i`` sees key ``j`` iff ``j <= i + offset`` (see `causal_offset`). ``rows``:
    only these queries (indices into ``0 .. num_queries - 1``), one row each, in order
    (a sampled oracle's rows).
    """
    at = _query_rows(num_queries, rows, device).unsqueeze(-1)  # (Tq, 1)
    cols = torch.arange(start, stop, device=device)  # (stop - start,)
    return cols <= at + offset


@checked_internal
def _query_rows(
    num_queries: int, rows: Int[Tensor, " n"] | None, device: torch.device | str | None
) -> Int[Tensor, " m"]:
    """The query indices a block is computed for: ``rows``, or every query."""
    if rows is None:
        return torch.arange(num_queries, device=device)
    return rows.to(device=device, dtype=torch.int64)


#: a sliding window ``(left, right)``: query ``i`` at position ``p`` sees keys
#: ``p - left .. p + right``, both ends inclusive; ``-1`` leaves that side unbounded
Window = tuple[int, int]


def check_window(window: object) -> None:
    """Raise ``ValueError`` unless ``window`` is ``(left, right)``, two ints ``>= -1``."""
    ok = (
        isinstance(window, tuple | list)
        and len(window) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    )
    if not ok:
        raise ValueError(
            f"window must be (left, right), two ints >= -1 (-1: unbounded), got {window!r}"
        )


@checked
def window_block(
    num_queries: int,
    start: int,
    stop: int,
    offset: int,
    window: Window,
    device: torch.device | str | None = None,
    rows: Int[Tensor, " n"] | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Sliding-window visibility of every query against the keys ``start .. stop - 1``.

    The one place the window is computed. Query ``i`` sits at position ``p = i + offset``
    (`causal_offset` of the alignment) and sees key ``j`` iff
    ``p - left <= j <= p + right``, both ends inclusive (FlashAttention's
    ``window_size``); ``-1`` leaves that side unbounded. ``rows``: only these queries,
    as for `causal_block`.
    """
    check_window(window)
    left, right = window
    pos = _query_rows(num_queries, rows, device).unsqueeze(-1) + offset  # (Tq, 1)
    cols = torch.arange(start, stop, device=device)  # (stop - start,)
    seen = torch.ones((pos.shape[0], stop - start), dtype=torch.bool, device=device)
    if left >= 0:
        seen = seen & (cols >= pos - left)
    if right >= 0:
        seen = seen & (cols <= pos + right)
    return seen


@checked
def sliding_window_mask(
    num_queries: int,
    num_keys: int,
    window: Window,
    alignment: Alignment = "bottom_right",
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """The keys each query sees through the sliding window ``(left, right)``.

    ``alignment`` places query ``i`` at position ``i`` (``top_left``) or
    ``Tk - Tq + i`` (``bottom_right``, FlashAttention's). A causal sliding window of
    ``w`` keys, the query's own included, is ``(w - 1, 0)``.

    Raises:
        ValueError: a bad window, an unknown alignment or a negative length.
    """
    if num_queries < 0 or num_keys < 0:
        raise ValueError(f"lengths must be >= 0, got Tq={num_queries}, Tk={num_keys}")
    offset = causal_offset(num_queries, num_keys, alignment)
    return window_block(num_queries, 0, num_keys, offset, window, device)


@checked
def check_valid_lens(valid_lens: Int[Tensor, "*shape"], num_keys: int) -> None:
    """Raise ``ValueError`` unless every length lies in ``[0, num_keys]``."""
    if valid_lens.numel() == 0:
        return
    low, high = int(valid_lens.min()), int(valid_lens.max())
    if low < 0 or high > num_keys:
        raise ValueError(
            f"valid_lens must lie in [0, {num_keys}] (the number of keys), "
            f"got values from {low} to {high}"
        )


@checked
def sequence_mask(
    X: Shaped[Tensor, "N T"], valid_len: Int[Tensor, " N"], value: float = 0.0
) -> Shaped[Tensor, "N T"]:
    """D2L's ``sequence_mask``: entries of row ``n`` past ``valid_len[n]`` become ``value``.

    Unlike D2L, returns a new tensor rather than writing into ``X``.

    Args:
        X: the rows to mask.
        valid_len: how many leading entries of each row are kept.
        value: what the masked entries become.

    Raises:
        ValueError: a length is negative or longer than the row.
    """
    check_valid_lens(valid_len, X.shape[1])
    keep = torch.arange(X.shape[1], device=X.device) < valid_len.unsqueeze(-1)  # (N, T)
    return X.masked_fill(~keep, value)


@checked
def valid_lens_to_mask(
    valid_lens: Int[Tensor, " B"] | Int[Tensor, "B Tq"], num_queries: int, num_keys: int
) -> Bool[Tensor, "B Tq Tk"]:
    """Turn D2L's ``valid_lens`` into a boolean visibility mask.

    Args:
        valid_lens: ``(B,)``: query ``i`` of sample ``b`` sees keys ``j < valid_lens[b]``;
            ``(B, Tq)``: it sees keys ``j < valid_lens[b, i]``.
        num_queries: ``Tq``.
        num_keys: ``Tk``.

    Returns:
        ``mask[b, i, j]``: may query ``i`` of sample ``b`` attend to key ``j``.

    Raises:
        ValueError: a length outside ``[0, Tk]``, or a 2-D ``valid_lens`` whose second dim
            is not ``num_queries``.
    """
    if valid_lens.dim() == 2 and valid_lens.shape[1] != num_queries:
        raise ValueError(
            f"valid_lens of shape {tuple(valid_lens.shape)} has one length per query, "
            f"but there are {num_queries} queries"
        )
    check_valid_lens(valid_lens, num_keys)
    lens = valid_lens.unsqueeze(-1) if valid_lens.dim() == 2 else valid_lens.view(-1, 1, 1)
    keys = torch.arange(num_keys, device=valid_lens.device)  # (Tk,)
    return (keys < lens).expand(valid_lens.shape[0], num_queries, num_keys)


@checked
def padding_mask(tokens: Int[Tensor, "B T"], pad: int) -> Bool[Tensor, "B 1 T"]:
    """Keys that are not padding: the Annotated Transformer's ``(src != pad).unsqueeze(-2)``.

    The singleton middle dim broadcasts over queries.
    """
    return (tokens != pad).unsqueeze(-2)


@checked
def subsequent_mask(size: int, device: torch.device | str | None = None) -> Bool[Tensor, "1 T T"]:
    """The Annotated Transformer's mask: position ``i`` sees positions ``j <= i``.

    Raises:
        ValueError: ``size`` is negative.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    return causal_block(size, 0, size, 0, device).unsqueeze(0)


@checked
def causal_mask(
    num_queries: int,
    num_keys: int,
    alignment: Alignment = "top_left",
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Causal visibility for ``Tq`` queries against ``Tk`` keys under ``alignment``.

    Raises:
        ValueError: an unknown alignment or a negative length.
    """
    if num_queries < 0 or num_keys < 0:
        raise ValueError(f"lengths must be >= 0, got Tq={num_queries}, Tk={num_keys}")
    offset = causal_offset(num_queries, num_keys, alignment)
    return causal_block(num_queries, 0, num_keys, offset, device)


@checked
def make_std_mask(tgt: Int[Tensor, "B T"], pad: int) -> Bool[Tensor, "B T T"]:
    """Decoder self-attention mask: hide padding keys AND future positions.

    The Annotated Transformer's ``make_std_mask``.
    """
    causal = subsequent_mask(tgt.shape[-1], device=tgt.device)  # (1, T, T)
    return padding_mask(tgt, pad) & causal


@checked
def additive_mask(
    mask: Bool[Tensor, "*shape"], dtype: torch.dtype = torch.float32, fill: float = -math.inf
) -> Float[Tensor, "*shape"]:
    """Boolean visibility to an additive float mask: ``0`` where visible, ``fill``
    elsewhere (``-inf``; or the finite ``torch.finfo(dtype).min`` many libraries use, so
    that a query that sees no key averages V).

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, fill)
