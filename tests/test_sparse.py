"""DeepSeek's sparse attention (`attnref.sparse`) and its two families, ``sparse-mla``
(FlashMLA's prefill) and ``sparse-mla-fp8`` (its FP8 decode): the reference, the packed
FP8 layout byte for byte, the cases, the built-ins and the planted kernels of
tests/planted_sparse.py."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnref.conformance import PROPERTIES, Case, resolve_backend
from attnref.conformance.families.sparse_mla import build_sparse
from attnref.conformance.families.sparse_mla_fp8 import build_sparse_fp8
from attnref.mla import mla_kvcache_attention
from attnref.sparse import (
    FP8_SPARSE_BYTES,
    attend_rows,
    attend_scored,
    pack_fp8_model1,
    pack_fp8_sparse,
    sparse_mla_attention,
    sparse_mla_decode,
    tile_scales,
    unpack_fp8_cache,
    unpack_fp8_model1,
    unpack_fp8_sparse,
)
from tests.bug_reports import reports_reproduce
from tests.planted_sparse import UNSEEN
from tests.test_audit import run

SLOW = pytest.mark.slow


def _inputs(seed: int, Tq: int, h: int, Tk: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, h, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(Tk, 1, D, generator=gen, dtype=torch.float64)
    return q, kv


# -------------------------------------------------------------------- the reference


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 99), Tq=st.integers(1, 5), h=st.sampled_from((1, 3, 5)),
       Tk=st.integers(1, 13), dims=st.sampled_from(((7, 5), (11, 11), (16, 3))))  # fmt: skip
def test_every_index_selected_equals_the_mla_family_s_dense_result(
    seed: int, Tq: int, h: int, Tk: int, dims: tuple[int, int]
) -> None:
    """A layer test: sparse attention whose every query lists every row equals FlashMLA's
    dense decode (`attnref.mla`) over those rows, output and LSE."""
    D, Dv = dims
    q, kv = _inputs(seed, Tq, h, Tk, D)
    indices = torch.arange(Tk, dtype=torch.int32).repeat(Tq, 1)[:, None]
    out, peak, lse = sparse_mla_attention(q, kv, indices, 0.3, Dv)
    dense, dense_lse = mla_kvcache_attention(
        q[None], kv[None], torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([Tk], dtype=torch.int32), Dv, softmax_scale=0.3,
    )  # fmt: skip
    torch.testing.assert_close(out, dense[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, dense_lse[0].T, rtol=1e-12, atol=1e-12)
    scores = 0.3 * torch.einsum("ihd,kd->ihk", q, kv[:, 0])
    torch.testing.assert_close(peak, scores.amax(-1))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 99), Tk=st.integers(2, 12), topk=st.integers(1, 20))
def test_invalid_entries_and_order_never_matter_and_repeats_count_twice(
    seed: int, Tk: int, topk: int
) -> None:
    """Entries -1 and past the rows are ignored (NaN rows unselected never matter); a
    list permuted gives the same; a row listed twice is attended twice, as dense
    attention over the gathered rows."""
    gen = torch.Generator().manual_seed(seed)
    q, kv = _inputs(seed, 3, 2, Tk, 6)
    idx = torch.randint(-2, Tk + 3, (3, topk), generator=gen)
    kv[(torch.arange(Tk)[:, None] != idx[None].clamp(0).flatten()).all(-1)] = math.nan
    out, peak, lse = sparse_mla_attention(q, kv, idx[:, None].int(), 0.5, 4)
    perm = torch.randperm(topk, generator=gen)
    again = sparse_mla_attention(q, kv, idx[:, perm][:, None].int(), 0.5, 4)
    for a, b in zip((out, peak, lse), again, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for i in range(3):
        sel = idx[i][(idx[i] >= 0) & (idx[i] < Tk)]
        if len(sel) == 0:
            assert bool((out[i] == 0).all())
            assert bool(torch.isposinf(lse[i]).all())
            assert bool(torch.isneginf(peak[i]).all())
            continue
        k = kv[sel, 0]  # repeats gathered as listed
        s = 0.5 * q[i] @ k.T
        torch.testing.assert_close(out[i], s.softmax(-1) @ k[:, :4])
        torch.testing.assert_close(lse[i], s.logsumexp(-1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 99), n=st.integers(1, 4), h=st.sampled_from((1, 3, 16)),
       Tk=st.integers(1, 40), topk=st.integers(0, 50),
       dtype=st.sampled_from((torch.float64, torch.float32, torch.bfloat16)))  # fmt: skip
def test_scoring_every_row_equals_gathering_the_listed_ones(
    seed: int, n: int, h: int, Tk: int, topk: int, dtype: torch.dtype
) -> None:
    """`sparse_mla_attention`'s two ways (`attend_scored` where queries list most rows,
    `attend_rows` on gathered rows where they list few) give the same output, LSE and
    ``max_logits``: invalid entries, repeats, queries with no valid entry, and NaN in
    every row no entry lists."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, 9, generator=gen).to(dtype)
    kv = torch.randn(Tk, 9, generator=gen).to(dtype)
    idx = torch.randint(-1, Tk + 2, (n, topk), generator=gen)
    idx[0, : topk // 2] = -1  # the first query with fewer valid entries, maybe none
    valid = (idx >= 0) & (idx < Tk)
    kv[(torch.arange(Tk)[:, None] != idx[valid][None]).all(-1)] = math.nan
    gathered = attend_rows(q, kv[idx.clamp(0, Tk - 1)], valid, 0.4, 5)
    scored = attend_scored(q, kv, idx, valid, 0.4, 5)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(gathered, scored, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_topk_length_and_the_sink() -> None:
    """``topk_length`` counts the first entries only; the sink scales the output by
    ``sigmoid(lse - sink)`` and leaves the LSE, ``-inf`` changes nothing, ``+inf`` gives
    zeros."""
    q, kv = _inputs(1, 2, 3, 9, 8)
    idx = torch.tensor([[0, 3, 5, 7], [1, 2, 8, 4]], dtype=torch.int32)[:, None]
    cut, _, cut_lse = sparse_mla_attention(q, kv, idx, 0.4, 8, topk_length=torch.tensor([2, 3]))
    first, _, first_lse = sparse_mla_attention(q[:1], kv, idx[:1, :, :2], 0.4, 8)
    torch.testing.assert_close(cut[:1], first)
    torch.testing.assert_close(cut_lse[:1], first_lse)
    out, _, lse = sparse_mla_attention(q, kv, idx, 0.4, 8)
    sink = torch.tensor([0.5, -math.inf, math.inf], dtype=torch.float64)
    sunk, _, sunk_lse = sparse_mla_attention(q, kv, idx, 0.4, 8, attn_sink=sink)
    torch.testing.assert_close(sunk_lse, lse)
    torch.testing.assert_close(sunk[:, 0], out[:, 0] * torch.sigmoid(lse[:, 0] - 0.5)[:, None])
    torch.testing.assert_close(sunk[:, 1], out[:, 1])
    assert bool((sunk[:, 2] == 0).all())


def test_decode_is_the_prefill_over_the_flattened_cache_and_refuses_a_slot_past_it() -> None:
    q, rows = _inputs(2, 6, 2, 12, 8)
    cache = rows.reshape(3, 4, 1, 8)  # 3 pages of 4 slots
    idx = torch.tensor([[[5, -1, 11], [0, 0, -1]], [[3, 7, 2], [-1, -1, -1]],
                        [[9, 10, 1], [4, 6, 8]]], dtype=torch.int32)  # fmt: skip
    out, lse = sparse_mla_decode(q.reshape(3, 2, 2, 8), cache, idx, 8, 0.7)
    flat, _, flat_lse = sparse_mla_attention(q, rows, idx.reshape(6, 1, 3), 0.7, 8)
    torch.testing.assert_close(out, flat.reshape(3, 2, 2, 8))
    torch.testing.assert_close(lse, flat_lse.reshape(3, 2, 2).transpose(1, 2))
    with pytest.raises(ValueError, match="below 12"):
        sparse_mla_decode(q.reshape(3, 2, 2, 8), cache, idx.clamp(max=12) + 1, 8)


# ---------------------------------------------------------------- the FP8 layout


def test_a_packed_row_is_flash_mla_s_656_bytes() -> None:
    """Worked by hand: tile 0 of 448s has scale 1 and stores e4m3 448 (0x7E); tile 1 of
    0.5s has amax 0.5, 0.5 / 448 raised to a power of two is 2**-9, and 0.5 / 2**-9 =
    256 is 0x78; tile 2 is zero (scale 2**-13, the power of two at or above 1e-4);
    tile 3 holds -3: 2**-7, and -384 is 0xFC. The scales are little-endian float32, the
    rope dims bfloat16 (1.0 is 0x3F80)."""
    row = torch.zeros(576)
    row[:128], row[128:256], row[384:512], row[512:] = 448.0, 0.5, -3.0, 1.0
    raw = pack_fp8_sparse(row).view(torch.uint8)
    assert raw.shape == (FP8_SPARSE_BYTES,) == (656,)
    assert raw[:128].tolist() == [0x7E] * 128
    assert raw[128:256].tolist() == [0x78] * 128
    assert raw[256:384].tolist() == [0] * 128
    assert raw[384:512].tolist() == [0xFC] * 128
    assert raw[512:528].tolist() == [0, 0, 0x80, 0x3F, 0, 0, 0, 0x3B, 0, 0, 0, 0x39, 0, 0, 0, 0x3C]
    assert raw[528:].tolist() == [0x80, 0x3F] * 64
    torch.testing.assert_close(unpack_fp8_sparse(pack_fp8_sparse(row)), row.double())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 999), amp=st.sampled_from((1e-6, 0.01, 1.0, 300.0, 1e5)))
def test_packing_is_deepseek_s_quantizer_and_unpacking_is_exact(seed: int, amp: float) -> None:
    """Each tile's scale is the smallest power of two at or above ``amax / 448`` (and
    ``1e-4``); each stored value is the bfloat16 row over its scale rounded to e4m3;
    unpacking gives back exactly those values times their scales, and the rope dims."""
    gen = torch.Generator().manual_seed(seed)
    row = (amp * torch.randn(3, 576, generator=gen)).to(torch.bfloat16)
    scales = tile_scales(row)
    amax = row[:, :512].float().reshape(3, 4, 128).abs().amax(-1)
    assert bool((scales >= torch.clamp_min(amax / 448, 1e-4)).all())
    assert bool((scales / 2 < torch.clamp_min(amax / 448, 1e-4)).all())
    assert bool((scales.log2() == scales.log2().round()).all())
    back = unpack_fp8_sparse(pack_fp8_sparse(row))
    stored = (row[:, :512].float().reshape(3, 4, 128) / scales[..., None]).to(torch.float8_e4m3fn)
    want = stored.double() * scales.double()[..., None]
    assert torch.equal(back[:, :512], want.reshape(3, 512))
    assert torch.equal(back[:, 512:], row[:, 512:].double())


def test_a_scale_that_saturates_its_tile_is_refused() -> None:
    with pytest.raises(ValueError, match="saturates"):
        pack_fp8_sparse(torch.full((576,), 10.0), scales=torch.full((4,), 2.0**-6))
    with pytest.raises(ValueError, match="576 dims"):
        pack_fp8_sparse(torch.zeros(512))


def test_a_model1_page_is_flash_mla_s_layout() -> None:
    """DeepSeek-V4's MODEL1 pages (FlashMLA's ``tests/quant.py``), by hand: a page of 3
    tokens holds their 576 value bytes each (448 e4m3, then 64 bfloat16 rope dims), then
    their 8 scale bytes each (7 UE8M0 exponents, ``127 + log2(scale)``, and a pad); pages
    start 576 * 4 bytes apart (3 * 584 = 1752, rounded up to a multiple of 576). Token
    ``t`` has tile 0 of 448s (scale 1: 0x7E, exponent 127) and its other tiles of ``t +
    1`` (scale 2**-8 for 1, 2**-7 for 2 and 3: 256 is 0x78, 384 is 0x7C)."""
    rows = torch.zeros(2, 3, 512)
    for t in range(3):
        rows[:, t, :64], rows[:, t, 64:448], rows[:, t, 448:] = 448.0, t + 1.0, -2.0
    k = pack_fp8_model1(rows)
    assert k.shape == (2, 3, 1, 584)
    assert k.stride()[:2] == (2304, 584)
    page = k.view(torch.uint8).reshape(2, 3 * 584)[1]
    for t, (value, exponent) in enumerate(((0x78, 119), (0x78, 120), (0x7C, 120))):
        token = page[t * 576 : (t + 1) * 576].tolist()
        assert token[:64] == [0x7E] * 64
        assert token[64:448] == [value] * 384
        assert token[448:] == [0x00, 0xC0] * 64  # bfloat16 -2.0, little-endian
        assert page[1728 + 8 * t : 1736 + 8 * t].tolist() == [127] + [exponent] * 6 + [0]
    assert torch.equal(unpack_fp8_model1(k), rows.double())
    assert torch.equal(unpack_fp8_cache(k)[:, :, 0], rows.double())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 999), amp=st.sampled_from((1e-6, 0.01, 1.0, 300.0, 1e5)))
def test_model1_packing_is_deepseek_s_quantizer_and_unpacking_is_exact(
    seed: int, amp: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = (amp * torch.randn(2, 5, 512, generator=gen)).to(torch.bfloat16)
    tiles = rows[..., :448].float().reshape(2, 5, 7, 64)
    bound = torch.clamp_min(tiles.abs().amax(-1) / 448, 1e-4)
    scales = torch.pow(2.0, bound.log2().ceil())
    assert bool((scales >= bound).all())
    assert bool((scales / 2 < bound).all())
    want = (tiles / scales[..., None]).to(torch.float8_e4m3fn).double() * scales.double()[..., None]
    back = unpack_fp8_model1(pack_fp8_model1(rows))
    assert torch.equal(back[..., :448], want.reshape(2, 5, 448))
    assert torch.equal(back[..., 448:], rows[..., 448:].double())


def test_a_cache_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match=r"656 \(V32_FP8Sparse\) or 584"):
        unpack_fp8_cache(torch.zeros(2, 4, 1, 600, dtype=torch.uint8))


# -------------------------------------------------------------------- the cases


def test_a_sparse_case_poisons_what_no_query_reads_and_lists_both_invalid_forms() -> None:
    """The rows no query selects, and one row before and after ``kv`` in its buffer, are
    NaN; the lists hold ``-1`` (and below) and ``Tk`` (and past) as declared."""
    caps = resolve_backend("sparse-mla-reference").capabilities
    case = Case("sparse_mla", h=3, g=1, Tq=4, Tk=30, Dh=12, Dv=8, latent=True, seed=5,
                options=(("topk", 40), ("valid", "random"), ("sentinels", ("-1", "past_end")),
                         ("order", "shuffled")))  # fmt: skip
    call = build_sparse(case, torch.float32, "cpu", caps)
    idx = call.indices[:, 0].long()
    valid = (idx >= 0) & (idx < 30)
    assert bool((idx < 0).any())
    assert bool((idx >= 30).any())
    selected = torch.zeros(30, dtype=torch.bool)
    selected[idx[valid]] = True
    assert bool(torch.isnan(call.kv[~selected]).all())
    assert not bool(torch.isnan(call.kv[selected]).any())
    base = call.kv.untyped_storage()
    whole = torch.empty(0).set_(base).view(-1, 12)  # the buffer around kv
    assert bool(torch.isnan(whole[0]).all())
    assert bool(torch.isnan(whole[31]).all())
    for i, x in enumerate(call.rows):
        assert x.key.shape[-2] == int(valid[i].sum())


def test_a_sink_case_draws_a_sink_per_head_near_its_lses_and_passes_it_where_declared() -> None:
    """``sink`` draws one logit a head, each near its queries' LSEs (the output's factor
    well inside (0, 1)), ``-inf`` for one head with ``some_none``; every query's oracle
    carries them; the call passes ``attn_sink`` where declared and is skipped, with
    the reason, where not."""
    from dataclasses import replace

    from attnref.conformance.families.sparse_mla import sparse_arguments
    from attnref.conformance.verdicts import Skip

    caps = resolve_backend("sparse-mla-reference").capabilities
    opts = (("topk", 40), ("valid", "all"), ("sentinels", ("-1",)), ("order", "sorted"))
    case = Case("sparse_sink", h=5, g=1, Tq=4, Tk=30, Dh=12, Dv=8, latent=True, seed=5,
                options=(*opts, ("sink", "near")))  # fmt: skip
    call = build_sparse(case, torch.float32, "cpu", caps)
    assert call.attn_sink is not None
    assert call.attn_sink.shape == (5,)
    assert all(x.sinks is not None and torch.equal(x.sinks, call.attn_sink) for x in call.rows)
    lse = torch.stack([torch.logsumexp(call.sm_scale * x.query.double()
                                       @ x.key.double().transpose(-1, -2), -1)[:, 0]
                       for x in call.rows])  # fmt: skip
    factor = torch.sigmoid(lse - call.attn_sink.double())
    assert bool(((factor > 0.005) & (factor < 0.995)).all()), factor
    _, kwargs = sparse_arguments(caps, call, {})
    assert kwargs["attn_sink"] is call.attn_sink
    with pytest.raises(Skip, match="attn_sink"):
        sparse_arguments(replace(caps, attn_sink=False), call, {})
    none = build_sparse(replace(case, options=(*opts, ("sink", "some_none"))), torch.float32,
                        "cpu", caps)  # fmt: skip
    assert none.attn_sink is not None
    assert int(torch.isneginf(none.attn_sink).sum()) == 1
    plain = build_sparse(replace(case, options=opts), torch.float32, "cpu", caps)
    assert plain.attn_sink is None
    assert all(x.sinks is None for x in plain.rows)


def test_an_fp8_case_spreads_its_tiles_and_pads_its_pages_as_flash_mla_s_tests() -> None:
    caps = resolve_backend("sparse-mla-fp8-reference").capabilities
    case = Case("sparse_fp8", h=3, g=1, Tq=2, Dh=576, Dv=512, cached=(70, 9), page=16,
                latent=True, seed=2, options=(("topk", 64), ("valid", "all"),
                ("tiles", "spread"), ("padded", True)))  # fmt: skip
    call = build_sparse_fp8(case, "cpu", caps)
    assert call.k_cache.shape[1:] == (16, 1, 656)
    assert call.k_cache.stride(0) == 17 * 656  # FlashMLA's tests: page_block_size + 1
    raw = call.k_cache.view(torch.uint8)
    assert bool((raw[0] == 255).all())  # page 0 is never used: -1 read as slot 0 reads NaN
    scales = torch.stack([unpack_fp8_sparse(call.k_cache)[s // 16, s % 16, 0]
                          for s in call.indices[0, 0].long().tolist()])  # fmt: skip
    sizes = scales[:, :512].abs().reshape(-1, 4, 128).amax(-1).mean(0)
    assert bool((sizes[1:] / sizes[:-1] > 4).all())  # tile sizes 2**-6 .. 2**6 apart
    assert len(call.rows) == 4
    assert all(x.key.shape[-2] in (64, 9) for x in call.rows)


def test_a_model1_case_poisons_every_slot_no_token_holds() -> None:
    """A MODEL1 case: 512-dim queries, V the whole row; the unused page, the page
    before the cache and the tail of a batch row's last page hold NaN values and NaN
    scale bytes where the page keeps them."""
    caps = resolve_backend("sparse-mla-fp8-reference").capabilities
    assert "MODEL1" in caps.sparse_caches
    case = Case("sparse_fp8", h=3, g=1, Tq=2, Dh=512, Dv=512, cached=(20, 9), page=16,
                latent=True, seed=3, options=(("topk", 64), ("valid", "all"),
                ("tiles", "spread"), ("cache", "MODEL1")))  # fmt: skip
    call = build_sparse_fp8(case, "cpu", caps)
    assert call.cache == "MODEL1"
    assert call.q.shape[-1] == 512
    assert call.k_cache.shape[1:] == (16, 1, 584)
    rows = unpack_fp8_model1(call.k_cache)  # (blocks, 16, 512)
    held = torch.zeros(rows.shape[:2], dtype=torch.bool)
    for x in call.indices.reshape(-1).tolist():
        if x >= 0:
            held[x // 16, x % 16] = True
    assert int(held.sum()) == 29
    assert bool(torch.isnan(rows[~held]).all())
    assert not bool(torch.isnan(rows[held]).any())
    assert all(x.value.shape[-1] == 512 for x in call.rows)
    raw = call.k_cache.view(torch.uint8)
    before = torch.as_strided(raw, (16 * 584,), (1,), raw.storage_offset() - raw.stride(0))
    assert bool((before[: 16 * 576] == 255).all())  # the page before: NaN bytes


# ----------------------------------------------------------------- the audits


@SLOW
@pytest.mark.parametrize(
    ("api", "name"),
    [("sparse-mla", "sparse-mla-reference"), ("sparse-mla", "sparse-mla-sdpa"),
     ("sparse-mla-fp8", "sparse-mla-fp8-reference"), ("sparse-mla-fp8", "sparse-mla-fp8-sdpa")],
)  # fmt: skip
def test_the_sparse_built_ins_pass_a_quick_audit(api: str, name: str) -> None:
    """The family's own properties (the whole quick, ci and thorough audits at seeds 0-3
    are measured in docs/sparse.md; CI's time goes to the rest)."""
    own = [p.id for p in PROPERTIES.values() if api in p.families]
    report = run(name, properties=own)
    assert report.ok, report.format_table()


@SLOW
@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_planted_sparse_kernels_fail_the_quick_audit(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Each planted bug (tests/planted_sparse.py, written apart from the mutants) fails
    quick, at the first property its family's own search reaches."""
    api = UNSEEN[name]
    own = [p.id for p in PROPERTIES.values() if api in p.families]
    report = run(resolve_backend(f"tests.planted_sparse:{name}", api=api), properties=own,
                 fail_fast=True)  # fmt: skip
    assert not report.ok, report.format_table()
    right = (
        "right" if api == "sparse-mla" else "right_model1_fp8" if "model1" in name else "right_fp8"
    )
    reports_reproduce(request, report, f"tests.planted_sparse:{right}", tmp_path)


@SLOW
@pytest.mark.parametrize(
    ("name", "api"),
    [
        ("right", "sparse-mla"),
        ("right_fp8", "sparse-mla-fp8"),
        ("right_model1_fp8", "sparse-mla-fp8"),
    ],
)
def test_the_planted_kernels_without_a_bug_pass(name: str, api: str) -> None:
    own = [p.id for p in PROPERTIES.values() if api in p.families]
    report = run(resolve_backend(f"tests.planted_sparse:{name}", api=api), properties=own)
    assert report.ok, report.format_table()


@pytest.mark.slow  # three audits: 9 s
def test_an_implementation_that_materialises_p_v_is_audited_as_it_declares() -> None:
    """FlashMLA's torch reference, DeepSeek-V3.2's model code and fla's naive_dsa gather
    every entry's row and materialise P @ V: weight 0 times the NaN the family planted in
    rows no valid entry names is NaN, and a query with no valid entry is a softmax of
    -inf. Declared so (``masked_nan="propagates"``, ``empty_row="nan"``), such rows hold
    finite values of their own and it passes; one that reads a sentinel's row as a token
    fails; FlashMLA's own declaration keeps the NaN, and a kernel true to it passes."""
    from typing import Any

    from attnref.conformance import audit

    props = ["sparse_mla", "sparse_empty", "sparse_tiles", "sparse_order"]
    kwargs: dict[str, Any] = {"api": "sparse-mla", "dtypes": [torch.float32],
                              "progress": False, "properties": props}  # fmt: skip
    assert audit("tests.planted_sparse:materialised", **kwargs).ok
    assert not audit("tests.planted_sparse:materialised_reads_sentinels", **kwargs).ok
    assert audit("tests.planted_sparse:right", **kwargs).ok


def test_unread_rows_hold_nan_only_where_the_declaration_contains_it() -> None:
    """Rows and slots no valid entry names hold NaN under ``masked_nan="contained"``
    (FlashMLA's), and finite values of their own where NaN there may propagate."""
    from dataclasses import replace

    caps = resolve_backend("sparse-mla-reference").capabilities
    assert caps.masked_nan == "contained"
    case = Case("sparse_mla", h=3, g=1, Tq=2, Tk=40, Dh=576, Dv=512, latent=True, seed=4,
                options=(("topk", 64), ("valid", "random")))  # fmt: skip
    nan = build_sparse(case, torch.float32, "cpu", caps)
    around = (42, 1, 576), (576, 576, 1), 0  # kv's buffer: a row before it and after it
    assert bool(torch.isnan(nan.kv.as_strided(*around)).any())
    finite = build_sparse(case, torch.float32, "cpu", replace(caps, masked_nan="propagates"))
    assert bool(torch.isfinite(finite.kv.as_strided(*around)).all())
    assert torch.equal(finite.q, nan.q)  # the case's own values unchanged
    fp8_caps = resolve_backend("sparse-mla-fp8-reference").capabilities
    fp8 = Case("sparse_fp8", h=3, g=1, Tq=2, Dh=576, Dv=512, cached=(70, 9), page=16,
               latent=True, seed=2, options=(("topk", 64), ("valid", "all")))  # fmt: skip
    raw = build_sparse_fp8(fp8, "cpu", replace(fp8_caps, masked_nan="propagates")).k_cache
    assert bool((raw.view(torch.uint8)[0] == 60).all())  # the unused page: finite bytes


@SLOW  # fresh_values in two dtypes: 20 s
def test_a_wrong_empty_row_is_not_called_a_replay() -> None:
    """A kernel that reads an invalid index as row 0 gives a query that sees no key
    ``V[0]``: bytes an earlier case's right output held, for a V that differed only in
    rows no query saw. fresh_values called it "the backend returned an earlier call's
    result"; where only rows that see no key are wrong, it names the wrong values."""
    report = run(resolve_backend("tests.planted_sparse:invalid_read_as_zero", api="sparse-mla"),
                 properties=["fresh_values"], dtypes=(torch.float32,))  # fmt: skip
    (result,) = report.results
    assert result.status == "fail", report.format_table()
    assert "earlier call's result" not in result.message, result.message
    assert result.message.startswith("call 1 of 6"), result.message
