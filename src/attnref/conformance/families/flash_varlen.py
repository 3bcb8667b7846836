"""The ``flash-varlen`` family: FlashAttention 2's ``flash_attn_varlen_func``, packed
sequences ``(total, h, D)`` described by int32 ``cu_seqlens``, each attended on its own,
bottom-right (docs/varlen.md).

Everything of the family is here: the convention (`pack_arguments`, `read_pack`; a
dense case runs as a pack of its samples), `varlen_form` (a flash-convention function
driven sequence by sequence, with the switches of the class-26 mutants), the preset
(`FLASH_ATTN_2_VARLEN`), the built-in backends, the properties only a pack can have and
the mutants. Packs themselves are built by `attnref.conformance.serving`.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from hypothesis import strategies as st
from jaxtyping import Float, Int
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.calls import invoke, note_reading
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context, law, rng
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.families.flash import (
    FLASH_ATTN_2,
    declared,
    dense_read,
    empty_part,
    flash_caps,
    flash_checks,
    flash_form,
    flash_kwargs,
    flash_layout,
    flash_naive,
    flash_native_causal,
)
from attnref.conformance.families.sdpa import (
    FLEX_CAPS,
    NAIVE_CAPS,
    REFERENCE_CAPS,
    SDPA_BIAS_CAPS,
    compiled_flex,
    sdpa_with_bias,
)
from attnref.conformance.family import ApiFamily, Arguments, pair
from attnref.conformance.mutants import Mutant
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property, some_variants
from attnref.conformance.serving import GARBAGE, Pack, build_pack, dense_pack
from attnref.conformance.serving_checks import Results, agree, guard, judge, with_lses
from attnref.conformance.strategies import pack_strategy
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Job
from attnref.conformance.workloads import ServingCase, Workload, spread_lengths
from attnref.varlen import check_cu_seqlens, seqlens, varlen_attention

__all__ = [
    "FAMILY",
    "FLASH_ATTN_2_VARLEN",
    "pack_arguments",
    "read_pack",
    "varlen_flex",
    "varlen_form",
    "varlen_naive",
    "varlen_reference",
    "varlen_sdpa",
]

NAME = "flash-varlen"
#: the ``flash-varlen`` family's preset: FlashAttention 2 documents flash_attn_varlen_func
#: as flash_attn_func
FLASH_ATTN_2_VARLEN = replace(FLASH_ATTN_2, family=NAME)


# ----------------------------------------------------------------- the convention


def pack_arguments(
    caps: Capabilities, pack: Pack, lse: bool, overrides: dict[str, Any] | None = None
) -> Arguments:
    """``flash_attn_varlen_func``'s call for ``pack``."""
    for s in pack.seqs:
        flash_checks(s)
    q, k, v = pack.tensors()
    args = (
        q,
        k,
        v,
        pack.cu_seqlens("q"),
        pack.cu_seqlens("k"),
        pack.max_seqlen("q"),
        pack.max_seqlen("k"),
    )
    kwargs = {"dropout_p": 0.0, **flash_kwargs(caps, pack.first, pack.alibi_slopes)}
    if lse:
        kwargs["return_attn_probs"] = True
    kwargs.update(overrides or {})
    return args, kwargs


def read_pack(out: object, pack: Pack, lse: bool) -> tuple[list[object], list[object] | None]:
    """The output (and LSE) of each sequence of ``pack``, in the audit's layouts
    ``(h, Tq, Dv)`` and ``(h, Tq)``; what is not a tensor passes through for the caller
    to judge."""
    first, lse_out = pair(out, "return_attn_probs=True") if lse else (out, None)
    q, _, v = pack.tensors()
    total, h, Dv = q.shape[0], q.shape[1], v.shape[-1]
    cu = pack.cu_seqlens("q").tolist()
    spans = list(itertools.pairwise(cu))
    outs: list[object] = [first] * len(spans)
    if isinstance(first, Tensor):
        if tuple(first.shape) != (total, h, Dv):
            raise Failure(
                f"returned shape {tuple(first.shape)}, expected {(total, h, Dv)} (total_q, h, Dv)"
            )
        outs = [first[a:b].transpose(0, 1) for a, b in spans]
    if not lse:
        return outs, None
    lses: list[object] = [lse_out] * len(spans)
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (h, total):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected "
                f"{(h, total)} (h, total_q)"
            )
        lses = [lse_out[:, a:b] for a, b in spans]
    return outs, lses


def _varlen_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    """A dense case as a pack of its samples (equal lengths)."""
    flash_checks(inputs)
    return pack_arguments(caps, dense_pack(inputs), lse, overrides)


def _varlen_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    return dense_read(out, inputs, lse, read_pack(out, dense_pack(inputs), lse))


def _packed_layout(t: Tensor, inputs: Inputs) -> Tensor:
    """``(*batch, h, T, D)`` as ``(B * T, h, D)``."""
    return flash_layout(t, inputs).reshape(-1, *t.shape[-3:-2], t.shape[-1]).contiguous()


def _packed_back(t: Tensor, like: Tensor) -> Tensor:
    h, T, D = like.shape[-3:]
    return t.reshape(-1, T, h, D).transpose(1, 2).reshape(like.shape)


# ---------------------------------------------- the adapter from a flash callable


def varlen_form(
    flash: Callable[..., Any], name: str, *, bugs: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``flash`` (``flash_attn_func``'s signature) with ``flash_attn_varlen_func``'s: each
    sequence of the pack is one call of ``flash`` with a batch of one; a sequence with
    no keys gets 0 (LSE ``-inf``) without a call; padding after the pack gets 0.

    ``bugs`` plants class-26 bugs, for the mutants (`attnref.conformance.mutants`):
    ``global_max_seqlen_k`` (every sequence reads ``max_seqlen_k`` keys from its start),
    ``zero_length_shift`` (empty sequences dropped from the query and key lists
    separately, so the sequences after one pair up wrongly), ``reads_next_key`` (each
    sequence sees the next one's first key).
    """

    @checked_internal
    def varlen(
        q: Float[Tensor, "total_q h Dh"],
        k: Float[Tensor, "total_k g Dh"],
        v: Float[Tensor, "total_k g Dv"],
        cu_seqlens_q: Int[Tensor, " Nq"],
        cu_seqlens_k: Int[Tensor, " Nk"],
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "N h"] | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        sinks: Float[Tensor, " h"] | None = None,
    ) -> (
        Float[Tensor, "total_q h Dv"]
        | tuple[Float[Tensor, "total_q h Dv"], Float[Tensor, "h total_q"], None]
    ):
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
        spans_q, spans_k = seqlens(cu_seqlens_q), seqlens(cu_seqlens_k)
        if "zero_length_shift" in bugs:
            spans_q = [s for s in spans_q if s[1] > s[0]]
            spans_k = [s for s in spans_k if s[1] > s[0]]
            spans_k += [(k.shape[0], k.shape[0])] * (len(spans_q) - len(spans_k))
        h, Dv = q.shape[1], v.shape[2]
        extra: dict[str, Any] = {"softmax_scale": softmax_scale, "causal": causal}
        if tuple(window_size) != (-1, -1):
            extra["window_size"] = window_size
        if softcap:
            extra["softcap"] = softcap
        if sinks is not None:
            extra["sinks"] = sinks
        outs: list[Tensor] = []
        lses: list[Tensor | None] = []
        for n, ((q0, q1), (k0, k1)) in enumerate(zip(spans_q, spans_k, strict=False)):
            if "global_max_seqlen_k" in bugs:
                k1 = min(k0 + max_seqlen_k, k.shape[0])
            if "reads_next_key" in bugs and k1 < k.shape[0]:
                k1 += 1
            if q1 == q0:
                continue
            lse: Tensor | None
            if k1 == k0:
                out, lse = empty_part(q, h, Dv, q1 - q0)
            else:
                kwargs = dict(extra)
                if alibi_slopes is not None:
                    kwargs["alibi_slopes"] = (
                        alibi_slopes[n] if alibi_slopes.dim() == 2 else alibi_slopes
                    )
                result = flash(
                    q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p,
                    return_attn_probs=return_attn_probs, **kwargs,
                )  # fmt: skip
                out, lse = (result[0][0], result[1][0]) if return_attn_probs else (result[0], None)
            outs.append(out)
            lses.append(lse)
        rows = q.shape[0] - sum(o.shape[0] for o in outs)
        pad_out, pad_lse = empty_part(q, h, Dv, rows)
        packed = torch.cat([*outs, pad_out])
        if return_attn_probs:
            parts = [x for x in lses if x is not None]
            lse_dtype = parts[0].dtype if parts else pad_lse.dtype
            return (
                packed,
                torch.cat([*(x.to(lse_dtype) for x in parts), pad_lse.to(lse_dtype)], dim=1),
                None,
            )
        return packed

    varlen.__name__ = varlen.__qualname__ = name
    varlen.__doc__ = f"{flash.__doc__ or ''}\n\nIn flash_attn_varlen_func's convention."
    return varlen


# ------------------------------------------------------------------ the builtins


@checked
def _varlen_reference(
    q: Float[Tensor, "total_q h Dh"],
    k: Float[Tensor, "total_k g Dh"],
    v: Float[Tensor, "total_k g Dv"],
    cu_seqlens_q: Int[Tensor, " Nq"],
    cu_seqlens_k: Int[Tensor, " Nk"],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "N h"] | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sinks: Float[Tensor, " h"] | None = None,
) -> (
    Float[Tensor, "total_q h Dv"]
    | tuple[Float[Tensor, "total_q h Dv"], Float[Tensor, "h total_q"], None]
):
    """attnref's `attnref.varlen.varlen_attention` in flash_attn_varlen_func's signature."""
    if dropout_p:
        raise ValueError(f"dropout_p must be 0 here, got {dropout_p}")
    kwargs: dict[str, Any] = {
        "softmax_scale": softmax_scale,
        "causal": causal,
        "window_size": window_size,
        "softcap": softcap,
        "alibi_slopes": alibi_slopes,
        "sinks": sinks,
    }
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if return_attn_probs:
        out, lse = varlen_attention(*args, return_lse=True, **kwargs)
        return out, lse, None
    result: Tensor = varlen_attention(*args, **kwargs)
    return result


_VARLEN_REFERENCE_CAPS = flash_caps(replace(REFERENCE_CAPS, dropout=False), "flash-varlen")
varlen_reference = declared(_varlen_reference, _VARLEN_REFERENCE_CAPS)
varlen_naive = declared(
    varlen_form(flash_naive, "varlen_naive"), flash_caps(NAIVE_CAPS, "flash-varlen")
)
varlen_sdpa = declared(
    varlen_form(flash_form(sdpa_with_bias, "flash_sdpa"), "varlen_sdpa"),
    flash_caps(replace(SDPA_BIAS_CAPS, gradients=True), "flash-varlen"),
)


def _doc_ids(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Each token's sequence (-1 for padding after the pack) and position in it."""
    device = cu.device
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    pos = torch.arange(doc.numel(), device=device) - cu[:-1].long()[doc]
    pad = total - doc.numel()
    minus = torch.full((pad,), -1, dtype=torch.long, device=device)
    return torch.cat([doc, minus]), torch.cat([pos, torch.zeros_like(minus)])


@checked
def _varlen_flex(
    q: Float[Tensor, "total_q h Dh"],
    k: Float[Tensor, "total_k g Dh"],
    v: Float[Tensor, "total_k g Dv"],
    cu_seqlens_q: Int[Tensor, " Nq"],
    cu_seqlens_k: Int[Tensor, " Nk"],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "N h"] | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sinks: Float[Tensor, " h"] | None = None,
) -> (
    Float[Tensor, "total_q h Dv"]
    | tuple[Float[Tensor, "total_q h Dv"], Float[Tensor, "h total_q"], None]
):
    """FlexAttention's document masking (attention-gym's recipe): the whole pack in one
    call, a ``mask_mod`` that lets a query see only keys of its own sequence, causal and
    windowed at the sequence's own bottom-right offset, and softcap and ALiBi in a
    ``score_mod`` at the sequence's own distances. Settings reach both as tensors (see
    `flex`)."""
    import warnings

    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    if dropout_p != 0.0:
        raise ValueError("FlexAttention has no dropout")
    device = q.device
    total_q, h, _ = q.shape
    total_k, g = k.shape[0], k.shape[1]
    if total_q == 0 or total_k == 0:  # FlexAttention takes no empty sequence: no key
        lse_dtype = torch.promote_types(q.dtype, torch.float32)
        empty = q.new_zeros((total_q, h, v.shape[-1]))
        no_key = torch.full((h, total_q), -math.inf, dtype=lse_dtype, device=device)
        return (empty, no_key, None) if return_attn_probs else empty
    doc_q, pos_q = _doc_ids(cu_seqlens_q, total_q)
    doc_k, pos_k = _doc_ids(cu_seqlens_k, total_k)
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    offset = torch.cat([lengths_k - lengths_q, torch.zeros(1, dtype=torch.long, device=device)])
    ctype = torch.promote_types(q.dtype, torch.float32)
    N = lengths_q.numel()
    slopes = torch.zeros((N + 1, h), device=device, dtype=ctype)
    if alibi_slopes is not None:
        slopes[:N] = alibi_slopes.to(ctype).reshape(-1, h).expand(N, h)
    cap = torch.tensor(float(softcap), device=device)
    left, right = (torch.tensor(w, device=device) for w in window_size)
    is_causal = torch.tensor(causal, device=device)

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        capped = cap * torch.tanh(score / torch.where(cap > 0, cap, 1.0))
        score = torch.where(cap > 0, capped, score)
        d = doc_q[qi]
        return score - slopes[d, hh] * (pos_q[qi] + offset[d] - pos_k[kj]).abs()

    def mask_mod(b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        d = doc_q[qi]
        pos, kpos = pos_q[qi] + offset[d], pos_k[kj]
        seen = (d >= 0) & (d == doc_k[kj]) & (~is_causal | (kpos <= pos))
        return seen & ((left < 0) | (kpos >= pos - left)) & ((right < 0) | (kpos <= pos + right))

    fn = compiled_flex()  # the path users call, on every device
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, T, D)
    if sinks is not None:
        qh, kh, vh = qh.to(ctype), kh.to(ctype), vh.to(ctype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block_mask = create_block_mask(mask_mod, None, None, total_q, total_k, device=device)
        need_lse = return_attn_probs or sinks is not None  # compiled for the CPU: none
        got = fn(
            qh, kh, vh, score_mod=score_mod, block_mask=block_mask, scale=softmax_scale,
            enable_gqa=h != g, return_aux=AuxRequest(lse=True) if need_lse else None,
        )  # fmt: skip
    if not need_lse:
        plain: Tensor = got[0].transpose(0, 1)
        return plain
    out, aux = got
    lse = aux.lse
    if sinks is not None:
        out = F.apply_sinks(out, lse, sinks).to(q.dtype)
    packed = out[0].transpose(0, 1)
    return (packed, lse[0], None) if return_attn_probs else packed


varlen_flex = declared(
    _varlen_flex, flash_caps(replace(FLEX_CAPS, gradients=False), "flash-varlen")
)


def _flash_attn_varlen(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention 2's ``flash_attn_varlen_func`` (the ``flash_attn`` package)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(*args, **kwargs)


def _builtins() -> list[Backend]:
    return [
        *(
            Backend(name, fn, description, fn.capabilities, api=NAME)  # type: ignore[attr-defined]
            for name, fn, description in (
                ("varlen-reference", varlen_reference, "attnref's varlen_attention"),
                ("varlen-naive", varlen_naive, "the naive kernel, sequence by sequence"),
                (
                    "varlen-sdpa",
                    varlen_sdpa,
                    "torch SDPA (window and ALiBi as a float mask), sequence by sequence",
                ),
                (
                    "varlen-flex",
                    varlen_flex,
                    "FlexAttention's document masking: the whole pack in one call",
                ),
            )
        ),
        Backend(
            "flash-attn-varlen",
            _flash_attn_varlen,
            "FlashAttention 2's flash_attn_varlen_func (skipped where flash_attn is absent)",
            replace(FLASH_ATTN_2_VARLEN, devices=("cuda",)),
            api=NAME,
            needs="flash_attn",
        ),
    ]


# ---------------------------------------------------------------- the properties


def _call_pack(ctx: Context, pack: Pack, lse: bool = False) -> Results:
    """The backend's output (and LSE) for each sequence of ``pack``."""
    if lse and not ctx.caps.lse:
        raise Skip("the log-sum-exp not declared")
    args, kwargs = pack_arguments(ctx.caps, pack, lse)
    guard(ctx, pack.first, kwargs)
    raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
    note_reading(
        ctx.executor,
        raw,
        lambda r: zip(pack.seqs, *with_lses(read_pack(r, pack, lse)), strict=True),
    )
    outs, lses = read_pack(raw, pack, lse)
    return judge(outs, lses, pack.seqs)


def _varlen(ctx: Context, case: Case) -> None:
    """Each sequence of the pack agrees with the oracle of it alone, output and LSE."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    outs, lses = _call_pack(ctx, pack, lse=ctx.caps.lse)
    agree(ctx, outs, lses, pack.seqs, "sequence")


def _alone(pack: Pack, n: int) -> Pack:
    slopes = pack.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[n : n + 1]
    return replace(
        pack, seqs=(pack.seqs[n],), pad_q=pack.pad_q[:0], pad_k=pack.pad_k[:0],
        pad_v=pack.pad_v[:0], alibi_slopes=slopes,
    )  # fmt: skip


def _picks(case: Case, n: int) -> list[int]:
    return sorted({0, n - 1, int(torch.randint(0, n, (), generator=rng(case, 3)))})


def _varlen_alone(ctx: Context, case: Case) -> None:
    """A sequence gives the same output in the pack as in a pack of its own."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    full, _ = _call_pack(ctx, pack)
    for n in _picks(case, len(pack.seqs)):
        alone, _ = _call_pack(ctx, _alone(pack, n))
        x = pack.seqs[n]
        law(ctx, alone[0], x, full[n], x, f"sequence {n} of {len(pack.seqs)} alone")


def _varlen_permutation(ctx: Context, case: Case) -> None:
    """Permuting the sequences of a pack permutes their outputs."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    N = len(pack.seqs)
    order = torch.randperm(N, generator=rng(case, 4)).tolist()
    if order == list(range(N)):
        order = order[::-1]
    full, _ = _call_pack(ctx, pack)
    moved, _ = _call_pack(ctx, pack.permuted(order))
    for i, n in enumerate(order):
        x = pack.seqs[n]
        law(ctx, moved[i], x, full[n], x, f"sequence {n} moved to place {i} (order {order})")


def _varlen_padding(ctx: Context, case: Case) -> None:
    """Padding tokens after the pack never matter: other garbage (NaN where the
    backend contains it), and more of it, changes no sequence's output."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    full, _ = _call_pack(ctx, pack)
    extra = pack.pad_q.shape[0] + 3
    fill = math.nan if ctx.caps.masked_nan == "contained" else -GARBAGE

    def junk(t: Tensor) -> Tensor:
        return torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)

    padded = replace(pack, pad_q=junk(pack.pad_q), pad_k=junk(pack.pad_k), pad_v=junk(pack.pad_v))
    other, _ = _call_pack(ctx, padded)
    for n, x in enumerate(pack.seqs):
        law(ctx, other[n], x, full[n], x, f"sequence {n} with {extra} other padding tokens")


def _pack_variants(c: Capabilities) -> st.SearchStrategy[dict[str, object]]:
    return some_variants(c)


def _pack_examples(p: Profile, c: Capabilities) -> list[Case]:
    """Where the class-26 bugs show: empty and one-token sequences next to others, a
    long sequence among short ones, more keys than queries, padding."""
    base = [
        Case("pack_zeros", seqlens=((0, 0), (3, 3), (0, 4), (5, 0), (1, 1), (7, 7)), pad=2),
        Case("pack_long_among_short", seqlens=((1, 1), (2, 2), (33, 33), (3, 3)), pad=1),
        Case("pack_prefix", seqlens=((2, 9), (5, 5), (1, 13)), causal="bottom_right"),
        Case("pack_causal_zeros", seqlens=((4, 4), (0, 0), (6, 6)), causal="bottom_right"),
        Case("pack_gqa", h=6, g=2, seqlens=((3, 7), (7, 3), (11, 11))),
    ]
    if c.window:
        base.append(
            Case("pack_window", seqlens=((9, 9), (1, 1), (12, 12)), causal="bottom_right",
                 window=(3, 0))
        )  # fmt: skip
    return [replace(x, seed=200 + i) for i, x in enumerate(base)]


PROPERTIES: tuple[Property, ...] = (
    Property(
        "varlen",
        "each sequence of a pack (empty, one-token, long among short, padded) agrees "
        "with the oracle of it alone, output and LSE",
        (26,),
        lambda p, c: pack_strategy("varlen", p, c, variants=_pack_variants(c)),
        _varlen,
        examples=_pack_examples,
        families=(NAME,),
    ),
    Property(
        "varlen_alone",
        "a sequence gives the same output in the pack as in a pack of its own",
        (26,),
        lambda p, c: pack_strategy("varlen_alone", p, c),
        _varlen_alone,
        families=(NAME,),
    ),
    Property(
        "varlen_permutation",
        "permuting the sequences of a pack permutes their outputs",
        (26,),
        lambda p, c: pack_strategy("varlen_permutation", p, c),
        _varlen_permutation,
        families=(NAME,),
    ),
    Property(
        "varlen_padding",
        "padding tokens after the pack (other garbage, NaN, more of it) never matter",
        (26,),
        lambda p, c: pack_strategy("varlen_padding", p, c, pad=st.sampled_from((1, 4))),
        _varlen_padding,
        families=(NAME,),
    ),
)


# ------------------------------------------------------------------- the mutants


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    """A bug in how the pack is read: the naive kernel behind a buggy `varlen_form`."""
    fn = varlen_form(flash_naive, self.name, bugs=frozenset(self.switches))
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


#: what the class-26 mutants claim: the naive kernel driven sequence by sequence
VARLEN_LIKE: Capabilities = varlen_naive.capabilities  # type: ignore[attr-defined]
_LIKE: dict[str, Any] = {"api": NAME, "capabilities": VARLEN_LIKE}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("varlen_global_max_seqlen_k", 26, "each sequence reads max_seqlen_k keys "
           "from its start: a short one sees the next one's keys",
           {"global_max_seqlen_k": True}, **_LIKE),
    Mutant("varlen_zero_length_shift", 26, "empty sequences are dropped from the query "
           "and the key lists separately, so the sequences after one pair up wrongly",
           {"zero_length_shift": True}, **_LIKE),
    Mutant("varlen_reads_next_key", 26, "the queries of a sequence also see the next "
           "sequence's first key", {"reads_next_key": True}, **_LIKE),
)  # fmt: skip


def _prefill_workload(case: ServingCase) -> Workload:
    """One packed causal prefill: ``B`` sequences whose lengths spread evenly from ``seq``
    down to ``seq / 2``, packed end to end; every token of the pack a call."""
    lengths = spread_lengths(case)

    def arguments(seed: int) -> Arguments:
        gen = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu.to(case.device)
        q = case.randn(gen, total, case.h, case.Dh)
        k, v = case.randn(gen, total, case.g, case.Dh), case.randn(gen, total, case.g, case.Dh)
        return (q, k, v, cu, cu, case.seq, case.seq), {"causal": True}

    label = f"{case.shape} longest={case.seq} {case.dtype}"
    return Workload(label, sum(lengths), arguments, oracle="varlen-reference")


FAMILY = ApiFamily(
    name=NAME,
    alignments=("bottom_right",),  # each sequence's, as FlashAttention's
    summary="FlashAttention 2's flash_attn_varlen_func: packed sequences (total, h, D) "
    "described by int32 cu_seqlens, each attended on its own, bottom-right",
    signature="fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
    "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    positional=7,
    keywords=("cu_seqlens_q", "cu_seqlens_k", "softmax_scale", "causal"),
    defaults=FLASH_ATTN_2_VARLEN,
    build=_varlen_build,
    read=_varlen_read,
    to_layout=_packed_layout,
    from_layout=_packed_back,
    native_causal=flash_native_causal,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
    bench_backends=("varlen-reference", "varlen-naive", "varlen-sdpa", "flash-attn-varlen"),
    workload=_prefill_workload,
)
