"""DeepSeek Sparse Attention (DSA) as FlashMLA's kernels take it (docs/sparse.md).

DeepSeek-V3.2's indexer picks, for each query token, ``topk`` cached tokens (2048 in
the model); attention is dense multi-head latent attention over exactly those tokens.

**Prefill** (``flash_mla_sparse_fwd``; deepseek-ai/FlashMLA
``flash_mla/flash_mla_interface.py``, whose docstring points to ``tests/ref.py``
``ref_sparse_attn_fwd`` for the precise definition): queries ``q (Tq, h, D)`` against
latent rows ``kv (Tk, 1, D)``, one key/value head; V is each row's first ``d_v`` dims.
``indices (Tq, 1, topk)`` (int32) name the rows query ``i`` attends:

- an index below 0 (``-1``) or at ``Tk`` or past it is invalid: ignored, never read;
- with ``topk_length (Tq,)``, only the first ``topk_length[i]`` entries count;
- an index listed twice counts twice (the reference gathers the rows it names);
- the scores are ``sm_scale * q k^T``; ``max_logits (Tq, h)`` is their maximum and
  ``lse (Tq, h)`` their log-sum-exp, **natural log** (FlashMLA's README writes both in
  base 2, scores times ``log2 e``; its ``tests/ref.py``, which the interface names as the
  definition, and its kernels since, in base e);
- a query with no valid index: output 0, ``lse = +inf``, ``max_logits = -inf``;
- ``attn_sink (h,)``: the output times ``exp(lse) / (exp(lse) + exp(sink))``; the LSE
  and ``max_logits`` are not changed.

**Decode** (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``, reference
``tests/ref.py`` ``ref_sparse_attn_decode``): ``q (B, Tq, h, D)`` against a paged cache
``k_cache (blocks, page, 1, D)``; ``indices (B, Tq, topk)`` hold ``block * page +
offset`` (the block table already applied, so none is passed), ``-1`` invalid; with
``topk_length (B,)``, only a row's first ``topk_length[b]`` entries count. Returns
``out (B, Tq, h, d_v)`` and ``lse (B, h, Tq)``.

**The FP8 sparse cache** (FlashMLA's ``V32_FP8Sparse`` layout, ``tests/quant.py``): each
576-dim row in 656 bytes: the first 512 dims as float8 e4m3 (4 tiles of 128 values, each
divided by its tile's scale), then the 4 tile scales as float32, then the 64 rope dims
as bfloat16. A tile's scale is ``2 ** ceil(log2(max(amax / 448, 1e-4)))``: a power of
two (UE8M0), ``amax`` the tile's largest magnitude. `pack_fp8_sparse` writes it as
DeepSeek's code does; `unpack_fp8_sparse` reads it back exactly.

**The MODEL1 FP8 cache** (FlashMLA's ``MODEL1_FP8Sparse`` layout, ``tests/quant.py``,
taken when the rows have 512 dims: DeepSeek-V4's, whose V is the whole row): 448 dims as
e4m3 in 7 tiles of 64, 64 rope dims as bfloat16, and the 7 scales as UE8M0 bytes (``2 **
(byte - 127)``). Its bytes are laid out by page, not by token: a page of ``P`` tokens
holds their ``P * 576`` bytes of values (each token's 448 e4m3 bytes, then its 128 rope
bytes), then their ``P * 8`` scale bytes (7 and a pad byte each), and pages lie a
multiple of 576 bytes apart. The cache passed is a ``(blocks, P, 1, 584)`` view of that
buffer (584 bytes a token on average, not a token's bytes), as FlashMLA's quantizer
returns it. `pack_fp8_model1` and `unpack_fp8_model1`.
"""

import math

import torch
from jaxtyping import Bool, Float, Float64, Int, Shaped
from torch import Tensor

from attnref._checking import checked, checked_internal

__all__ = [
    "FP8_SPARSE_BYTES",
    "FP8_SPARSE_TILE",
    "FP8_SPARSE_TILES",
    "MODEL1_BYTES",
    "attend_rows",
    "attend_scored",
    "chunk_queries",
    "pack_fp8_model1",
    "pack_fp8_sparse",
    "score_stats",
    "sparse_mla_attention",
    "sparse_mla_decode",
    "unpack_fp8_cache",
    "unpack_fp8_model1",
    "unpack_fp8_sparse",
]

#: the latent dims the FP8 layout quantizes (``c_kv``), and the rope dims it keeps
NOPE, ROPE = 512, 64
#: values a tile scale covers, tiles a row, and bytes a packed row
FP8_SPARSE_TILE = 128
FP8_SPARSE_TILES = NOPE // FP8_SPARSE_TILE
FP8_SPARSE_BYTES = NOPE + 4 * FP8_SPARSE_TILES + 2 * ROPE  # 656
#: e4m3's largest finite value, and the smallest tile scale (an all-zero tile's)
E4M3_MAX = 448.0
MIN_SCALE = 1e-4
#: elements of gathered rows attended at once (`chunk_queries`)
CHUNK_ELEMENTS = 2**21


#: `sparse_mla_attention` scores every row (`attend_scored`) where the scores of rows no
#: entry lists are at most this many a listed entry (gathering a row costs about as much
#: as 64 scores of it: measured on a CPU, one thread)
SCORED_ROWS = 64


def chunk_queries(per_query: int) -> int:
    """How many queries to attend at once: as many as keep what they hold, ``per_query``
    elements each (gathered rows, ``topk * D``, or scores, ``h * Tk``), within
    `CHUNK_ELEMENTS` (at least one). What a few queries hold stays in cache through the
    passes over it; a large chunk's lands on fresh pages and is read back from memory
    (2.3x slower at 4,096 entries, 576 dims)."""
    return max(1, CHUNK_ELEMENTS // max(per_query, 1))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@checked
def score_stats(
    q: Float[Tensor, "n h D"],
    rows: Float[Tensor, "n k D"],
    valid: Bool[Tensor, "n k"],
    scale: float,
) -> tuple[Float[Tensor, "n h k"], Float[Tensor, "n h"], Float[Tensor, "n h"]]:
    """Each of ``n`` queries' scaled scores against its own ``k`` gathered rows (``-inf``
    where not ``valid``, whatever an invalid row holds: a score reads its own row only),
    their maximum (``max_logits``: ``-inf`` for a query with none) and log-sum-exp
    (``+inf`` for a query with none), in float32 (float64 for float64 inputs)."""
    wide = _wide(q.dtype)
    scores = scale * (q.to(wide) @ rows.to(wide).transpose(-1, -2))  # (n, h, k)
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    return scores, *_peak_and_lse(scores)


@checked_internal
def _peak_and_lse(
    scores: Float[Tensor, "n h k"],
) -> tuple[Float[Tensor, "n h"], Float[Tensor, "n h"]]:
    """``max_logits`` and the LSE of scores ``-inf`` where not selected: ``-inf`` and
    ``+inf`` for a query with none."""
    lse = scores.logsumexp(-1)  # (n, h)
    peak = scores.amax(-1) if scores.shape[-1] else torch.full_like(lse, -math.inf)
    return peak, torch.where(torch.isneginf(lse), math.inf, lse)


@checked
def attend_rows(
    q: Float[Tensor, "n h D"],
    rows: Float[Tensor, "n k D"],
    valid: Bool[Tensor, "n k"],
    scale: float,
    d_v: int,
) -> tuple[Float[Tensor, "n h {d_v}"], Float[Tensor, "n h"], Float[Tensor, "n h"]]:
    """Each of ``n`` queries against its own ``k`` gathered rows, where ``valid``: the
    output (0 for a query with none; V each row's first ``d_v`` dims), ``max_logits``
    and LSE (`score_stats`), in float32 (float64 for float64 inputs)."""
    rows = torch.where(valid[..., None], rows.to(_wide(q.dtype)), 0.0)  # invalid: never read
    scores, peak, lse = score_stats(q, rows, valid, scale)
    out = torch.exp(scores - lse[..., None]) @ rows[..., :d_v]  # +inf lse: weights 0
    return out, peak, lse


@checked
def attend_scored(
    q: Float[Tensor, "n h D"],
    rows: Float[Tensor, "Tk D"],
    idx: Int[Tensor, "n k"],
    valid: Bool[Tensor, "n k"],
    scale: float,
    d_v: int,
) -> tuple[Float[Tensor, "n h {d_v}"], Float[Tensor, "n h"], Float[Tensor, "n h"]]:
    """`attend_rows` on the rows ``idx`` names, without gathering them: every row's score
    once, each entry's score picked from them (``-inf`` where not ``valid``), and each
    entry's weight added back onto the row it names (a row listed twice gets both weights)
    before the weights meet the values. The cheaper way where a query lists most rows: a
    query's gathered rows are ``k * D`` values, its scores against every row ``h * Tk``."""
    wide = _wide(q.dtype)
    n, h, _ = q.shape
    Tk = rows.shape[0]
    at = idx.clamp(0, Tk - 1)[:, None, :].expand(n, h, -1)  # (n, h, k)
    every = scale * (q.to(wide) @ rows.to(wide).T)  # (n, h, Tk)
    scores = every.gather(-1, at).masked_fill(~valid[:, None, :], -math.inf)
    peak, lse = _peak_and_lse(scores)
    weights = torch.exp(scores - lse[..., None])  # 0 where not valid; +inf lse: all 0
    on_rows = torch.zeros_like(every).scatter_add_(-1, at, weights)  # (n, h, Tk)
    named = torch.zeros(Tk, dtype=torch.bool, device=rows.device)
    named[idx[valid]] = True  # a row no entry names is never read
    values = torch.where(named[:, None], rows[:, :d_v].to(wide), 0.0)
    return on_rows @ values, peak, lse


@checked
def sparse_mla_attention(
    q: Float[Tensor, "Tq h D"],
    kv: Float[Tensor, "Tk 1 D"],
    indices: Int[Tensor, "Tq 1 topk"],
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Float[Tensor, " h"] | None = None,
    topk_length: Int[Tensor, " Tq"] | None = None,
) -> tuple[Float[Tensor, "Tq h {d_v}"], Float[Tensor, "Tq h"], Float[Tensor, "Tq h"]]:
    """FlashMLA's sparse prefill (module docstring): ``(out, max_logits, lse)``, the
    output in ``q``'s dtype, ``max_logits`` and the LSE in float32 (float64 for float64
    inputs).

    Raises:
        ValueError: ``d_v`` not in ``1 .. D``, or ``sm_scale`` not finite.
    """
    Tq, h, D = q.shape
    if not isinstance(d_v, int) or not 1 <= d_v <= D:
        raise ValueError(f"d_v must be an int in 1 .. {D} (q's head dim), got {d_v!r}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    idx = indices[:, 0].long()  # (Tq, topk)
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(idx.shape[-1], device=idx.device) < topk_length[:, None].long()
    rows = kv[:, 0]  # (Tk, D)
    wide = _wide(q.dtype)
    out = torch.zeros((Tq, h, d_v), dtype=wide, device=q.device)
    peak = torch.full((Tq, h), -math.inf, dtype=wide, device=q.device)
    lse = torch.full((Tq, h), math.inf, dtype=wide, device=q.device)
    Tk, topk = rows.shape[0], idx.shape[-1]
    # scoring every row costs a query h * (Tk - topk) products of D dims more than scoring
    # its entries, gathering its entries topk rows of D: the cheaper way, same result
    scored = h * max(Tk - topk, 0) <= SCORED_ROWS * topk and topk > 0
    chunk = chunk_queries(h * Tk if scored else topk * D)
    every_row = rows.to(wide) if scored else rows  # widened once, not a chunk at a time
    for s in range(0, Tq if Tk else 0, chunk):  # no rows at all: every query empty
        part = slice(s, s + chunk)
        if scored:
            got = attend_scored(q[part], every_row, idx[part], valid[part], sm_scale, d_v)
        else:
            got = attend_rows(q[part], rows[idx[part].clamp(0, Tk - 1)], valid[part], sm_scale, d_v)
        out[part], peak[part], lse[part] = got
    if attn_sink is not None:  # sigmoid(lse - sink); an empty row's output stays 0
        out = out * torch.sigmoid(lse - attn_sink.to(wide))[..., None].nan_to_num(0.0)
    return out.to(q.dtype), peak, lse


@checked
def sparse_mla_decode(
    q: Float[Tensor, "B Tq h D"],
    k_cache: Float[Tensor, "blocks page 1 D"],
    indices: Int[Tensor, "B Tq topk"],
    head_dim_v: int,
    softmax_scale: float | None = None,
    attn_sink: Float[Tensor, " h"] | None = None,
    topk_length: Int[Tensor, " B"] | None = None,
) -> tuple[Float[Tensor, "B Tq h {head_dim_v}"], Float[Tensor, "B h Tq"]]:
    """FlashMLA's sparse decode over an already dequantized cache (module docstring):
    ``(out, lse)``.

    Raises:
        ValueError: an index past the cache's ``blocks * page`` slots (FlashMLA's decode
            treats only ``-1`` as invalid, and reads any other index).
    """
    B, Tq, h, D = q.shape
    slots = k_cache.shape[0] * k_cache.shape[1]
    if bool((indices >= slots).any()):
        bad = int(indices.max())
        raise ValueError(
            f"indices must be -1 or a slot of the cache (below {slots}: blocks * page), got {bad}"
        )
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    flat = k_cache.reshape(slots, 1, D)
    per_query = None
    if topk_length is not None:  # one count a batch row, for each of its queries
        per_query = topk_length.repeat_interleave(Tq)
    out, _, lse = sparse_mla_attention(
        q.reshape(B * Tq, h, D),
        flat,
        indices.reshape(B * Tq, 1, -1),
        scale,
        head_dim_v,
        attn_sink,
        per_query,
    )
    return out.reshape(B, Tq, h, head_dim_v), lse.reshape(B, Tq, h).transpose(1, 2)


# ------------------------------------------------------------ the FP8 sparse cache


def _tiles(x: Tensor) -> Tensor:
    """``(..., 512)`` as ``(..., 4, 128)``: a row's quantized dims, tile by tile."""
    return x.reshape(*x.shape[:-1], FP8_SPARSE_TILES, FP8_SPARSE_TILE)


@checked
def tile_scales(latent: Float[Tensor, "*rows D"]) -> Float[Tensor, "*rows 4"]:
    """Each row's 4 tile scales, as DeepSeek's quantizer makes them: the tile's amax over
    448 (in float32), raised to a power of two, at least ``1e-4``'s."""
    return _power_of_two_scales(_tiles(latent[..., :NOPE].float()))


@checked_internal
def _power_of_two_scales(tiles: Float[Tensor, "*tiles n"]) -> Float[Tensor, "*tiles"]:
    """Each tile's scale, as DeepSeek's quantizer makes it (either layout): the tile's
    amax over 448, raised to a power of two, at least ``1e-4``'s."""
    return torch.pow(2.0, (tiles.abs().amax(-1) / E4M3_MAX).clamp_min(MIN_SCALE).log2().ceil())


@checked
def pack_fp8_sparse(
    latent: Float[Tensor, "*rows D"], scales: Float[Tensor, "*rows 4"] | None = None
) -> Shaped[Tensor, "*rows 656"]:
    """Latent rows of 576 dims in FlashMLA's FP8 sparse layout: ``(*rows, 656)`` bytes as
    ``torch.float8_e4m3fn`` (FlashMLA's cache dtype). The row is rounded to bfloat16
    first (the cache's dtype before quantization); each tile is divided by its scale
    (`tile_scales`, or ``scales``) in float32 and rounded to e4m3; the scales are
    little-endian float32, the rope dims bfloat16.

    Raises:
        ValueError: rows of another width than 576, or a tile that its scale would
            saturate (``|x| / scale > 448``).
    """
    if latent.shape[-1] != NOPE + ROPE:
        raise ValueError(
            f"latent rows must have {NOPE + ROPE} dims ({NOPE} quantized, {ROPE} rope), "
            f"got {latent.shape[-1]}"
        )
    rows = latent.to(torch.bfloat16)
    scale = tile_scales(rows) if scales is None else scales.float()
    tiles = _tiles(rows[..., :NOPE].float())
    stored = tiles / scale[..., None]
    if bool((stored.abs() > E4M3_MAX).any()):
        raise ValueError(f"a tile scale saturates its tile: |x| / scale above {E4M3_MAX}")
    nope = stored.to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)  # 4 float32 -> 16 bytes
    rope = rows[..., NOPE:].contiguous().view(torch.uint8)  # 64 bf16 -> 128 bytes
    packed = torch.cat([nope, scale_bytes, rope], dim=-1)
    return packed.view(torch.float8_e4m3fn)


@checked
def unpack_fp8_sparse(packed: Shaped[Tensor, "*rows 656"]) -> Float64[Tensor, "*rows 576"]:
    """Rows of FlashMLA's FP8 sparse layout back as 576 dims, exactly, in float64: each
    e4m3 value times its tile's scale, then the rope dims."""
    raw = packed.contiguous().view(torch.uint8)
    nope = raw[..., :NOPE].contiguous().view(torch.float8_e4m3fn).double()
    scales = raw[..., NOPE : NOPE + 4 * FP8_SPARSE_TILES].contiguous().view(torch.float32)
    rope = raw[..., NOPE + 4 * FP8_SPARSE_TILES :].contiguous().view(torch.bfloat16)
    tiles = _tiles(nope) * scales.double()[..., None]
    return torch.cat([tiles.flatten(-2), rope.double()], dim=-1)


# ------------------------------------------------------------ the MODEL1 FP8 cache

#: MODEL1's quantized dims, tile and tiles, a token's value bytes, its bytes on average,
#: and the multiple of bytes its pages start on
MODEL1_NOPE, MODEL1_TILE = 448, 64
MODEL1_TILES = MODEL1_NOPE // MODEL1_TILE  # 7
MODEL1_VALUE_BYTES = MODEL1_NOPE + 2 * ROPE  # 576
MODEL1_BYTES = MODEL1_VALUE_BYTES + MODEL1_TILES + 1  # 584
MODEL1_PAGE_ALIGN = 576


@checked
def pack_fp8_model1(
    latent: Float[Tensor, "blocks page 512"],
) -> Shaped[Tensor, "blocks page 1 584"]:
    """Pages of 512-dim rows in FlashMLA's ``MODEL1_FP8Sparse`` layout (module
    docstring): the ``(blocks, page, 1, 584)`` ``float8_e4m3fn`` view FlashMLA's quantizer
    returns, over a buffer whose pages start a multiple of 576 bytes apart. Rows are
    rounded to bfloat16 first; each tile of 64 is divided by its power-of-two scale (the
    tile's amax over 448, at least 1e-4's: no tile saturates) and rounded to e4m3."""
    blocks, page, _ = latent.shape
    rows = latent.to(torch.bfloat16)
    tiles = rows[..., :MODEL1_NOPE].float().reshape(blocks, page, MODEL1_TILES, MODEL1_TILE)
    scale = _power_of_two_scales(tiles)
    stored = tiles / scale[..., None]
    nope = stored.to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)  # (blocks, page, 448)
    rope = rows[..., MODEL1_NOPE:].contiguous().view(torch.uint8)  # (blocks, page, 128)
    exponent = (scale.log2().round() + 127).to(torch.uint8)  # UE8M0: 2 ** (byte - 127)
    pad = torch.zeros((blocks, page, 1), dtype=torch.uint8)
    size = page * MODEL1_BYTES
    stride = -(-size // MODEL1_PAGE_ALIGN) * MODEL1_PAGE_ALIGN
    buffer = torch.zeros((blocks, stride), dtype=torch.uint8)
    buffer[:, : page * MODEL1_VALUE_BYTES] = torch.cat([nope, rope], -1).reshape(blocks, -1)
    buffer[:, page * MODEL1_VALUE_BYTES : size] = torch.cat([exponent, pad], -1).reshape(blocks, -1)
    return buffer[:, :size].view(torch.float8_e4m3fn).view(blocks, page, 1, MODEL1_BYTES)


def _page_bytes(k_cache: Tensor) -> Tensor:
    """Each page's bytes of a ``(blocks, page, 1, bytes)`` cache view, ``(blocks, page *
    bytes)`` (the view's rows, in order, are its page's bytes)."""
    blocks, page = k_cache.shape[:2]
    return k_cache.view(torch.uint8).reshape(blocks, page * k_cache.shape[-1])


@checked
def unpack_fp8_model1(
    k_cache: Shaped[Tensor, "blocks page 1 584"],
) -> Float64[Tensor, "blocks page 512"]:
    """A ``MODEL1_FP8Sparse`` cache back as 512-dim rows, exactly, in float64: each e4m3
    value times its tile's power of two (a scale byte of 255 is NaN), then the rope dims."""
    blocks, page = k_cache.shape[:2]
    raw = _page_bytes(k_cache)
    values = raw[:, : page * MODEL1_VALUE_BYTES].reshape(blocks, page, MODEL1_VALUE_BYTES)
    nope = values[..., :MODEL1_NOPE].contiguous().view(torch.float8_e4m3fn).double()
    rope = values[..., MODEL1_NOPE:].contiguous().view(torch.bfloat16).double()
    exponent = raw[:, page * MODEL1_VALUE_BYTES :].reshape(blocks, page, 8)[..., :MODEL1_TILES]
    scale = torch.pow(2.0, exponent.double() - 127).masked_fill(exponent == 255, math.nan)
    tiles = nope.reshape(blocks, page, MODEL1_TILES, MODEL1_TILE) * scale[..., None]
    return torch.cat([tiles.flatten(-2), rope], dim=-1)


@checked
def unpack_fp8_cache(
    k_cache: Shaped[Tensor, "blocks page 1 bytes"],
) -> Float64[Tensor, "blocks page 1 D"]:
    """A packed sparse cache ``(blocks, page, 1, bytes)`` as float64 rows ``(blocks, page,
    1, D)``, by its layout: 656 bytes a token (`unpack_fp8_sparse`, 576 dims) or 584
    (`unpack_fp8_model1`, 512 dims).

    Raises:
        ValueError: another width.
    """
    width = k_cache.shape[-1]
    if width == FP8_SPARSE_BYTES:
        return unpack_fp8_sparse(k_cache)
    if width == MODEL1_BYTES:
        return unpack_fp8_model1(k_cache)[:, :, None]
    raise ValueError(
        f"k_cache's last dim must be {FP8_SPARSE_BYTES} (V32_FP8Sparse) or {MODEL1_BYTES} "
        f"(MODEL1_FP8Sparse, a (blocks, page, 1, {MODEL1_BYTES}) view), got {width}"
    )
