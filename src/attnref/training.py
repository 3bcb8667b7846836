"""Training the encoder-decoder Transformer, as the Annotated Transformer does it.

- `Batch`: source mask, the target shifted into decoder input ``tgt`` and labels
  ``tgt_y``, the decoder mask (`attnref.masks.make_std_mask`) and ``ntokens``.
- `LabelSmoothing`: KL divergence to a smoothed target distribution: ``1 - smoothing`` on
  the true token, ``smoothing / (V - 2)`` on every other token except padding, and the
  padding column and padding rows zeroed.
- `LossCompute`: the generator, the criterion, and the sum normalised by tokens.
- `rate` / `noam_scheduler` / `make_optimizer`: the Noam schedule and Adam with betas
  (0.9, 0.98) and eps 1e-9.
- `run_epoch`: one pass with gradient accumulation, a `TrainState` and a progress bar.

The two demo tasks that use them (``attnref demo copy|reverse``) are `attnref.tasks`.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from tqdm import tqdm

from attnref._checking import checked
from attnref.layers.transformer import EncoderDecoder, Generator
from attnref.masks import make_std_mask, padding_mask

__all__ = [
    "Batch",
    "LabelSmoothing",
    "LossCompute",
    "TrainState",
    "make_optimizer",
    "noam_scheduler",
    "rate",
    "run_epoch",
]


class Batch:
    """One batch of source and target token ids, with their masks (padding id ``pad``).

    ``tgt`` is the decoder input (the target without its last token), ``tgt_y`` the labels
    (without its first): the decoder learns to predict ``tgt_y[:, t]`` from
    ``tgt[:, :t + 1]``.

    Raises:
        ValueError: a target shorter than two tokens, or (with runtime checking off) a
            batch size that differs between source and target; with checking on that is
            the checker's ``TypeError`` naming ``tgt`` and ``B``.
    """

    @checked
    def __init__(
        self, src: Int[Tensor, "B Ts"], tgt: Int[Tensor, "B T"] | None = None, pad: int = 0
    ) -> None:
        self.src = src
        self.src_mask: Tensor = padding_mask(src, pad)  # (B, 1, Ts)
        self.pad = pad
        if tgt is None:
            return
        if tgt.dim() != 2 or tgt.shape[1] < 2:
            raise ValueError(f"tgt must be (B, T) with T >= 2, got shape {tuple(tgt.shape)}")
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(
                f"src and tgt must have the same batch size, got {src.shape[0]} and {tgt.shape[0]}"
            )
        self.tgt: Tensor = tgt[:, :-1]
        self.tgt_y: Tensor = tgt[:, 1:]
        self.tgt_mask: Tensor = make_std_mask(self.tgt, pad)  # (B, T, T)
        self.ntokens = int((self.tgt_y != pad).sum())


class LabelSmoothing(nn.Module):
    """KL divergence between log probabilities and the label-smoothed target distribution.

    Args:
        size: the vocabulary ``V``.
        padding_idx: the padding token: its column and the rows whose label it is are zero.
        smoothing: the mass moved off the true token, spread over the ``V - 2`` tokens that
            are neither the label nor padding.

    The summed loss (``reduction="sum"``) is returned; divide by the number of tokens.
    """

    def __init__(self, size: int, padding_idx: int, smoothing: float = 0.0) -> None:
        super().__init__()
        if size < 3:
            raise ValueError(f"size (the vocabulary) must be >= 3, got {size}")
        if not 0 <= padding_idx < size:
            raise ValueError(f"padding_idx must lie in [0, {size}), got {padding_idx}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must lie in [0, 1), got {smoothing}")
        self.size = size
        self.padding_idx = padding_idx
        self.smoothing = smoothing
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.true_dist: Tensor | None = None

    @checked
    def target_distribution(self, target: Int[Tensor, " N"]) -> Float[Tensor, "N {self.size}"]:
        """The smoothed distribution for each label: rows sum to 1, padding rows to 0.

        Raises:
            ValueError: a label outside ``[0, size)``.
        """
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= self.size):
            bad = target[(target < 0) | (target >= self.size)][0]
            raise ValueError(f"label {int(bad)} is outside the vocabulary [0, {self.size})")
        dist = torch.full(
            (target.shape[0], self.size), self.smoothing / (self.size - 2), device=target.device
        )
        dist.scatter_(1, target.unsqueeze(1), 1.0 - self.smoothing)
        dist[:, self.padding_idx] = 0.0
        return dist.masked_fill((target == self.padding_idx).unsqueeze(1), 0.0)

    @checked
    def forward(
        self, log_probs: Float[Tensor, "N {self.size}"], target: Int[Tensor, " N"]
    ) -> Float[Tensor, ""]:
        """``sum KL(true_dist || exp(log_probs))`` over the rows."""
        self.true_dist = self.target_distribution(target).to(log_probs.dtype)
        out: Tensor = self.criterion(log_probs, self.true_dist)
        return out


class LossCompute:
    """The Annotated Transformer's ``SimpleLossCompute``: generator, criterion, and the
    loss normalised by the number of target tokens.

    Returns ``(summed loss as a float, normalised loss to backpropagate)``.
    """

    def __init__(self, generator: Generator, criterion: LabelSmoothing) -> None:
        self.generator = generator
        self.criterion = criterion

    @checked
    def __call__(
        self, hidden: Float[Tensor, "B T H"], tgt_y: Int[Tensor, "B T"], ntokens: int
    ) -> tuple[float, Float[Tensor, ""]]:
        log_probs = self.generator(hidden)  # (B, T, V)
        summed = self.criterion(log_probs.reshape(-1, log_probs.shape[-1]), tgt_y.reshape(-1))
        normalised: Tensor = summed / max(ntokens, 1)
        return float(summed.detach()), normalised


def rate(step: int, model_size: int, factor: float, warmup: int) -> float:
    """The Noam schedule: ``factor * H**-0.5 * min(step**-0.5, step * warmup**-1.5)``.

    It rises linearly for ``warmup`` steps, peaks at ``step = warmup`` and then decays as
    ``step**-0.5``. Step 0 counts as step 1 (LambdaLR calls it once before training).

    Raises:
        ValueError: a non-positive ``model_size`` or ``warmup``, or a negative step.
    """
    if model_size < 1 or warmup < 1:
        raise ValueError(f"model_size and warmup must be >= 1, got {model_size} and {warmup}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    step = max(step, 1)
    return float(factor * model_size**-0.5 * min(step**-0.5, step * warmup**-1.5))


def make_optimizer(model: nn.Module, lr: float = 1.0) -> torch.optim.Adam:
    """Adam with the paper's betas (0.9, 0.98) and eps 1e-9; ``lr`` is the base the Noam
    schedule multiplies (1.0 makes the schedule the learning rate itself)."""
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)


def noam_scheduler(
    optimizer: torch.optim.Optimizer, *, model_size: int, factor: float = 1.0, warmup: int = 400
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that follows `rate`."""
    rate(1, model_size, factor, warmup)  # validate now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=lambda step: rate(step, model_size, factor, warmup)
    )


@dataclass
class TrainState:
    """Counters that survive across epochs."""

    step: int = 0  # batches backpropagated
    accum_step: int = 0  # optimizer steps taken
    samples: int = 0  # sequences seen
    tokens: int = 0  # target tokens seen
    losses: list[float] = field(default_factory=list)  # per-token loss of each batch


def run_epoch(
    batches: Iterable[Batch],
    model: EncoderDecoder,
    loss_compute: LossCompute,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    accum_iter: int = 1,
    train_state: TrainState | None = None,
    progress: bool | None = None,
    description: str = "epoch",
) -> tuple[float, TrainState]:
    """One pass over ``batches``: returns the loss per target token, and the train state.

    With an ``optimizer`` it trains: gradients of ``accum_iter`` batches are accumulated
    before each optimizer step; ``scheduler`` steps once per batch (the Noam schedule
    counts batches). Without one it only evaluates, under ``torch.no_grad``.

    ``progress``: a tqdm bar (``None``: only on a terminal).

    Raises:
        ValueError: ``accum_iter < 1``.
    """
    if accum_iter < 1:
        raise ValueError(f"accum_iter must be >= 1, got {accum_iter}")
    state = TrainState() if train_state is None else train_state
    training = optimizer is not None
    model.train(training)
    total_loss, total_tokens = 0.0, 0
    bar = tqdm(batches, desc=description, disable=None if progress is None else not progress)
    with torch.set_grad_enabled(training):
        for i, batch in enumerate(bar):
            hidden = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
            loss, loss_node = loss_compute(hidden, batch.tgt_y, batch.ntokens)
            if optimizer is not None:
                loss_node.backward()  # type: ignore[no-untyped-call]
                state.step += 1
                state.samples += batch.src.shape[0]
                state.tokens += batch.ntokens
                if (i + 1) % accum_iter == 0:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    state.accum_step += 1
                if scheduler is not None:
                    scheduler.step()
                state.losses.append(loss / max(batch.ntokens, 1))
            total_loss += loss
            total_tokens += batch.ntokens
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
            bar.set_postfix(loss=f"{loss / max(batch.ntokens, 1):.3f}", lr=f"{lr:.1e}")
        if optimizer is not None and state.step % accum_iter:
            optimizer.step()  # the tail of an epoch whose length accum_iter does not divide
            optimizer.zero_grad(set_to_none=True)
            state.accum_step += 1
    bar.close()
    return total_loss / max(total_tokens, 1), state
