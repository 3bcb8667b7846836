"""Greedy decoding for the encoder-decoder Transformer and the decoder-only LM.

With ``use_cache=True`` each step feeds only the newest token and reuses every earlier
position's keys and values (`attnref.cache`); without it each step runs the whole
prefix again. The tokens are the same either way: the cache changes speed, not results.
"""

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from attnref._checking import checked
from attnref.layers.transformer import DecoderOnlyLM, EncoderDecoder
from attnref.masks import subsequent_mask

__all__ = ["generate", "greedy_decode"]


def _check_max_len(max_len: int) -> None:
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")


@checked
@torch.no_grad()
def greedy_decode(
    model: EncoderDecoder,
    src: Int[Tensor, "B Ts"],
    src_mask: Bool[Tensor, "#B 1 Ts"] | None,
    max_len: int,
    start_symbol: int,
    *,
    use_cache: bool = True,
    cache_mode: str = "kv",
) -> Int[Tensor, "B {max_len}"]:
    """The Annotated Transformer's greedy decoding: ``max_len`` tokens, the first being
    ``start_symbol``, each next one the most probable given the source and the prefix.

    ``cache_mode``: ``"kv"`` (keys and values) or ``"representation"`` (D2L's history of
    each layer's input).

    Raises:
        ValueError: ``max_len < 1``.
    """
    _check_max_len(max_len)
    memory = model.encode(src, src_mask)
    B = src.shape[0]
    ys = torch.full((B, 1), start_symbol, dtype=src.dtype, device=src.device)
    cache = model.new_cache(B, max_len, mode=cache_mode) if use_cache else None
    for _ in range(max_len - 1):
        if cache is not None:
            hidden = model.decode(memory, src_mask, ys[:, -1:], None, cache=cache)
        else:
            tgt_mask = subsequent_mask(ys.shape[1], device=src.device)
            hidden = model.decode(memory, src_mask, ys, tgt_mask)
        next_token = model.generator(hidden[:, -1:]).argmax(dim=-1)  # (B, 1)
        ys = torch.cat([ys, next_token.to(ys.dtype)], dim=1)
    return ys


@checked
@torch.no_grad()
def generate(
    model: DecoderOnlyLM,
    prompt: Int[Tensor, "B P"],
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    cache_mode: str = "kv",
) -> Int[Tensor, "B T"]:
    """Greedy continuation of ``prompt`` by ``max_new_tokens`` tokens: ``(B, P + N)``.

    With the cache the prompt is fed once (prefill), then one token per step.

    Raises:
        ValueError: ``max_new_tokens < 1``.
    """
    _check_max_len(max_new_tokens)
    B, P = prompt.shape
    cache = model.new_cache(B, P + max_new_tokens, mode=cache_mode) if use_cache else None
    ys = prompt
    feed = prompt
    for _ in range(max_new_tokens):
        log_probs = model(feed, cache=cache) if cache is not None else model(ys)
        next_token = log_probs[:, -1:].argmax(dim=-1).to(ys.dtype)  # (B, 1)
        ys = torch.cat([ys, next_token], dim=1)
        feed = next_token
    return ys
