"""Multi-head latent attention (MLA), DeepSeek V2/V3's: one latent row cached per token.

Per token ``x`` (width ``H``), with ``h`` heads (docs/mla.md has the equations):

- queries: ``c_q = RMSNorm(x W_DQ)`` (rank ``q_rank``; ``q_rank = 0``: ``x`` itself), then
  ``q = c_q W_UQ`` split per head into ``q_nope`` (``d_nope`` dims) and ``q_pe``
  (``d_rope``), the latter rotated by the token's position;
- keys and values: ``[c_kv, k_pe] = x W_DKV``; ``c_kv = RMSNorm(c_kv)`` (rank
  ``kv_rank``), the **latent**; ``k_pe`` (``d_rope`` dims) is rotated, and shared by every
  head. The row ``[c_kv, k_pe]``, ``kv_rank + d_rope`` numbers a token (576 in DeepSeek
  V3), is all a cache keeps: a `attnref.cache.RepresentationCache` of those rows, the
  layout of FlashMLA's cache;
- per head ``i``: ``k_i = [c_kv W_UK_i, k_pe]``, ``v_i = c_kv W_UV_i``, and
  ``o_i = softmax(scale * q_i k_i^T) v_i``; the output ``[o_1 .. o_h] W_O``.

Two ways to compute the same thing (`MultiHeadLatentAttention.forward`'s ``absorbed``):

- **naive**: up-project every cached latent to per-head keys and values, then attend;
- **absorbed**: fold ``W_UK_i`` into the query (``q_nope W_UK_i^T``, ``kv_rank`` dims) and
  attend over the latent rows themselves, one key/value head for all query heads
  (multi-query attention with ``Dqk = kv_rank + d_rope`` and ``Dv = kv_rank``: the call
  FlashMLA and FlashInfer's MLA kernels make), then fold ``W_UV_i`` into the output.

The scale: ``d_qk ** -0.5`` with ``d_qk = d_nope + d_rope`` (192 in DeepSeek V3), times
``mscale ** 2`` where YaRN stretches the context (``rope_factor > 1``: ``mscale = 0.1 *
mscale_coef * ln(rope_factor) + 1``). Not ``(kv_rank + d_rope) ** -0.5``, the absorbed
call's own head dim, which a kernel takes for its default: a caller passes the scale.
The rotary dims here turn in GPT-J's interleaved pairs, as DeepSeek's inference code
does (``torch.view_as_complex`` over consecutive pairs); YaRN's change of the rotary
frequencies is not modelled (plain RoPE with ``rope_base``), only its softmax scale.
"""

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from attnref import functional as F
from attnref._checking import checked
from attnref.cache import RepresentationCache
from attnref.rotary import RotaryEmbedding

__all__ = ["MultiHeadLatentAttention", "mla_softmax_scale"]


def mla_softmax_scale(qk_head_dim: int, rope_factor: float = 1.0, mscale: float = 1.0) -> float:
    """DeepSeek V3's softmax scale: ``qk_head_dim ** -0.5``, times YaRN's ``m ** 2`` with
    ``m = 0.1 * mscale * ln(rope_factor) + 1`` where the context is stretched
    (``rope_factor > 1``)."""
    if qk_head_dim < 1:
        raise ValueError(f"qk_head_dim must be >= 1, got {qk_head_dim}")
    if not rope_factor >= 1.0:
        raise ValueError(f"rope_factor must be >= 1 (1: no YaRN), got {rope_factor}")
    scale = 1.0 / math.sqrt(qk_head_dim)
    if rope_factor > 1.0:
        m = 0.1 * mscale * math.log(rope_factor) + 1.0
        scale *= m * m
    return scale


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek V3's multi-head latent attention (the module docstring has the maths).

    Args:
        num_hiddens: ``H``, the model width (input and output).
        num_heads: ``h``.
        q_rank: the query's low rank (DeepSeek V3: 1536); 0: a full-rank query projection.
        kv_rank: the latent's width (512).
        nope_head_dim: ``d_nope``, the dims of a query/key head that carry no position (128).
        rope_head_dim: ``d_rope``, the decoupled rotary dims, shared key for every head (64).
        v_head_dim: ``d_v``, a value head's dims (128).
        rope_base: the rotary frequency base.
        rope_factor: YaRN's context stretch (`mla_softmax_scale`); 1: none.
        mscale: YaRN's softmax-scale coefficient (`mla_softmax_scale`).
        eps: the RMS norms' epsilon.
    """

    def __init__(
        self,
        *,
        num_hiddens: int,
        num_heads: int,
        q_rank: int = 0,
        kv_rank: int = 512,
        nope_head_dim: int = 128,
        rope_head_dim: int = 64,
        v_head_dim: int = 128,
        rope_base: float = 10000.0,
        rope_factor: float = 1.0,
        mscale: float = 1.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        for name, value, least in (
            ("num_hiddens", num_hiddens, 1),
            ("num_heads", num_heads, 1),
            ("q_rank", q_rank, 0),
            ("kv_rank", kv_rank, 1),
            ("nope_head_dim", nope_head_dim, 0),
            ("rope_head_dim", rope_head_dim, 0),
            ("v_head_dim", v_head_dim, 1),
        ):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if rope_head_dim % 2:
            raise ValueError(f"rope_head_dim must be even (pairs turn), got {rope_head_dim}")
        if nope_head_dim + rope_head_dim < 1:
            raise ValueError("nope_head_dim + rope_head_dim must be >= 1")
        self.num_hiddens, self.num_heads = num_hiddens, num_heads
        self.q_rank, self.kv_rank = q_rank, kv_rank
        self.nope_head_dim, self.rope_head_dim = nope_head_dim, rope_head_dim
        self.v_head_dim = v_head_dim
        self.qk_head_dim = nope_head_dim + rope_head_dim
        self.rope_factor, self.mscale = rope_factor, mscale
        self.softmax_scale = mla_softmax_scale(self.qk_head_dim, rope_factor, mscale)
        q_out = num_heads * self.qk_head_dim
        if q_rank:
            self.q_down: nn.Module = nn.Linear(num_hiddens, q_rank, bias=False)
            self.q_norm: nn.Module = nn.RMSNorm(q_rank, eps=eps)
            self.q_up = nn.Linear(q_rank, q_out, bias=False)
        else:
            self.q_down, self.q_norm = nn.Identity(), nn.Identity()
            self.q_up = nn.Linear(num_hiddens, q_out, bias=False)
        self.kv_down = nn.Linear(num_hiddens, kv_rank + rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_rank, eps=eps)
        # W_UK and W_UV of every head in one: (h * (d_nope + d_v), kv_rank)
        self.kv_up = nn.Linear(kv_rank, num_heads * (nope_head_dim + v_head_dim), bias=False)
        self.output_proj = nn.Linear(num_heads * v_head_dim, num_hiddens, bias=False)
        self.rotary = RotaryEmbedding(rope_head_dim, rope_base, interleaved=True)

    @checked
    def up_projections(
        self,
    ) -> tuple[
        Float[Tensor, "{self.num_heads} {self.nope_head_dim} {self.kv_rank}"],
        Float[Tensor, "{self.num_heads} {self.v_head_dim} {self.kv_rank}"],
    ]:
        """``W_UK (h, d_nope, kv_rank)`` and ``W_UV (h, d_v, kv_rank)``: per head, the maps
        from a latent row to that head's key (its position-free part) and value."""
        w = self.kv_up.weight.view(self.num_heads, self.nope_head_dim + self.v_head_dim, -1)
        return w[:, : self.nope_head_dim], w[:, self.nope_head_dim :]

    @checked
    def queries(
        self, x: Float[Tensor, "B T {self.num_hiddens}"], start: int = 0
    ) -> tuple[
        Float[Tensor, "B h T {self.nope_head_dim}"], Float[Tensor, "B h T {self.rope_head_dim}"]
    ]:
        """Each head's query for tokens at positions ``start ..``: its position-free part
        ``q_nope`` and its rotated part ``q_pe``."""
        B, T, _ = x.shape
        q = self.q_up(self.q_norm(self.q_down(x))).view(B, T, self.num_heads, self.qk_head_dim)
        q = q.transpose(1, 2)  # (B, h, T, d_qk)
        return q[..., : self.nope_head_dim], self.rotary(q[..., self.nope_head_dim :], start)

    @checked
    def latent_rows(
        self, x: Float[Tensor, "B T {self.num_hiddens}"], start: int = 0
    ) -> tuple[Float[Tensor, "B T {self.kv_rank}"], Float[Tensor, "B T {self.rope_head_dim}"]]:
        """What a cache keeps of tokens at positions ``start ..``: the latent ``c_kv``
        (normed) and the rotated key ``k_pe`` every head shares."""
        kv = self.kv_down(x)  # (B, T, kv_rank + d_rope)
        latent = self.kv_norm(kv[..., : self.kv_rank])
        return latent, self.rotary(kv[..., self.kv_rank :], start)

    @checked
    def forward(
        self,
        x: Float[Tensor, "B T {self.num_hiddens}"],
        *,
        causal: bool = True,
        cache: RepresentationCache | None = None,
        absorbed: bool = False,
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """Self-attention of the tokens ``x``, which sit after the ``cache``'s (if any).

        Args:
            causal: each token sees the tokens up to itself (bottom-right against a cache).
            cache: the latent rows ``[c_kv, k_pe]`` ``(B, t, kv_rank + d_rope)`` of the
                tokens before ``x``; this step's are appended.
            absorbed: attend over the latent rows with the up-projections folded into
                the query and the output (FlashMLA's call) rather than up-projecting
                every cached row (the same result, up to rounding).
        """
        B = x.shape[0]
        start = 0 if cache is None else cache.position
        h, rope = self.num_heads, self.rope_head_dim
        q_nope, q_pe = self.queries(x, start)
        latent, k_pe = self.latent_rows(x, start)
        if cache is not None:  # one row a token: the latent, then the rotary key
            rows = cache.append(torch.cat((latent, k_pe), dim=-1))
            latent, k_pe = rows[..., : self.kv_rank], rows[..., self.kv_rank :]
        w_uk, w_uv = self.up_projections()
        if absorbed:
            q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # (B, h, T, kv_rank)
            query = torch.cat((q_latent, q_pe), dim=-1)
            key = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)  # (B, 1, Tk, kv_rank + r)
            value = latent.unsqueeze(1)  # (B, 1, Tk, kv_rank): V is the cache itself
            out_latent = F.scaled_dot_product_attention(
                query, key, value, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=h > 1, causal_alignment="bottom_right",
            )  # fmt: skip
            out = torch.einsum("bhtc,hvc->bhtv", out_latent, w_uv)
        else:
            Tk = latent.shape[1]
            k_nope = torch.einsum("btc,hnc->bhtn", latent, w_uk)
            key = torch.cat((k_nope, k_pe.unsqueeze(1).expand(B, h, Tk, rope)), dim=-1)
            value = torch.einsum("btc,hvc->bhtv", latent, w_uv)
            query = torch.cat((q_nope, q_pe), dim=-1)
            out = F.scaled_dot_product_attention(
                query, key, value, is_causal=causal, scale=self.softmax_scale,
                causal_alignment="bottom_right",
            )  # fmt: skip
        result: Tensor = self.output_proj(F.merge_heads(out))
        return result
