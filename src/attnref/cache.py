"""Caches for incremental decoding: they change how fast a decoder runs, never what it computes.

- `KVCache`: one self-attention layer's keys and values, preallocated ``(B, g, T_max, Dh)``
  with a position counter: each step projects only the new tokens and appends them.
- `StaticKVCache`: the cross-attention's keys and values, projected from the encoder
  memory once and reused at every step.
- `RepresentationCache`: D2L's alternative: the layer keeps the history of its *input*
  ``(B, t, H)`` and projects all of it again at every step. Slower; the same results.

`DecoderCache` bundles one cache per layer (and the position) for a whole stack.
"""

from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from attnref._checking import checked

__all__ = ["DecoderCache", "KVCache", "RepresentationCache", "StaticKVCache"]


class KVCache:
    """Preallocated keys and values of one self-attention layer.

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
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def reset(self) -> None:
        """Forget every position (the buffers are kept)."""
        self.length = 0

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        """Keep, as row ``i``, what row ``rows[i]`` held (beam search re-ranks its
        hypotheses every step; each new row continues the one it was chosen from)."""
        self.keys = self.keys.index_select(0, rows)
        self.values = self.values.index_select(0, rows)

    @checked
    def append(
        self, keys: Float[Tensor, "B g t Dh"], values: Float[Tensor, "B g t Dh"]
    ) -> tuple[Float[Tensor, "B g T Dh"], Float[Tensor, "B g T Dh"]]:
        """Store ``t`` new positions; return every stored position's keys and values.

        Raises:
            ValueError: a batch size other than the cache's, or more positions than
                ``max_len`` holds.
        """
        B, t = keys.shape[0], keys.shape[2]
        if self.batch_size != B:
            raise ValueError(f"the cache holds a batch of {self.batch_size}, got a batch of {B}")
        if self.length + t > self.max_len:
            raise ValueError(
                f"the cache holds max_len={self.max_len} positions; {self.length} are used "
                f"and {t} more do not fit"
            )
        end = self.length + t
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class StaticKVCache:
    """The cross-attention's keys and values, projected from the memory once."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def reset(self) -> None:
        self.keys = self.values = None


class RepresentationCache:
    """D2L's cache: the history of one layer's input ``(B, t, H)``, grown each step."""

    def __init__(self) -> None:
        self.history: Tensor | None = None

    def reset(self) -> None:
        self.history = None

    @checked
    def append(self, X: Float[Tensor, "B t H"]) -> Float[Tensor, "B T H"]:
        """Add ``X`` to the history and return all of it.

        Raises:
            ValueError: a batch size other than the history's.
        """
        if self.history is not None and self.history.shape[0] != X.shape[0]:
            raise ValueError(
                f"the cache holds a batch of {self.history.shape[0]}, got a batch of {X.shape[0]}"
            )
        self.history = X if self.history is None else torch.cat([self.history, X], dim=1)
        return self.history

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        """Keep, as row ``i``, the history of row ``rows[i]`` (see `KVCache.reorder`)."""
        if self.history is not None:
            self.history = self.history.index_select(0, rows)


SelfCache = KVCache | RepresentationCache


@dataclass
class DecoderCache:
    """One self-attention cache (and, for an encoder-decoder, one cross cache) per layer.

    ``position`` is how many tokens have been decoded: the next token's position.
    """

    self_attention: list[SelfCache]
    cross_attention: list[StaticKVCache] = field(default_factory=list)
    position: int = 0

    @classmethod
    def for_stack(
        cls,
        num_layers: int,
        *,
        mode: str = "kv",
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        cross: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "DecoderCache":
        """Caches for ``num_layers`` layers; ``mode`` is ``"kv"`` or ``"representation"``.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in ("kv", "representation"):
            raise ValueError(f"mode must be 'kv' or 'representation', got {mode!r}")
        selfs: list[SelfCache] = [
            KVCache(
                batch_size=batch_size,
                num_kv_heads=num_kv_heads,
                max_len=max_len,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
            )
            if mode == "kv"
            else RepresentationCache()
            for _ in range(num_layers)
        ]
        crosses = [StaticKVCache() for _ in range(num_layers)] if cross else []
        return cls(selfs, crosses)

    def reset(self) -> None:
        for c in [*self.self_attention, *self.cross_attention]:
            c.reset()
        self.position = 0

    @checked
    def reorder(self, rows: Int[Tensor, " B"]) -> None:
        """Reorder every layer's self-attention cache by ``rows`` (beam search).

        The cross-attention caches are left alone: beam search only ever chooses among
        the hypotheses of one source sentence, whose encoder memory is the same.
        """
        for c in self.self_attention:
            c.reorder(rows)

    def nbytes(self) -> int:
        """Bytes held by the preallocated key/value buffers."""
        return sum(
            c.keys.numel() * c.keys.element_size() * 2
            for c in self.self_attention
            if isinstance(c, KVCache)
        )
