"""Backends that misbehave as programs, not as attention (importable as ``tests.planted:NAME``).

The attention bugs live in `attnref.conformance.mutants`; these check that the audit
reports a backend that raises, hangs, ends or crashes its process, changes its inputs or
returns the wrong thing, and still finishes with a report and exit code 1.
"""

import ctypes
import math
import os
import sys
import time
from typing import Any

import torch
from torch import Tensor


def raises(*args: Any, **kwargs: Any) -> Tensor:
    """Always raises."""
    raise RuntimeError("kernel launch failed\nsecond line of the message")


def wrong_shape(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Returns the query's first column."""
    return q[..., :1]


def wrong_dtype(*args: Any, **kwargs: Any) -> Tensor:
    """Returns float64 whatever the input dtype."""
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs).double()


def not_a_tensor(*args: Any, **kwargs: Any) -> Any:
    """Returns a list."""
    return [1, 2, 3]


def hangs(*args: Any, **kwargs: Any) -> Tensor:
    """Sleeps far longer than any timeout."""
    time.sleep(30)
    raise AssertionError("unreachable")


def refuses_masks(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """Refuses any mask with an error it declares as a refusal."""
    if attn_mask is not None:
        raise NotImplementedError("masks are not supported by this kernel")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def uniform_empty_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Correct, with the "uniform" policy: hidden scores are a finite minimum, so a query
    with no visible key averages V (declared as such)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    low = torch.finfo(torch.float32).min / 4
    mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=acc)
    if is_causal:
        mask = mask.masked_fill(~torch.ones_like(mask, dtype=torch.bool).tril(), low)
    if attn_mask is not None:
        extra = (
            torch.zeros(attn_mask.shape, dtype=acc).masked_fill(~attn_mask, low)
            if attn_mask.dtype == torch.bool
            else attn_mask.to(acc).clamp(min=low)
        )
        mask = mask + extra
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        q.to(acc), k.to(acc), v.to(acc), mask, scale=scale, enable_gqa=enable_gqa
    )
    return out.to(q.dtype)


def empty_rows_by_cause(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "top_left",
) -> Tensor:
    """Correct, with a result for a query that sees no key by what hid its keys, as real
    kernels have: zeros under a boolean mask (a safe softmax), NaN under a ``-inf`` float
    mask (a softmax of ``-inf``), the mean of V under its own causal diagonal (a finite
    fill value). Computes both alignments itself, never with a mask (declared below)."""
    from attnref.masks import causal_mask

    acc = torch.promote_types(q.dtype, torch.float32)
    h, Tq, Tk = q.shape[-3], q.shape[-2], k.shape[-2]
    kk, vv = (t.to(acc).repeat_interleave(h // k.shape[-3], dim=-3) for t in (k, v))
    s = q.shape[-1] ** -0.5 if q.shape[-1] else 1.0
    scores = (q.to(acc) @ kk.transpose(-2, -1)) * (s if scale is None else scale)
    empty = None
    if is_causal:
        seen = causal_mask(Tq, Tk, causal_alignment)  # type: ignore[arg-type]
        scores = scores.masked_fill(~seen, torch.finfo(acc).min / 4)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        empty = ~attn_mask.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~attn_mask, float("-inf")).masked_fill(empty, 0.0)
    elif attn_mask is not None:
        scores = scores + attn_mask.to(acc)
    probs = torch.softmax(scores, dim=-1)
    if q.dtype != acc:  # rounded once before P @ V, as a fused kernel does
        probs = probs.to(q.dtype).to(acc)
    out = probs @ vv
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out.to(q.dtype)


def nan_row_spreads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Declares the NaN policy for a query with no visible key, and keeps it, but its
    matmul spreads a NaN row to the row before it, as oneDNN's bfloat16 matmul does on
    CPUs with AMX (oneDNN#5717): a row that sees keys comes out NaN."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    if attn_mask is None:
        return out
    empty = _mask_empties(q, k, attn_mask)
    spread = empty | torch.cat([empty[..., 1:, :], torch.zeros_like(empty[..., :1, :])], -2)
    return out.masked_fill(spread, float("nan"))


def _mask_empties(q: Tensor, k: Tensor, attn_mask: Tensor) -> Tensor:
    """``(*batch, h, Tq, 1)``: the queries ``attn_mask`` leaves no key."""
    seen = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    return ~seen.expand(*q.shape[:-1], k.shape[-2]).any(dim=-1, keepdim=True)


def garbage_beside_empty_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """`nan_row_spreads`' rows, but with what uninitialised memory holds (inf, and
    values to 7e31) instead of a NaN: no matmul spreads that, and no hint may say so."""
    out = nan_row_spreads(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is None:
        return out
    empty = _mask_empties(q, k, attn_mask)
    garbage = torch.full_like(out, float("inf"))
    garbage[..., 1:] = 7e31
    return torch.where(torch.isnan(out) & ~empty, garbage, out)  # empty rows keep NaN


def no_mask_argument(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Lacks SDPA's keyword arguments."""
    return query


NOT_CALLABLE = 3


def _sdpa(*args: Any, **kwargs: Any) -> Tensor:
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    return out


def exits_0(*args: Any, **kwargs: Any) -> Tensor:
    """Ends its process with exit code 0, as if all were well."""
    os._exit(0)


def exits_3(*args: Any, **kwargs: Any) -> Tensor:
    """Ends its process with exit code 3 (attnref's own code for its internal errors)."""
    os._exit(3)


def segfaults(*args: Any, **kwargs: Any) -> Tensor:
    """Reads address 0: SIGSEGV."""
    ctypes.string_at(0)
    raise AssertionError("unreachable")


def aborts(*args: Any, **kwargs: Any) -> Tensor:
    """Says why, then calls abort(): SIGABRT, as a failed C++ assertion or JAX's bfloat16
    path does."""
    print("kernel.cpp:42: assert failed (head_dim <= 256)", file=sys.stderr, flush=True)
    os.abort()


def busy_loop(*args: Any, **kwargs: Any) -> Tensor:
    """Spins forever without sleeping or releasing the GIL for long."""
    while True:
        pass


def calls_sys_exit(*args: Any, **kwargs: Any) -> Tensor:
    """Calls sys.exit(0)."""
    sys.exit(0)


def raises_keyboard_interrupt(*args: Any, **kwargs: Any) -> Tensor:
    """Raises KeyboardInterrupt itself (no user pressed Ctrl-C)."""
    raise KeyboardInterrupt


def returns_nan(*args: Any, **kwargs: Any) -> Tensor:
    """The right shape and dtype, every value NaN."""
    return torch.full_like(_sdpa(*args, **kwargs), float("nan"))


def returns_nan_everywhere(*args: Any, **kwargs: Any) -> Any:
    """Declares every variant and the LSE, and returns NaN for the output and the LSE."""
    lse = kwargs.pop("return_lse", False)
    from attnref import functional as F

    out = torch.full_like(F.scaled_dot_product_attention(*args, **kwargs), float("nan"))
    if lse:
        return out, torch.full(out.shape[:-1], float("nan"))
    return out


def sinks_detached(*args: Any, **kwargs: Any) -> Tensor:
    """The reference, with the sink logits cut off from the graph: no dSinks."""
    from attnref import functional as F

    if kwargs.get("sinks") is not None:
        kwargs["sinks"] = kwargs["sinks"].detach()
    out: Tensor = F.scaled_dot_product_attention(*args, **kwargs)
    return out


def sinks_gradient_doubled(*args: Any, **kwargs: Any) -> Tensor:
    """The reference, with the gradient of the sink logits doubled on its way back."""
    from attnref import functional as F

    sinks = kwargs.get("sinks")
    if sinks is not None and sinks.requires_grad:
        kwargs["sinks"] = sinks.view_as(sinks)
        kwargs["sinks"].register_hook(lambda g: 2 * g)
    out: Tensor = F.scaled_dot_product_attention(*args, **kwargs)
    return out


def returns_inf(*args: Any, **kwargs: Any) -> Tensor:
    """The right shape and dtype, every value +inf."""
    return torch.full_like(_sdpa(*args, **kwargs), float("inf"))


def scales_query_in_place(q: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Scales its query in place (``q.mul_(2)``), then attends correctly with the scale
    halved: the output is right, the caller's tensor is not."""
    scale = kwargs.pop("scale", None)
    with torch.no_grad():
        q.mul_(2)
    s = (q.shape[-1] ** -0.5 if q.shape[-1] else 1.0) if scale is None else scale
    return _sdpa(q, *args, scale=s / 2, **kwargs)


def detached(*args: Any, **kwargs: Any) -> Tensor:
    """Correct values, but cut from the graph: no gradient reaches Q, K or V."""
    return _sdpa(*args, **kwargs).detach()


def allocates_without_bound(*args: Any, **kwargs: Any) -> Tensor:
    """Asks for 1 TiB of scratch memory."""
    scratch = torch.empty(2**38, dtype=torch.float32)
    return scratch[:1]


def leaks_in_one_row(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """Causal (top-left) except that the middle query also sees the key just past its
    diagonal: a leak in one row, whatever the lengths."""
    if kw.get("is_causal") and attn_mask is None:
        Tq, Tk = q.shape[-2], k.shape[-2]
        attn_mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
        row = Tq // 2
        if row + 1 < Tk:
            attn_mask[row, row + 1] = True
        kw["is_causal"] = False
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, **kw)


def drops_causal_with_a_mask(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """Causal as asked, except when a mask is passed too: then the mask alone (the
    diagonal dropped, as a library does that expects the mask to carry it). Future keys
    leak only in calls with both."""
    if attn_mask is not None:
        kw["is_causal"] = False
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, **kw)


def _declare() -> None:
    from attnref.conformance import Capabilities, EmptyRows

    refuses_masks.capabilities = Capabilities(  # type: ignore[attr-defined]
        refuses=("not supported by this kernel",)
    )
    # torch's SDPA underneath, which takes no mask with is_causal=True
    for fn in (nan_row_spreads, garbage_beside_empty_rows):
        fn.capabilities = Capabilities(  # type: ignore[attr-defined]
            empty_row="nan", dropout=False, gqa=True, causal_with_mask=False
        )
    # a diagonal and a mask each add a finite minimum: a row hidden by both would not
    # average V, so the diagonal comes folded into the mask
    uniform_empty_rows.capabilities = Capabilities(  # type: ignore[attr-defined]
        empty_row="uniform", dropout=False, causal_with_mask=False
    )
    empty_rows_by_cause.capabilities = Capabilities(  # type: ignore[attr-defined]
        empty_row=EmptyRows(bool_mask="zero", float_mask="nan", causal="uniform"),
        causal_alignments=("top_left", "bottom_right"),
        causal_with_mask=False,
        dropout=False,
    )
    for fn in (sinks_detached, sinks_gradient_doubled):
        fn.capabilities = Capabilities(sinks=True, dropout=False)  # type: ignore[attr-defined]
    returns_nan_everywhere.capabilities = Capabilities(  # type: ignore[attr-defined]
        causal_alignments=("top_left", "bottom_right"),
        window=True,
        softcap=True,
        alibi=True,
        sinks=True,
        lse=True,
    )


_declare()


def bare_assert(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kw: Any) -> Tensor:
    """A library's assertion with no message."""
    assert q.shape[-1] == 12345  # the planted bug
    return q


def _half_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    last_key_seen: bool,
) -> Tensor:
    Tq, Tk = q.shape[-2], k.shape[-2]
    acc = torch.promote_types(q.dtype, torch.float32)
    kk, vv = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    s = q.shape[-1] ** -0.5 if q.shape[-1] else 1.0
    scores = (q.to(acc) @ kk.to(acc).transpose(-2, -1)) * (s if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(), -math.inf)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        seen = attn_mask.expand(*attn_mask.shape[:-1], Tk).clone()
        if last_key_seen and Tk > 64:
            seen[..., Tk - 1] = True  # the mask bug: past 64 keys, the last is never hidden
        scores = scores.masked_fill(~seen, -math.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask.to(acc)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if q.dtype not in (torch.float16, torch.bfloat16):
        return (probs @ vv.to(acc)).to(q.dtype)
    out = torch.zeros(*probs.shape[:-1], v.shape[-1], dtype=q.dtype)
    for start in range(0, Tk, 8):  # half-precision sums: each block's part rounded in
        out = out + probs[..., start : start + 8].to(q.dtype) @ vv[..., start : start + 8, :]
    return out


def imprecise_and_mask_wrong(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Two bugs at once, in half precision: its sums over the keys run in the inputs'
    dtype, blocks of 8 keys at a time (a precision loss that grows with the keys), and
    past 64 keys a boolean mask never hides the last key (a semantic bug of the masks,
    met after the precision loss, which small cases show already)."""
    return _half_sums(q, k, v, attn_mask, is_causal, scale, last_key_seen=True)


def imprecise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """`imprecise_and_mask_wrong` with its masks right: the precision loss alone."""
    return _half_sums(q, k, v, attn_mask, is_causal, scale, last_key_seen=False)


def _reference_softcap(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, drop: bool, **kw: Any
) -> Tensor:
    from attnref.functional import scaled_dot_product_attention

    if drop:
        attn_mask = None
    out: Tensor = scaled_dot_product_attention(q, k, v, attn_mask, **kw)
    return out


def mask_dropped_always(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """attnref's reference with softcap, a boolean mask never applied (softcap or not)."""
    drop = attn_mask is not None and attn_mask.dtype == torch.bool
    return _reference_softcap(q, k, v, attn_mask, drop, **kw)


def mask_dropped_under_softcap(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """attnref's reference, a boolean mask dropped only when softcap is on."""
    drop = attn_mask is not None and attn_mask.dtype == torch.bool and bool(kw.get("softcap"))
    return _reference_softcap(q, k, v, attn_mask, drop, **kw)


def _declare_softcap() -> None:
    from attnref.conformance import Capabilities

    for fn in (mask_dropped_always, mask_dropped_under_softcap):
        fn.capabilities = Capabilities(softcap=True, float_mask=False)  # type: ignore[attr-defined]


_declare_softcap()


def nan_empty_rows_softcap(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """attnref's reference with softcap (and sinks), NaN for a query with no visible key,
    as declared (Intel Extension for PyTorch's paged prefill), but 0 beside a sink, which
    then takes all the weight (a softmax over ``-inf`` scores and one finite logit):
    correct."""
    return _nan_rows(q, k, v, attn_mask, kw, beside_sinks=False)


def nan_empty_rows_beside_sinks(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """`nan_empty_rows_softcap`, but NaN in a row with no visible key even beside a
    sink: wrong (the sink's weight is 1, its value 0)."""
    return _nan_rows(q, k, v, attn_mask, kw, beside_sinks=True)


def _nan_rows(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, kw: dict[str, Any],
    beside_sinks: bool,
) -> Tensor:  # fmt: skip
    out = _reference_softcap(q, k, v, attn_mask, False, **kw)
    from attnref.conformance.cases import _visible

    seen = _visible(q, k, attn_mask, "top_left" if kw.get("is_causal") else None, None)
    empty = ~seen.any(dim=-1, keepdim=True)
    sinks = kw.get("sinks")
    if sinks is not None and not beside_sinks:  # (h,): a finite sink takes the row
        empty = empty & ~torch.isfinite(sinks)[:, None, None]
    return out.masked_fill(empty, float("nan"))


def uniform_empty_rows_sinks(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """A finite fill for hidden keys (MLX's): a query with no visible key averages V, but
    with a sink all its weight goes to the sink, and it outputs 0. Correct."""
    from attnref.conformance.cases import _visible

    seen = _visible(q, k, attn_mask, "top_left" if kw.pop("is_causal", False) else None, None)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        bias = attn_mask.masked_fill(~seen, -1e30)
    else:
        bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, -1e30)
    kw.pop("dropout_p", None)
    from attnref.functional import scaled_dot_product_attention

    out: Tensor = scaled_dot_product_attention(q, k, v, bias.to(q.dtype), **kw)
    return out


def uniform_empty_rows_sink_ignored(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """`uniform_empty_rows_sinks`, but a query with no visible key averages V even with
    a sink (the sink left out of its softmax): wrong."""
    from attnref.conformance.cases import _visible

    out = uniform_empty_rows_sinks(q, k, v, attn_mask, **kw)
    seen = _visible(q, k, attn_mask, "top_left" if kw.get("is_causal") else None, None)
    groups = q.shape[-3] // k.shape[-3]
    mean = v.repeat_interleave(groups, dim=-3).mean(dim=-2, keepdim=True)
    return torch.where(seen.any(dim=-1, keepdim=True), out, mean.to(out.dtype))


def _declare_empty_rows() -> None:
    from attnref.conformance import Capabilities, EmptyRows

    windows_end_at_the_query.capabilities = Capabilities(  # type: ignore[attr-defined]
        window=True,
        causal_windows_only=True,
        dropout=False,
        gradients=False,
        causal_alignments=("top_left", "bottom_right"),
    )
    tiled_lengths_and_dims.capabilities = Capabilities(  # type: ignore[attr-defined]
        head_dim_multiple=8, length_multiples=(16, 32), zero_head_dim=False, dropout=False
    )
    for fn in (tiled_with_lse, tiled_lse_base2):
        fn.capabilities = Capabilities(  # type: ignore[attr-defined]
            head_dim_multiple=8, length_multiples=(16, 32), zero_head_dim=False, dropout=False,
            lse=True, gradients=False, causal_alignments=("top_left", "bottom_right"),
        )  # fmt: skip
    scale_and_alignment_ignored.capabilities = Capabilities(  # type: ignore[attr-defined]
        causal_alignments=("top_left", "bottom_right"), dropout=False, gradients=False
    )
    for fn, fill in (
        (finite_diagonal_inf_mask, "diagonal"),
        (replaced_diagonal_inf_mask, "diagonal_replaced"),
    ):
        fn.capabilities = Capabilities(  # type: ignore[attr-defined]
            empty_row=EmptyRows(causal=fill, bool_mask="nan", float_mask="nan"),  # type: ignore[arg-type]
            causal_alignments=("top_left", "bottom_right"),
            dropout=False,
            gradients=False,
        )
    for fn in (undefined_empty_rows, undefined_rows_leak):
        fn.capabilities = Capabilities(  # type: ignore[attr-defined]
            softcap=True, sinks=True, empty_row="undefined", dropout=False, gradients=False
        )
    causal_flag_square_only.capabilities = Capabilities(  # type: ignore[attr-defined]
        causal_square_only=True, dropout=False
    )
    for fn in (wrong_past_one_query, wrong_on_one_query):  # torch's SDPA underneath
        fn.capabilities = Capabilities(causal_with_mask=False)  # type: ignore[attr-defined]

    for fn in (nan_empty_rows_softcap, nan_empty_rows_beside_sinks):
        fn.capabilities = Capabilities(  # type: ignore[attr-defined]
            softcap=True, sinks=True, empty_row="nan", dropout=False, gradients=False
        )
    for fn in (uniform_empty_rows_sinks, uniform_empty_rows_sink_ignored):
        fn.capabilities = Capabilities(  # type: ignore[attr-defined]
            sinks=True, empty_row="uniform", dropout=False, gradients=False
        )


def chatty_and_wrong(*args: Any, **kwargs: Any) -> Tensor:
    """Logs thousands of lines a call to stdout and stderr (as ExecuTorch's ops do, from
    Python and from C), and returns twice the right output."""
    for i in range(2000):
        print(f"chatty stdout line {i}")
    sys.stdout.flush()
    os.write(2, b"".join(b"chatty stderr line %d\n" % i for i in range(2000)))
    os.write(2, b"the last words \x1b[31mred\x1b[0m\n")
    return 2 * torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


_CORRUPTED: list[bool] = []


def dies_after_corrupting(*args: Any, **kwargs: Any) -> Tensor:
    """Right on the first call of its process, which (as a write past an output would)
    leaves its memory corrupted: every later call dies of it (SIGSEGV). The case a crash
    is met on passes alone, in a fresh process."""
    if _CORRUPTED:
        ctypes.string_at(0)
    _CORRUPTED.append(True)
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def wrong_then_dies(*args: Any, **kwargs: Any) -> Tensor:
    """Wrong (off by 0.5) on the first call of its process, which leaves its memory
    corrupted: every later call dies of it (SIGSEGV). The case a crash is met on fails
    alone too, in a fresh process, without crashing."""
    if _CORRUPTED:
        ctypes.string_at(0)
    _CORRUPTED.append(True)
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs) + 0.5


def _write_outside(t: Tensor, after: bool) -> None:
    """Eight zero bytes just after the end (or before the start) of ``t``'s storage, as
    a native kernel with an off-by-one bound writes them."""
    storage = t.untyped_storage()
    at = storage.data_ptr() + storage.nbytes() if after else storage.data_ptr() - 8
    ctypes.memset(at, 0, 8)


def writes_past_key(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Right values, and eight bytes written just past the end of the key's memory (a
    native kernel's last tile stored one row too far). Nothing it returns shows it."""
    _write_outside(k, after=True)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)


def writes_before_query(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Right values, and eight bytes written just before the query's memory."""
    _write_outside(q, after=False)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)


def wrong_past_one_query(*args: Any, **kwargs: Any) -> Tensor:
    """Right for one query (a decode step), off by 0.5 for more (a prefill): in the
    ``decode`` law the original call is the wrong one, and finite."""
    out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    return out + 0.5 if out.shape[-2] > 1 else out


def wrong_on_one_query(*args: Any, **kwargs: Any) -> Tensor:
    """Off by 0.5 for one query (a decode step), right for more."""
    out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    return out + 0.5 if out.shape[-2] == 1 else out


def windows_end_at_the_query(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """attnref's reference, a window's right side read as 0 whatever it is (ONNX
    Runtime GQA's ``local_window_size``: windows end at the query). Right for a backend
    that declares ``causal_windows_only``; wrong for one that takes ``(left, right)``."""
    from attnref.functional import scaled_dot_product_attention

    window = kw.pop("window", None)
    if window is not None:
        kw["window"] = (window[0], 0)
    out: Tensor = scaled_dot_product_attention(q, k, v, attn_mask, **kw)
    return out


def tiled_lengths_and_dims(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """torch's SDPA behind a kernel that raises on query lengths not a multiple of 16,
    key lengths not a multiple of 32 or head dims not a multiple of 8 (Pallas' blocks,
    ONNX Runtime's CPU kernel): right inside what it declares."""
    Tq, Tk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    if Tq % 16 or Tk % 32 or D % 8 or v.shape[-1] % 8:
        raise ValueError(f"unsupported shape: Tq={Tq}, Tk={Tk}, D={D}")
    from tests.torch_sdpa import sdpa

    return sdpa(q, k, v, attn_mask, **kw)


def tiled_with_lse(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Any:
    """`tiled_lengths_and_dims` with the log-sum-exp (attnref's reference inside): right.
    Its merge and decode steps must be drawn at its multiples to be judged at all."""
    Tq, Tk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    if Tq % 16 or Tk % 32 or D % 8 or v.shape[-1] % 8:
        raise ValueError(f"unsupported shape: Tq={Tq}, Tk={Tk}, D={D}")
    from attnref.functional import scaled_dot_product_attention

    kw.pop("dropout_p", None)
    return scaled_dot_product_attention(q, k, v, attn_mask, **kw)


def tiled_lse_base2(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Any:
    """`tiled_with_lse` with its log-sum-exp in base 2 (class 25): wrong."""
    got = tiled_with_lse(q, k, v, attn_mask, **kw)
    if not kw.get("return_lse"):
        return got
    out, lse = got
    return out, lse / math.log(2)


def causal_flag_square_only(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """torch's SDPA behind a library whose own causal flag holds for Tq == Tk only (ONNX
    Runtime's attention operators): with Tq != Tk it raises. Right where it declares."""
    if kw.get("is_causal") and q.shape[-2] != k.shape[-2]:
        raise ValueError("is_causal needs as many queries as keys")
    from tests.torch_sdpa import sdpa

    return sdpa(q, k, v, attn_mask, **kw)


def scale_and_alignment_ignored(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """Two bugs in one kernel (IPEX's varlen attention had both): ``scale`` ignored, and
    ``causal_alignment`` ignored (top-left whatever is asked, wrong when Tq != Tk)."""
    kw.pop("scale", None)
    kw.pop("causal_alignment", None)
    from tests.torch_sdpa import sdpa

    return sdpa(q, k, v, attn_mask, **kw)


def finite_diagonal_inf_mask(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """ONNX Runtime GroupQueryAttention's way: its own causal diagonal a finite fill
    added to the scores (-1e4), the mask's hidden keys -inf. A row the diagonal alone
    empties attends the keys it hid; one the mask empties is NaN. Right, declared as
    ``EmptyRows(causal="diagonal", bool_mask="nan", float_mask="nan")``."""
    return _diagonal_fill(q, k, v, attn_mask, kw, replaced=False)


def replaced_diagonal_inf_mask(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """ONNX Runtime MultiHeadAttention's way: its own causal diagonal's scores *replaced*
    by one finite value (-1e4), the mask's hidden keys -inf. A row the diagonal alone
    empties is the plain mean of V over the keys it hid; one the mask empties is NaN.
    Right, declared as ``EmptyRows(causal="diagonal_replaced", ...)``."""
    return _diagonal_fill(q, k, v, attn_mask, kw, replaced=True)


def _diagonal_fill(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, kw: dict[str, Any],
    replaced: bool,
) -> Tensor:  # fmt: skip
    Tq, Tk = q.shape[-2], k.shape[-2]
    offset = Tk - Tq if kw.get("causal_alignment") == "bottom_right" else 0
    bias = torch.zeros(Tq, Tk, dtype=torch.float32)
    later = torch.zeros(Tq, Tk, dtype=torch.bool)
    if kw.get("is_causal"):
        later = torch.arange(Tk)[None, :] > torch.arange(Tq)[:, None] + offset
        bias = bias.masked_fill(later, -1e4)
    full = bias.expand(*q.shape[:-1], Tk).clone()
    if attn_mask is not None:
        hide = ~attn_mask if attn_mask.dtype == torch.bool else torch.isinf(attn_mask)
        full = full.masked_fill(hide.expand_as(full), -math.inf)
        if attn_mask.dtype != torch.bool:
            full = full + attn_mask.masked_fill(hide, 0.0).to(torch.float32)
    groups = q.shape[-3] // k.shape[-3]
    kk = k.repeat_interleave(groups, dim=-3).to(torch.float32)
    vv = v.repeat_interleave(groups, dim=-3).to(torch.float32)
    scale = kw.get("scale") or 1 / math.sqrt(q.shape[-1])
    s = q.to(torch.float32) @ kk.transpose(-1, -2) * scale
    if not replaced:
        return (torch.softmax(s + full, dim=-1) @ vv).to(q.dtype)
    # rows that see a key: exact; a row the diagonal empties: each score it hid replaced
    # by the one fill, so only the mask tells those keys apart
    mask_part = full - bias  # the mask's alone (-inf - -1e4 stays -inf)
    seen = s + mask_part.masked_fill(later.expand_as(full), -math.inf)
    empty = ~torch.isfinite(seen).any(dim=-1, keepdim=True)
    fill = mask_part.masked_fill(~later.expand_as(full), -math.inf)
    exact = torch.softmax(seen.masked_fill(empty, 0.0), dim=-1) @ vv
    mean = torch.softmax(fill, dim=-1) @ vv  # NaN where the mask hides every key
    return torch.where(empty, mean, exact).to(q.dtype)


def undefined_empty_rows(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """JAX splash attention's documented behaviour: a query with no visible key is
    undefined, and comes out NaN in one row and a mean that depends on the tile in
    another (here: NaN in even rows, the mean of a few keys in odd ones). Right,
    declared as ``empty_row="undefined"``: such rows are not judged."""
    from attnref.conformance.cases import _visible

    out = _reference_softcap(q, k, v, attn_mask, False, **kw)
    seen = _visible(q, k, attn_mask, "top_left" if kw.get("is_causal") else None, None)
    empty = ~seen.any(dim=-1, keepdim=True)  # (..., Tq, 1)
    groups = q.shape[-3] // k.shape[-3]
    tile_mean = v.repeat_interleave(groups, dim=-3)[..., :3, :].mean(dim=-2, keepdim=True)
    odd = (torch.arange(q.shape[-2]) % 2 == 1)[:, None]
    garbage = torch.where(odd, tile_mean.expand_as(out), torch.full_like(out, float("nan")))
    return torch.where(empty, garbage, out)


def undefined_rows_leak(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """`undefined_empty_rows`, but a row that sees keys gets the tile's mean too where
    the row before it saw none: wrong (undefined rows excuse no other row)."""
    from attnref.conformance.cases import _visible

    out = undefined_empty_rows(q, k, v, attn_mask, **kw)
    seen = _visible(q, k, attn_mask, "top_left" if kw.get("is_causal") else None, None)
    empty = ~seen.any(dim=-1, keepdim=True)
    after = torch.zeros_like(empty)
    after[..., 1:, :] = empty[..., :-1, :] & ~empty[..., 1:, :]
    return out.masked_fill(after, 0.0)


_declare_empty_rows()  # last: it declares what is defined above
