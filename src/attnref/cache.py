"""Caches for incremental decoding: they change how fast a decoder runs, never what it computes.

Every cache answers one protocol, `AttentionCache`: ``update(keys, values, project)``
takes one attention layer's new inputs ``(B, t, H)`` and the layer's projection to
key/value heads, and returns the heads ``(B, g, T, Dh)`` of every position the layer
attends to; ``position`` is how many positions it holds. `MultiHeadAttention` calls
``update`` and never asks which kind it holds (torchtune's ``KVCache.update`` and HF's
``Cache.update`` are the model; ``project`` is what lets D2L's cache of inputs answer
the same call).

- `KVCache`: keys and values, preallocated ``(B, g, T_max, Dh)``: each step projects
  only the new tokens and writes them after the last position.
- `StaticKVCache`: the cross-attention's keys and values, projected from the encoder
  memory on the first call and reused at every step.
- `RollingKVCache`: a sliding-window layer's keys and values: only the last ``window``
  positions are kept (a query sees those and itself, none earlier), so its memory stays
  bounded however long the sequence grows; its position still counts every token.
- `RepresentationCache`: D2L's alternative: the history of the layer's *input*
  ``(B, t, H)``, projected again in full at every step. Slower; the same results. Any
  history of per-token rows fits it: multi-head latent attention keeps its latent rows
  ``[c_kv, k_pe]`` there (`attnref.layers.MultiHeadLatentAttention`).

`DecoderCache` holds one `LayerCache` per layer; its position is its first layer's, so
there is one counter, not one per level.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from attnref._checking import checked

__all__ = [
    "AttentionCache",
    "CacheMode",
    "DecoderCache",
    "KVCache",
    "LayerCache",
    "Project",
    "RepresentationCache",
    "RollingKVCache",
    "StaticKVCache",
]

#: which self-attention cache decoding uses: keys and values, or D2L's input history
CacheMode = Literal["kv", "representation"]

#: a layer's projection of its inputs ``(B, t, H)`` to key and value heads ``(B, g, t, Dh)``
Project = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]

Heads = tuple[Float[Tensor, "B g T Dh"], Float[Tensor, "B g T Dv"]]


@runtime_checkable
class AttentionCache(Protocol):
    """What every cache does; an attention layer needs nothing else."""

    @property
    def position(self) -> int:
        """How many positions the cache holds: the next new token's position."""
        ...

    def update(self, keys: Tensor, values: Tensor, project: Project) -> Heads:
        """Take the layer's new inputs; return the heads of every position it attends to."""
        ...

    def reorder(self, rows: Tensor) -> None:
        """Keep, as row ``i``, what row ``rows[i]`` held (beam search re-ranks its
        hypotheses every step; each new row continues the one it was chosen from)."""
        ...

    def reset(self) -> None:
        """Forget every position."""
        ...

    def nbytes(self) -> int:
        """Bytes the cache holds."""
        ...


def _check_batch(held: int, got: int) -> None:
    if held != got:
        raise ValueError(f"the cache holds a batch of {held}, got a batch of {got}")


class KVCache:
    """Preallocated keys and values of one self-attention layer, and a position counter.

    Args:
        batch_size: ``B``.
        num_kv_heads: ``g``.
        max_len: ``T_max``, the most positions it can hold.
        head_dim: ``Dh``.
        dtype: of the buffers.
        device: of the buffers.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_len", max_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._position = 0

    @property
    def position(self) -> int:
        return self._position

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def update(self, keys: Tensor, values: Tensor, project: Project) -> Heads:
        """Project the new inputs only and append them (`append`)."""
        return self.append(*project(keys, values))

    @checked
    def append(
        self, keys: Float[Tensor, "B g t Dh"], values: Float[Tensor, "B g t Dh"]
    ) -> tuple[Float[Tensor, "B g T Dh"], Float[Tensor, "B g T Dh"]]:
        """Store ``t`` new positions' heads; return every stored position's.

        Raises:
            ValueError: a batch size other than the cache's, or more positions than
                ``max_len`` holds.
        """
        t = keys.shape[2]
        _check_batch(self.batch_size, keys.shape[0])
        if self._position + t > self.max_len:
            raise ValueError(
                f"the cache holds max_len={self.max_len} positions; {self._position} are used "
                f"and {t} more do not fit"
            )
        end = self._position + t
        self.keys[:, :, self._position : end] = keys
        self.values[:, :, self._position : end] = values
        self._position = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        self.keys = self.keys.index_select(0, rows)
        self.values = self.values.index_select(0, rows)

    def reset(self) -> None:
        """Forget every position (the buffers are kept)."""
        self._position = 0

    def nbytes(self) -> int:
        """Bytes of the two preallocated buffers."""
        return 2 * self.keys.numel() * self.keys.element_size()


class RollingKVCache:
    """The keys and values a sliding-window layer can still see: the last ``window``
    positions (with a window of ``w`` a query at ``p`` sees ``p - w .. p``).

    ``update`` returns the kept positions followed by the new ones; the attention places
    them bottom-right, so the window hides exactly the positions this cache dropped.

    Args:
        window: ``w``, the keys before a query it may see (>= 0).
        batch_size: ``B``.
        num_kv_heads: ``g``.
        head_dim: ``Dh``.
        dtype: of the buffers.
        device: of the buffers.
    """

    def __init__(
        self,
        *,
        window: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        if batch_size < 1 or num_kv_heads < 1:
            raise ValueError(
                f"batch_size and num_kv_heads must be >= 1, got {batch_size}, {num_kv_heads}"
            )
        self.window = window
        shape = (batch_size, num_kv_heads, 0, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._position = 0

    @property
    def position(self) -> int:
        return self._position

    def update(self, keys: Tensor, values: Tensor, project: Project) -> Heads:
        """Project the new inputs only, append them, keep the last ``window``."""
        return self.append(*project(keys, values))

    @checked
    def append(
        self, keys: Float[Tensor, "B g t Dh"], values: Float[Tensor, "B g t Dv"]
    ) -> tuple[Float[Tensor, "B g T Dh"], Float[Tensor, "B g T Dv"]]:
        """The kept positions' heads and the ``t`` new ones; then only the last
        ``window`` of them are kept.

        Raises:
            ValueError: a batch size other than the cache's.
        """
        _check_batch(self.keys.shape[0], keys.shape[0])
        all_keys = torch.cat([self.keys, keys], dim=2)
        all_values = torch.cat([self.values, values], dim=2)
        keep = max(all_keys.shape[2] - self.window, 0)
        self.keys, self.values = all_keys[:, :, keep:], all_values[:, :, keep:]
        self._position += keys.shape[2]
        return all_keys, all_values

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        self.keys = self.keys.index_select(0, rows)
        self.values = self.values.index_select(0, rows)

    def reset(self) -> None:
        self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
        self._position = 0

    def nbytes(self) -> int:
        """Bytes of the kept positions (at most ``window`` of them)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


class StaticKVCache:
    """The cross-attention's keys and values, projected from the memory once."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    @property
    def position(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, keys: Tensor, values: Tensor, project: Project) -> Heads:
        """Project the memory on the first call; return the same heads at every call."""
        if self.keys is None or self.values is None:
            self.keys, self.values = project(keys, values)
        return self.keys, self.values

    def reorder(self, rows: Tensor) -> None:
        """Nothing to move: beam search only ever chooses among the hypotheses of one
        source sentence, whose encoder memory is the same."""

    def reset(self) -> None:
        self.keys = self.values = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class RepresentationCache:
    """D2L's cache: the history of one self-attention layer's input ``(B, t, H)``."""

    def __init__(self) -> None:
        self.history: Tensor | None = None

    @property
    def position(self) -> int:
        return 0 if self.history is None else self.history.shape[1]

    def update(self, keys: Tensor, values: Tensor, project: Project) -> Heads:
        """Add the new inputs to the history and project all of it (self-attention:
        ``keys`` and ``values`` are the same input)."""
        history = self.append(keys)
        return project(history, history)

    @checked
    def append(self, X: Float[Tensor, "B t H"]) -> Float[Tensor, "B T H"]:
        """Add ``X`` to the history and return all of it.

        Raises:
            ValueError: a batch size other than the history's.
        """
        if self.history is not None:
            _check_batch(self.history.shape[0], X.shape[0])
        self.history = X if self.history is None else torch.cat([self.history, X], dim=1)
        return self.history

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        if self.history is not None:
            self.history = self.history.index_select(0, rows)

    def reset(self) -> None:
        self.history = None

    def nbytes(self) -> int:
        return 0 if self.history is None else self.history.numel() * self.history.element_size()


@dataclass
class LayerCache:
    """One layer's caches: its self-attention's, and its cross-attention's (decoders of
    an encoder-decoder only)."""

    self_attention: AttentionCache
    cross_attention: AttentionCache | None = None

    def caches(self) -> list[AttentionCache]:
        return [c for c in (self.self_attention, self.cross_attention) if c is not None]


@dataclass
class DecoderCache:
    """One `LayerCache` per layer of a stack."""

    layers: list[LayerCache]

    @property
    def position(self) -> int:
        """How many tokens have been decoded: the next token's position."""
        return self.layers[0].self_attention.position

    @classmethod
    def for_stack(
        cls,
        num_layers: int,
        *,
        mode: CacheMode = "kv",
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        cross: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> "DecoderCache":
        """Caches for ``num_layers`` layers; ``mode`` is ``"kv"`` or ``"representation"``;
        ``window``: the layers' sliding window (then ``"kv"`` keeps only what it sees,
        `RollingKVCache`).

        Raises:
            ValueError: an unknown mode, or fewer than one layer.
        """
        if mode not in ("kv", "representation"):
            raise ValueError(f"mode must be 'kv' or 'representation', got {mode!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")

        def self_cache() -> AttentionCache:
            if mode == "representation":
                return RepresentationCache()
            if window is not None:
                return RollingKVCache(
                    window=window,
                    batch_size=batch_size,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    dtype=dtype,
                    device=device,
                )
            return KVCache(
                batch_size=batch_size,
                num_kv_heads=num_kv_heads,
                max_len=max_len,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
            )

        return cls(
            [
                LayerCache(self_cache(), StaticKVCache() if cross else None)
                for _ in range(num_layers)
            ]
        )

    def _caches(self) -> list[AttentionCache]:
        return [c for layer in self.layers for c in layer.caches()]

    def reset(self) -> None:
        for c in self._caches():
            c.reset()

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        """Reorder every layer's caches by ``rows`` (beam search)."""
        for c in self._caches():
            c.reorder(rows)

    def nbytes(self) -> int:
        """Bytes held by every layer's caches."""
        return sum(c.nbytes() for c in self._caches())
