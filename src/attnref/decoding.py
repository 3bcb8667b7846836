"""Decoding for the encoder-decoder Transformer and the decoder-only LM (greedy, beam
search, sampling, each with or without the KV cache), and greedy decoding for D2L's
Bahdanau model.

With ``use_cache=True`` each step feeds only the newest token and reuses every earlier
position's keys and values (`attnref.cache`; beam search reorders them with its beams);
without it each step runs the whole prefix again. The tokens are the same either way:
the cache changes speed, not results.
"""

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from attnref._checking import checked, checked_internal
from attnref.cache import CacheMode, DecoderCache
from attnref.layers.seq2seq import Seq2Seq
from attnref.layers.transformer import DecoderOnlyLM, EncoderDecoder
from attnref.masks import subsequent_mask

__all__ = [
    "beam_search",
    "beam_search_lm",
    "generate",
    "greedy_decode",
    "greedy_decode_seq2seq",
    "sample",
    "sample_lm",
]


Fn = TypeVar("Fn", bound=Callable[..., Any])


def _plain(out: Any) -> Any:
    """Ordinary tensors from inference tensors (which autograd refuses to save)."""
    if isinstance(out, Tensor):
        return out.clone()  # outside inference_mode: an ordinary tensor
    if isinstance(out, tuple):
        return tuple(_plain(x) for x in out)
    return out


def _inference(fn: Fn) -> Fn:
    """Run ``fn`` under ``torch.inference_mode``: no autograd bookkeeping at all, about
    10% less time per cached decoding step than ``no_grad`` on the CPU. The result is
    cloned out of inference mode, so the tokens can feed a later training step."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return _plain(out)

    return cast(Fn, wrapper)


def _check_max_len(max_len: int) -> None:
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")


@checked
@_inference
def greedy_decode(
    model: EncoderDecoder,
    src: Int[Tensor, "B Ts"],
    src_mask: Bool[Tensor, "#B 1 Ts"] | None,
    max_len: int,
    start_symbol: int,
    *,
    use_cache: bool = True,
    cache_mode: CacheMode = "kv",
) -> Int[Tensor, "B {max_len}"]:
    """The Annotated Transformer's greedy decoding: ``max_len`` tokens, the first being
    ``start_symbol``, each next one the most probable given the source and the prefix.

    ``cache_mode``: ``"kv"`` (keys and values) or ``"representation"`` (D2L's history of
    each layer's input).

    Raises:
        ValueError: ``max_len < 1``.
    """
    _check_max_len(max_len)
    step = _encdec_step(model, src, src_mask, 1, max_len - 1, use_cache, cache_mode)
    return _decode(step, _start(src, start_symbol), max_len - 1, _greedy)


@checked
@_inference
def generate(
    model: DecoderOnlyLM,
    prompt: Int[Tensor, "B P"],
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    cache_mode: CacheMode = "kv",
) -> Int[Tensor, "B T"]:
    """Greedy continuation of ``prompt`` by ``max_new_tokens`` tokens: ``(B, P + N)``.

    With the cache the prompt is fed once (prefill), then one token per step.

    Raises:
        ValueError: ``max_new_tokens < 1``.
    """
    _check_max_len(max_new_tokens)
    step = _lm_step(model, max_new_tokens, use_cache, cache_mode)
    return _decode(step, prompt, max_new_tokens, _greedy)


@checked
@_inference
def greedy_decode_seq2seq(
    model: Seq2Seq,
    src: Int[Tensor, "B Ts"],
    valid_lens: Int[Tensor, " B"] | None,
    max_len: int,
    start_symbol: int,
) -> tuple[Int[Tensor, "B {max_len}"], Float[Tensor, "B {max_len}-1 Ts"]]:
    """Greedy decoding for the Bahdanau model: ``max_len`` tokens starting with
    ``start_symbol``, and the attention weights of each step (the alignment: row ``t``
    is where the decoder looked to choose token ``t + 1``).

    The decoder's state is its cache: each step feeds only the newest token.

    Raises:
        ValueError: ``max_len < 1``.
    """
    _check_max_len(max_len)
    state = model.encode(src, valid_lens)
    weights: list[Tensor] = []

    def step(ys: Tensor, rows: Tensor | None) -> Tensor:
        nonlocal state
        logits, state = model.decoder(ys[:, -1:], state)
        weights.append(model.decoder.attention_weights)  # (B, 1, Ts)
        out: Tensor = logits[:, 0]  # (B, V): the argmax of logits is that of log probs
        return out

    ys = _decode(step, _start(src, start_symbol), max_len - 1, _greedy)
    empty = torch.zeros(src.shape[0], 0, src.shape[1], device=src.device)
    return ys, torch.cat(weights, dim=1) if weights else empty


# ------------------------------------------------------------------ the decode loop

# (tokens so far (N, t), which earlier row each row continues or None for the same rows)
#   -> log probabilities of the next token (N, V)
Step = Callable[[Tensor, Tensor | None], Tensor]
# log probabilities of the next token (N, V)
#   -> (the rows continued or None for the same rows, their tokens (N, 1), all ended?)
Choose = Callable[[Tensor], tuple[Tensor | None, Tensor, bool]]


@checked_internal
def _decode(
    step: Step, prefix: Int[Tensor, "N P"], steps: int, choose: Choose
) -> Int[Tensor, "N T"]:
    """The one decode loop: ``steps`` times, ask ``step`` for the next token's log
    probabilities, let ``choose`` pick the rows to continue and their tokens, append.

    Greedy decoding and sampling continue every row; beam search re-ranks its rows,
    and ``step`` reorders the cache with them, and stops the loop once every
    hypothesis has ended (the result is then shorter than ``P + steps``).
    """
    ys = prefix
    rows: Tensor | None = None
    for _ in range(steps):
        rows, token, ended = choose(step(ys, rows))
        ys = torch.cat([ys if rows is None else ys[rows], token.to(ys.dtype)], dim=1)
        if ended:
            break
    return ys


@checked_internal
def _greedy(log_probs: Float[Tensor, "N V"]) -> tuple[None, Int[Tensor, "N 1"], bool]:
    return None, log_probs.argmax(dim=-1, keepdim=True), False


@checked_internal
def _start(src: Int[Tensor, "B Ts"], start_symbol: int) -> Int[Tensor, "B 1"]:
    return torch.full((src.shape[0], 1), start_symbol, dtype=src.dtype, device=src.device)


def _cached(
    forward: Callable[[Tensor, DecoderCache | None], Tensor],
    new_cache: Callable[[int, int, CacheMode], DecoderCache],
    extra: int,
    use_cache: bool,
    mode: CacheMode = "kv",
) -> Step:
    """A `Step` from ``forward(tokens, cache)`` (next-token log probabilities ``(N, V)``).

    Without the cache each step feeds every token so far. With it, the first step feeds
    the prefix and creates a cache for it and ``extra`` more tokens; later steps reorder
    the cache by ``rows`` (beam search) and feed only the tokens it has not seen.
    """
    cache: DecoderCache | None = None

    def step(ys: Tensor, rows: Tensor | None) -> Tensor:
        nonlocal cache
        if not use_cache:
            return forward(ys, None)
        if cache is None:
            cache = new_cache(ys.shape[0], ys.shape[1] + extra, mode)
        elif rows is not None:
            cache.reorder(rows)
        return forward(ys[:, cache.position :], cache)

    return step


@checked_internal
def _encdec_step(
    model: EncoderDecoder,
    src: Int[Tensor, "B Ts"],
    src_mask: Bool[Tensor, "#B 1 Ts"] | None,
    k: int,
    steps: int,
    use_cache: bool,
    mode: CacheMode = "kv",
) -> Step:
    """Next-token log probabilities for ``k`` hypotheses per source sentence."""
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)
    mask = None if src_mask is None else src_mask.repeat_interleave(k, dim=0)

    def forward(ys: Tensor, cache: DecoderCache | None) -> Tensor:
        tgt_mask = None if cache is not None else subsequent_mask(ys.shape[1], device=ys.device)
        hidden = model.decode(memory, mask, ys, tgt_mask, cache=cache)
        out: Tensor = model.generator(hidden[:, -1:])[:, 0]  # (N, V)
        return out

    def new_cache(n: int, max_len: int, mode: CacheMode) -> DecoderCache:
        return model.new_cache(n, max_len, mode=mode)

    return _cached(forward, new_cache, steps, use_cache, mode)


def _lm_step(model: DecoderOnlyLM, steps: int, use_cache: bool, mode: CacheMode = "kv") -> Step:
    def forward(ys: Tensor, cache: DecoderCache | None) -> Tensor:
        out: Tensor = model(ys, cache=cache)[:, -1]  # (N, V)
        return out

    def new_cache(n: int, max_len: int, mode: CacheMode) -> DecoderCache:
        return model.new_cache(n, max_len, mode=mode)

    return _cached(forward, new_cache, steps, use_cache, mode)


# ------------------------------------------------------------------ beam search, sampling


def _check_beam(beam_size: int, length_penalty: float) -> None:
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if length_penalty < 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")


@checked_internal
def _beam(
    step: Step, prefix: Int[Tensor, "B P"], steps: int, k: int, eos: int | None, alpha: float
) -> Int[Tensor, "B T"]:
    """Batched beam search: ``prefix`` ``(B, P)`` grown by ``steps`` tokens, best beam kept.

    Hypotheses are ranked by their summed log probability while they grow; finished ones
    (ending in ``eos``) only extend with ``eos`` at no cost. The final choice divides
    each score by the GNMT length penalty ``((5 + length) / 6) ** alpha``.
    """
    B, P = prefix.shape
    device = prefix.device
    scores = torch.full((B, k), -math.inf, dtype=torch.float64, device=device)
    scores[:, 0] = 0.0  # one live hypothesis to start with, not k copies of it
    lengths = torch.zeros(B, k, dtype=torch.long, device=device)
    done = torch.zeros(B, k, dtype=torch.bool, device=device)

    def choose(log_probs: Tensor) -> tuple[Tensor, Tensor, bool]:
        nonlocal scores, lengths, done
        V = log_probs.shape[-1]
        log_probs = log_probs.to(torch.float64).view(B, k, V)
        if eos is not None:
            frozen = torch.full((V,), -math.inf, dtype=torch.float64, device=device)
            frozen[eos] = 0.0
            log_probs = torch.where(done.unsqueeze(-1), frozen, log_probs)
        total = (scores.unsqueeze(-1) + log_probs).view(B, k * V)
        scores, flat = total.topk(k, dim=-1)  # (B, k)
        beam, token = flat // V, flat % V
        lengths = lengths.gather(1, beam) + (~done.gather(1, beam)).long()
        done = done.gather(1, beam)
        if eos is not None:
            done = done | (token == eos)
        rows = (torch.arange(B, device=device).unsqueeze(-1) * k + beam).view(-1)
        return rows, token.view(-1, 1), eos is not None and bool(done.all())

    ys = _decode(step, prefix.repeat_interleave(k, dim=0), steps, choose)  # (B*k, <= P+steps)
    if ys.shape[1] < P + steps:  # every beam ended: pad the rest with eos
        assert eos is not None
        pad = torch.full((B * k, P + steps - ys.shape[1]), eos, dtype=ys.dtype, device=device)
        ys = torch.cat([ys, pad], dim=1)
    penalty = ((5.0 + lengths.to(torch.float64)) / 6.0) ** alpha
    best = (scores / penalty).argmax(dim=-1)  # (B,)
    return ys.view(B, k, -1)[torch.arange(B, device=device), best]


@checked_internal
def _filter(
    logits: Float[Tensor, "N V"], top_k: int | None, top_p: float | None
) -> Float[Tensor, "N V"]:
    """Logits outside the top ``k`` or the nucleus of mass ``p`` set to ``-inf``."""
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each
        drop_sorted = before >= top_p  # the most probable token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def _sampler(
    temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> Choose:
    def choose(log_probs: Tensor) -> tuple[None, Tensor, bool]:
        logits = _filter(log_probs / temperature, top_k, top_p)
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        return None, torch.multinomial(probs, 1, generator=generator), False  # (N, 1)

    return choose


@checked
@_inference
def beam_search(
    model: EncoderDecoder,
    src: Int[Tensor, "B Ts"],
    src_mask: Bool[Tensor, "#B 1 Ts"] | None,
    max_len: int,
    start_symbol: int,
    *,
    beam_size: int = 4,
    eos: int | None = None,
    length_penalty: float = 0.0,
    use_cache: bool = True,
) -> Int[Tensor, "B {max_len}"]:
    """Beam search for the encoder-decoder, batched over sentences: ``max_len`` tokens
    starting with ``start_symbol``; after ``eos`` a hypothesis is padded with ``eos``.

    ``beam_size=1`` is greedy decoding. ``length_penalty`` is GNMT's ``alpha`` (0: none).
    ``use_cache``: keep each hypothesis's keys and values, reordered with the beams at
    every step (`attnref.cache.DecoderCache.reorder`); the tokens are the same without.

    Raises:
        ValueError: ``max_len < 1``, ``beam_size < 1`` or a negative ``length_penalty``.
    """
    _check_max_len(max_len)
    _check_beam(beam_size, length_penalty)
    step = _encdec_step(model, src, src_mask, beam_size, max_len - 1, use_cache)
    return _beam(step, _start(src, start_symbol), max_len - 1, beam_size, eos, length_penalty)


@checked
@_inference
def sample(
    model: EncoderDecoder,
    src: Int[Tensor, "B Ts"],
    src_mask: Bool[Tensor, "#B 1 Ts"] | None,
    max_len: int,
    start_symbol: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Int[Tensor, "B {max_len}"]:
    """Ancestral sampling for the encoder-decoder, with temperature, top-k and top-p
    (nucleus) filtering, from ``generator`` (so a run can be replayed).

    ``top_k=1`` is greedy decoding. ``use_cache``: feed one token per step against the
    KV cache; the same draws without it.

    Raises:
        ValueError: ``max_len < 1``, ``temperature <= 0``, ``top_k < 1`` or ``top_p``
            outside ``(0, 1]``.
    """
    _check_max_len(max_len)
    _check_sampling(temperature, top_k, top_p)
    step = _encdec_step(model, src, src_mask, 1, max_len - 1, use_cache)
    choose = _sampler(temperature, top_k, top_p, generator)
    return _decode(step, _start(src, start_symbol), max_len - 1, choose)


@checked
@_inference
def beam_search_lm(
    model: DecoderOnlyLM,
    prompt: Int[Tensor, "B P"],
    max_new_tokens: int,
    *,
    beam_size: int = 4,
    eos: int | None = None,
    length_penalty: float = 0.0,
    use_cache: bool = True,
) -> Int[Tensor, "B T"]:
    """`beam_search` for the decoder-only model: ``prompt`` grown by ``max_new_tokens``."""
    _check_max_len(max_new_tokens)
    _check_beam(beam_size, length_penalty)
    step = _lm_step(model, max_new_tokens, use_cache)
    return _beam(step, prompt, max_new_tokens, beam_size, eos, length_penalty)


@checked
@_inference
def sample_lm(
    model: DecoderOnlyLM,
    prompt: Int[Tensor, "B P"],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Int[Tensor, "B T"]:
    """`sample` for the decoder-only model: ``prompt`` grown by ``max_new_tokens``."""
    _check_max_len(max_new_tokens)
    _check_sampling(temperature, top_k, top_p)
    step = _lm_step(model, max_new_tokens, use_cache)
    return _decode(step, prompt, max_new_tokens, _sampler(temperature, top_k, top_p, generator))
