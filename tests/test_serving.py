"""The packed, paged and rotary references: worked examples against the dense reference,
their laws, and their errors on bad input."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnref import functional as F
from attnref.kvcache import kvcache_attention
from attnref.rotary import RotaryEmbedding, halves_from_interleaved, rotary, rotary_tables
from attnref.varlen import varlen_attention

D64 = torch.float64


def _cu(lengths: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """One sequence ``(T, heads, D)`` by the dense reference, bottom-right."""
    out: torch.Tensor = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        causal_alignment="bottom_right",
        enable_gqa=q.shape[1] != k.shape[1],
        **kw,
    )
    return out[0].transpose(0, 1)


# ------------------------------------------------------------------------ varlen


def test_varlen_equals_each_sequence_alone_with_empty_and_one_token_sequences() -> None:
    torch.manual_seed(0)
    lq, lk = [3, 0, 1, 5, 2], [4, 2, 1, 5, 0]
    q = torch.randn(sum(lq) + 2, 4, 8, dtype=D64)  # 2 padding tokens
    k, v = torch.randn(sum(lk), 2, 8, dtype=D64), torch.randn(sum(lk), 2, 3, dtype=D64)
    out, lse = varlen_attention(
        q, k, v, _cu(lq), _cu(lk), 5, 5, causal=True, window_size=(2, 0), return_lse=True
    )
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for n in range(len(lq)):
        qs, ks = slice(cq[n], cq[n + 1]), slice(ck[n], ck[n + 1])
        want = _dense(q[qs], k[ks], v[ks], is_causal=True, window=(2, 0))
        torch.testing.assert_close(out[qs], want)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding
    assert bool((lse[:, cq[4] : cq[5]] == -math.inf).all())  # a sequence with no keys
    assert torch.equal(out[cq[4] : cq[5]], torch.zeros_like(out[cq[4] : cq[5]]))


def test_varlen_has_gradients() -> None:
    torch.manual_seed(1)
    q = torch.randn(5, 2, 3, dtype=D64, requires_grad=True)
    k = torch.randn(6, 1, 3, dtype=D64, requires_grad=True)
    v = torch.randn(6, 1, 2, dtype=D64, requires_grad=True)
    cq, ck = _cu([2, 3]), _cu([4, 2])

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, cq, ck, 3, 4, causal=True, softcap=2.0)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize(
    ("cu_q", "max_q", "message"),
    [
        (torch.tensor([1, 3], dtype=torch.int32), 5, "cu_seqlens_q must start at 0, got 1"),
        (torch.tensor([0, 3, 2, 4], dtype=torch.int32), 5, "decreases at sequence 1: 3 then 2"),
        (torch.tensor([0, 3], dtype=torch.int64), 5, "cu_seqlens_q must be int32, got torch.int64"),
        (torch.tensor([0, 9], dtype=torch.int32), 9, "ends at 9, past the 4 tokens given"),
        (torch.tensor([0, 4], dtype=torch.int32), 3, "4 tokens, more than max_seqlen 3"),
        (torch.tensor([0, 2, 4], dtype=torch.int32), 3, "describes 2 sequences"),
    ],
)
def test_varlen_bad_cu_seqlens_are_named(cu_q: torch.Tensor, max_q: int, message: str) -> None:
    q, k = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    three = cu_q.numel() == 4  # three sequences: the keys must describe three too
    cu_k = _cu([1, 1, 2]) if three else _cu([4])
    with pytest.raises(ValueError, match=message):
        varlen_attention(q, k, k, cu_q, cu_k, max_q, 4)


# ----------------------------------------------------------------------- kvcache


def _paged(cache: torch.Tensor, page: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A contiguous cache ``(B, T, g, D)`` as shuffled pages, garbage in a spare page."""
    B, T = cache.shape[:2]
    per_row = T // page
    order = torch.randperm(B * per_row + 1, generator=gen)
    table = order[: B * per_row].reshape(B, per_row).to(torch.int32)
    pages = 100 * torch.randn(B * per_row + 1, page, *cache.shape[2:], dtype=cache.dtype)
    for b in range(B):
        for i in range(per_row):
            pages[table[b, i]] = cache[b, i * page : (i + 1) * page]
    return pages, table


def test_kvcache_paged_split_and_contiguous_agree_with_dense_and_append_in_place() -> None:
    gen = torch.Generator().manual_seed(2)
    B, T, g, h, D = 2, 12, 2, 4, 8
    kc, vc = torch.randn(B, T, g, D, dtype=D64), torch.randn(B, T, g, D, dtype=D64)
    q = torch.randn(B, 2, h, D, dtype=D64)
    k, v = torch.randn(B, 2, g, D, dtype=D64), torch.randn(B, 2, g, D, dtype=D64)
    lengths = torch.tensor([3, 10], dtype=torch.int32)
    cos, sin = rotary_tables(T + 2, 4, dtype=D64)
    kw: dict[str, Any] = {"causal": True, "window_size": (5, 0), "rotary_interleaved": False}
    contiguous = kc.clone(), vc.clone()
    out = kvcache_attention(q, *contiguous, k, v, cos, sin, lengths, **kw)
    pk, table = _paged(kc, 4, gen)
    pv, _ = _paged(vc, 4, torch.Generator().manual_seed(2))
    before = pk.clone()
    paged = kvcache_attention(
        q,
        pk,
        pv,
        k,
        v,
        cos,
        sin,
        lengths,
        block_table=table,
        num_splits=3,
        **kw,
    )
    torch.testing.assert_close(paged, out)
    for b, n in enumerate(lengths.tolist()):
        pos = torch.arange(n, n + 2)
        k_rot = rotary(k[b], cos[pos, None], sin[pos, None])
        torch.testing.assert_close(contiguous[0][b, n : n + 2], k_rot)  # appended, rotated
        assert torch.equal(contiguous[0][b, :n], kc[b, :n])  # nothing else changed
        assert torch.equal(contiguous[0][b, n + 2 :], kc[b, n + 2 :])
        q_rot = rotary(q[b], cos[pos, None], sin[pos, None])
        keys = contiguous[0][b, : n + 2]
        want = _dense(q_rot, keys, contiguous[1][b, : n + 2], is_causal=True, window=(5, 0))
        torch.testing.assert_close(out[b], want)
    changed = (pk != before).any(-1).any(-1)
    assert int(changed.sum()) == 4  # two new tokens in each of two rows


def test_kvcache_rotates_every_query_at_the_cache_length_unless_causal() -> None:
    torch.manual_seed(3)
    q, kc = torch.randn(1, 3, 2, 4, dtype=D64), torch.randn(1, 8, 2, 4, dtype=D64)
    k = torch.randn(1, 3, 2, 4, dtype=D64)
    cos, sin = rotary_tables(16, 4, dtype=D64)
    out = kvcache_attention(q, kc.clone(), kc.clone(), k, k, cos, sin, 2)
    cache = kc.clone()
    cache[0, 2:5] = rotary(k[0], cos[2:5, None], sin[2:5, None], interleaved=True)
    q_rot = rotary(q[0], cos[2:3, None], sin[2:3, None], interleaved=True)
    vals = kc.clone()
    vals[0, 2:5] = k[0]
    torch.testing.assert_close(out[0], _dense(q_rot, cache[0, :5], vals[0, :5]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cache_seqlens": 7}, "past the cache's capacity 8"),
        ({"block_table": torch.tensor([[0, 9]], dtype=torch.int32), "cache_seqlens": 5},
         "names page 9"),
        ({"rotary_cos": torch.ones(16, 3), "rotary_sin": torch.ones(16, 3)},
         "rotary dim 6 is larger than the head dim 4"),
        ({"rotary_cos": torch.ones(3, 2), "rotary_sin": torch.ones(3, 2)},
         "rotary tables have 3 positions; 4 are needed"),
        ({"cache_seqlens": torch.tensor([1], dtype=torch.int64)}, "must be int32"),
        ({"cache_batch_idx": torch.tensor([5], dtype=torch.int32)}, "names cache row 5"),
        ({"num_splits": -1}, "num_splits must be an int >= 0"),
        ({"cache_leftpad": torch.zeros(1, dtype=torch.int32)}, "cache_leftpad is not supported"),
    ],
)  # fmt: skip
def test_kvcache_bad_input_is_named(change: dict[str, object], message: str) -> None:
    q, k = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    paged = "block_table" in change
    cache = torch.randn(2, 4, 2, 4) if paged else torch.randn(1, 8, 2, 4)
    kw: dict[str, Any] = {"cache_seqlens": 2, **change}
    with pytest.raises(ValueError, match=message):
        kvcache_attention(q, cache, cache.clone(), k, k, **kw)


def test_cases_refuse_bad_packs_and_caches() -> None:
    from attnref.conformance.cases import Case

    with pytest.raises(ValueError, match="rotary must be even and at most Dh = 8, got 3"):
        Case("x", rotary=3)
    with pytest.raises(ValueError, match="rotary must be even and at most Dh = 8, got 10"):
        Case("x", rotary=10)
    with pytest.raises(ValueError, match=r"seqlens\[1\] must be \(Tq, Tk\)"):
        Case("x", seqlens=((1, 1), (2, -1)))
    with pytest.raises(ValueError, match=r"a pack .* or a cache .*, not both"):
        Case("x", seqlens=((1, 1),), cached=(2,))
    with pytest.raises(ValueError, match=r"Case\.page must be >= 0"):
        Case("x", cached=(2,), page=-4)


# ------------------------------------------------------------------------ rotary


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 40), st.integers(0, 40), st.integers(-5, 5), st.sampled_from((2, 4, 8)),
    st.booleans(), st.integers(0, 2**16),
)  # fmt: skip
def test_rotary_scores_depend_only_on_the_relative_position(
    m: int, n: int, shift: int, R: int, interleaved: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(8, generator=gen, dtype=D64), torch.randn(8, generator=gen, dtype=D64)
    cos, sin = rotary_tables(100, R, dtype=D64)
    s = max(shift, -min(m, n))

    def score(a: int, b: int) -> float:
        qa = rotary(q, cos[a], sin[a], interleaved=interleaved)
        kb = rotary(k, cos[b], sin[b], interleaved=interleaved)
        return float(qa @ kb)

    assert math.isclose(score(m, n), score(m + s, n + s), rel_tol=1e-9, abs_tol=1e-9)
    turned = rotary(q, cos[m], sin[m], interleaved=interleaved)
    assert math.isclose(float(turned.norm()), float(q.norm()), rel_tol=1e-12)
    assert torch.equal(turned[R:], q[R:])  # dims past R pass through


def test_rotary_layouts_agree_after_the_fixed_permutation() -> None:
    x = torch.randn(3, 5, 2, 10, dtype=D64)
    cos, sin = rotary_tables(5, 6, dtype=D64)
    p = halves_from_interleaved(6, 10)
    halves = rotary(x[..., p], cos[:, None], sin[:, None], interleaved=False)
    inter = rotary(x, cos[:, None], sin[:, None], interleaved=True)
    torch.testing.assert_close(halves, inter[..., p])
    assert not torch.allclose(halves, rotary(x, cos[:, None], sin[:, None])[..., p])


def test_rotary_embedding_layer_offsets_positions() -> None:
    rope = RotaryEmbedding(4)
    x = torch.randn(2, 7, 6, dtype=D64)
    whole = rope(x)
    torch.testing.assert_close(rope(x[:, 3:], offset=3), whole[:, 3:])
    assert "rotary_dim=4" in repr(rope)
    with pytest.raises(ValueError, match="rotary dim must be even"):
        RotaryEmbedding(3)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        rope(x, offset=-1)


def test_the_adapter_reads_the_cache_as_the_reference_does_without_cache_seqlens() -> None:
    """The decode rules (cached lengths, rotation positions) are written once, in
    attnref.kvcache, and the conformance adapter uses them: without cache_seqlens a paged
    cache is full less the append, pages times the page size (not one page)."""
    from attnref.conformance.families.flash_kvcache import kvcache_naive

    gen = torch.Generator().manual_seed(3)
    B, g, h, D, page, pages = 2, 1, 2, 8, 4, 3
    k_cache = torch.randn(B * pages, page, g, D, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(B * pages, page, g, D, generator=gen, dtype=torch.float64)
    table = torch.randperm(B * pages, generator=gen).reshape(B, pages).to(torch.int32)
    q = torch.randn(B, 1, h, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, 1, g, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, 1, g, D, generator=gen, dtype=torch.float64)
    cos, sin = rotary_tables(pages * page, D, dtype=torch.float64)
    outs = []
    for fn in (kvcache_attention, kvcache_naive):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append((fn(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, block_table=table,
                        causal=True), kc, vc))  # fmt: skip
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b)


def test_a_decode_kernel_of_one_query_and_no_empty_sequence_is_audited_inside_that() -> None:
    """A decode kernel takes one query a sequence and never a sequence with no key
    (``single_query``, ``empty_sequences=False``): its cases are drawn so and judged
    (before, 1630 of 2157 drawn cases were refused and the verdict still OK); declared
    as the preset, the same kernel fails on the calls it cannot take."""
    from dataclasses import replace

    from attnref.conformance import Backend, audit, resolve_backend

    spec = "tests.planted_serving:decode_only"
    backend = resolve_backend(spec, api="flash-kvcache")
    props = ["kvcache", "kvcache_pages", "kvcache_splits"]
    kwargs = {"properties": props, "dtypes": [torch.float32], "device": "cpu", "progress": False}
    report = audit(backend, **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.format_table()
    for r in report.results:
        assert r.judged >= 20, report.format_table()
        assert r.skipped <= r.checks // 5, report.format_table()
    caps = replace(backend.capabilities, single_query=False, empty_sequences=True)
    preset = Backend("as-the-preset", backend.fn, "", caps, api="flash-kvcache", spec=spec)
    assert not audit(preset, **kwargs).ok  # type: ignore[arg-type]


@pytest.mark.slow  # four cache audits: 6 s
def test_sinks_in_a_cache_call_are_drawn_and_judged() -> None:
    """``Capabilities.preset("flash-kvcache", sinks=True)`` was accepted and never
    tested: the convention skipped every call with sinks. Declared, cache calls carry
    ``sinks=`` (one logit a query head); a kernel that applies them passes, one that
    takes them and drops them fails."""
    from attnref.conformance import audit, resolve_backend

    kwargs = {"properties": ["kvcache", "variants"], "dtypes": [torch.float32],
              "device": "cpu", "progress": False}  # fmt: skip
    right = audit(resolve_backend("tests.planted_serving:kvcache_sinks", api="flash-kvcache"),
                  **kwargs)  # type: ignore[arg-type]  # fmt: skip
    assert right.ok, right.format_table()
    assert all(r.judged >= 20 for r in right.results), right.format_table()
    wrong = audit(resolve_backend("tests.planted_serving:sinks_ignored", api="flash-kvcache"),
                  **kwargs)  # type: ignore[arg-type]  # fmt: skip
    assert not wrong.ok


@pytest.mark.slow  # two audits (5 s)
def test_an_lse_that_counts_the_sink_is_declared_and_judged_so() -> None:
    """SGLang's extend kernel returns ``logaddexp(lse, sink)``: declared
    (``lse_with_sink``), its LSE is judged so and passes; the same kernel declaring the
    keys-only LSE of FlashAttention fails on its LSE."""
    from dataclasses import replace

    from attnref.conformance import Backend, audit, resolve_backend

    kwargs = {"properties": ["kvcache"], "dtypes": [torch.float32], "device": "cpu",
              "progress": False}  # fmt: skip
    spec = "tests.planted_serving:lse_with_sink"
    backend = resolve_backend(spec, api="flash-kvcache")
    assert backend.capabilities.lse
    right = audit(backend, **kwargs)  # type: ignore[arg-type]
    assert right.ok, right.format_table()
    caps = replace(backend.capabilities, lse_with_sink=False)
    keys_only = Backend("keys-only", backend.fn, "", caps, api="flash-kvcache", spec=spec)
    wrong = audit(keys_only, **kwargs)  # type: ignore[arg-type]
    assert not wrong.ok
    assert "log-sum-exp" in wrong.results[0].message, wrong.format_table()


@pytest.mark.slow  # two audits of two cache properties: 10 s
def test_queries_at_most_keys_holds_per_row_of_a_cache() -> None:
    """An extend kernel (SGLang's) takes no row with more queries than keys, counted per
    row: its cached keys and the new ones. The cache cases held Tq <= Tk only for the
    cache's length, so rows of a short sequence reached it and it failed kvcache and
    kvcache_pages as declared. Drawn per row it passes; a real bug behind the same
    declaration still fails."""
    from dataclasses import replace

    from attnref.conformance import audit
    from attnref.conformance.backends import resolve_backend

    props = ["kvcache", "kvcache_pages"]
    kwargs: dict[str, Any] = {"api": "flash-kvcache", "properties": props,
                              "dtypes": [torch.float32], "progress": False}  # fmt: skip
    report = audit("tests.planted_serving:extend_only", **kwargs)
    assert report.ok, report.format_table()
    broken = resolve_backend("tests.planted_serving:ignores_new_tokens", "flash-kvcache")
    broken = replace(broken, capabilities=replace(broken.capabilities, queries_at_most_keys=True))
    assert not audit(broken, **kwargs).ok
