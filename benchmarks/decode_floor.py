"""A lower bound on the cached decoding step: the same weights and tensor operations as
`DecoderOnlyLM` with the KV cache, as bare ``torch.nn.functional`` calls.

Not part of attnref and not a second implementation to use: it exists so the benchmark
can say how much of a cached step is the arithmetic every implementation must do and how
much is the reference's structure (modules, residual wrappers, input checks, the
readable SDPA). It covers the configuration the benchmark builds (pre-LN, ``g = h``,
sinusoidal positions, eval mode) and refuses any other; `floor_generate` is checked
token-for-token against `attnref.decoding.generate` before it is timed.
"""

import math

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from attnref._checking import checked
from attnref.layers.transformer import DecoderOnlyLM, EncoderBlock, PreNormResidual

__all__ = ["floor_generate"]


def _weights(lm: DecoderOnlyLM) -> list[tuple[Tensor, ...]]:
    blocks: list[tuple[Tensor, ...]] = []
    for block in lm.stack.blocks:
        assert isinstance(block, EncoderBlock)
        if block.residuals.norm != "pre":
            raise ValueError("the floor covers pre-LN models only")
        attn, (res1, res2) = block.attention, block.residuals.layers
        assert isinstance(res1, PreNormResidual)
        assert isinstance(res2, PreNormResidual)
        biased = any(name == "bias" for name, _ in attn.query_proj.named_parameters())
        if attn.num_kv_heads != attn.num_heads or biased:
            raise ValueError("the floor covers g = h heads without projection biases only")
        blocks.append(
            (
                res1.ln.weight,
                res1.ln.bias,
                attn.query_proj.weight,
                attn.key_proj.weight,
                attn.value_proj.weight,
                attn.output_proj.weight,
                res2.ln.weight,
                res2.ln.bias,
                block.ffn.dense1.weight,
                block.ffn.dense1.bias,
                block.ffn.dense2.weight,
                block.ffn.dense2.bias,
            )
        )
    return blocks


@checked
@torch.inference_mode()
def floor_generate(
    lm: DecoderOnlyLM, prompt: Int[Tensor, "B P"], max_new_tokens: int
) -> Int[Tensor, "B T"]:
    """Greedy continuation of ``prompt`` ``(B, P)`` by ``max_new_tokens``, one position
    per step against a preallocated cache (the prompt is fed a token at a time too)."""
    if lm.training:
        raise ValueError("the floor covers eval mode only (no dropout)")
    blocks = _weights(lm)
    first = lm.stack.blocks[0]
    assert isinstance(first, EncoderBlock)
    h, Dh = first.attention.num_heads, first.attention.head_dim
    H, (B, P) = h * Dh, prompt.shape
    T = P + max_new_tokens
    table = lm.stack.embed.embedding.weight
    positions = lm.stack.embed.positions.P[0]  # (max_len, H)
    final_norm, proj = lm.stack.final_norm, lm.generator.proj
    assert isinstance(final_norm, torch.nn.LayerNorm)
    keys = prompt.new_zeros((len(blocks), B, h, T, Dh), dtype=table.dtype)
    values = torch.zeros_like(keys)
    out = [prompt]
    token = prompt[:, 0]
    for t in range(T - 1):
        x = (table[token] * math.sqrt(H) + positions[t]).unsqueeze(1)  # (B, 1, H)
        for i, (l1w, l1b, wq, wk, wv, wo, l2w, l2b, w1, b1, w2, b2) in enumerate(blocks):
            y = F.layer_norm(x, (H,), l1w, l1b)
            q = F.linear(y, wq).view(B, h, 1, Dh)  # one position: (B, 1, h, Dh) = (B, h, 1, Dh)
            keys[i, :, :, t] = F.linear(y, wk).view(B, h, Dh)
            values[i, :, :, t] = F.linear(y, wv).view(B, h, Dh)
            k, v = keys[i, :, :, : t + 1], values[i, :, :, : t + 1]
            w = torch.softmax((q / math.sqrt(Dh)) @ k.transpose(-2, -1), dim=-1)
            x = x + F.linear((w @ v).view(B, 1, H), wo)
            x = x + F.linear(F.relu(F.linear(F.layer_norm(x, (H,), l2w, l2b), w1, b1)), w2, b2)
        if t + 1 < P:
            token = prompt[:, t + 1]
            continue
        x = F.layer_norm(x, (H,), final_norm.weight, final_norm.bias)
        logits = F.linear(x, proj.weight, proj.bias)
        token = torch.log_softmax(logits, dim=-1)[:, -1].argmax(dim=-1)
        out.append(token.unsqueeze(1))
    return torch.cat(out, dim=1).clone()
