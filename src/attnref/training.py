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
- `copy_batches` / `copy_accuracy` / `train_copy_task`: the synthetic copy task.
- `reverse_batch` / `train_reverse_task`: D2L's Bahdanau model learns to reverse
  sequences, so that its alignment heatmap has a shape to recognise.
"""

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from tqdm import tqdm

from attnref._checking import checked
from attnref.decoding import greedy_decode, greedy_decode_seq2seq
from attnref.layers.seq2seq import Seq2Seq, Seq2SeqAttentionDecoder, Seq2SeqEncoder
from attnref.layers.transformer import EncoderDecoder, Generator, make_model
from attnref.masks import make_std_mask, padding_mask

__all__ = [
    "Batch",
    "CopyTaskResult",
    "LabelSmoothing",
    "LossCompute",
    "ReverseTaskResult",
    "TrainState",
    "copy_accuracy",
    "copy_batches",
    "make_optimizer",
    "noam_scheduler",
    "rate",
    "reverse_batch",
    "run_epoch",
    "train_copy_task",
    "train_reverse_task",
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


# ---------------------------------------------------------------------------- copy task


def copy_batches(
    vocab_size: int,
    batch_size: int,
    num_batches: int,
    *,
    seq_len: int = 10,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Iterator[Batch]:
    """The Annotated Transformer's synthetic copy task: random sequences of tokens
    ``1..V-1`` whose first token is the start symbol 1; the target is the source.
    Padding is 0 (unused here)."""
    for _ in range(num_batches):
        data = torch.randint(1, vocab_size, (batch_size, seq_len), generator=generator)
        data[:, 0] = 1
        data = data.to(device)
        yield Batch(data, data, pad=0)


@checked
def copy_accuracy(
    model: EncoderDecoder, src: Int[Tensor, "B T"], src_mask: Bool[Tensor, "#B 1 T"] | None = None
) -> float:
    """Fraction of sequences greedy decoding copies exactly (every token)."""
    model.eval()
    out = greedy_decode(model, src, src_mask, src.shape[1], start_symbol=int(src[0, 0]))
    return float((out == src).all(dim=1).float().mean())


@dataclass
class CopyTaskResult:
    """What `train_copy_task` returns."""

    model: EncoderDecoder
    accuracy: float  # exact-match greedy decoding on fresh sequences, after the last epoch
    epochs: int  # epochs run
    seconds: float  # wall time of training and evaluation
    epoch_losses: list[float]  # training loss per token, per epoch
    state: TrainState


def train_copy_task(
    *,
    vocab_size: int = 11,
    seq_len: int = 10,
    num_layers: int = 2,
    num_hiddens: int = 64,
    ffn_hiddens: int = 128,
    num_heads: int = 4,
    batch_size: int = 80,
    batches_per_epoch: int = 20,
    max_epochs: int = 40,
    warmup: int = 200,
    factor: float = 0.5,
    smoothing: float = 0.0,
    dropout: float = 0.0,
    target_accuracy: float = 1.0,
    eval_sequences: int = 200,
    seed: int = 0,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> CopyTaskResult:
    """Train `make_model` on the copy task until greedy decoding copies
    ``target_accuracy`` of ``eval_sequences`` fresh sequences exactly, or ``max_epochs``.

    The defaults are a smaller model than the Annotated Transformer's (``H = 64`` rather
    than 512) with its optimiser, schedule and batch shape, so that it trains in seconds
    on a laptop CPU. The smaller ``H`` raises the Noam peak (``H**-0.5``), so ``factor``
    and ``warmup`` are halved (peak rate 4.4e-3); with the Annotated Transformer's
    ``factor=1, warmup=400`` this model's loss spikes and after 20 epochs it copied 84%.
    """
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed)
    eval_gen = torch.Generator().manual_seed(seed + 1)
    model = make_model(
        vocab_size,
        vocab_size,
        num_layers=num_layers,
        num_hiddens=num_hiddens,
        ffn_hiddens=ffn_hiddens,
        num_heads=num_heads,
        dropout=dropout,
    )
    criterion = LabelSmoothing(vocab_size, padding_idx=0, smoothing=smoothing)
    loss_compute = LossCompute(model.generator, criterion)
    optimizer = make_optimizer(model)
    scheduler = noam_scheduler(optimizer, model_size=num_hiddens, factor=factor, warmup=warmup)
    state = TrainState()
    evaluation = next(
        copy_batches(vocab_size, eval_sequences, 1, seq_len=seq_len, generator=eval_gen)
    )
    start = time.perf_counter()
    losses: list[float] = []
    accuracy, epoch = 0.0, 0
    for epoch in range(1, max_epochs + 1):
        batches = copy_batches(
            vocab_size, batch_size, batches_per_epoch, seq_len=seq_len, generator=data_gen
        )
        loss, state = run_epoch(
            batches,
            model,
            loss_compute,
            optimizer,
            scheduler,
            train_state=state,
            progress=progress,
            description=f"epoch {epoch}/{max_epochs}",
        )
        losses.append(loss)
        accuracy = copy_accuracy(model, evaluation.src)
        if log is not None:
            log(f"epoch {epoch}: loss {loss:.4f} per token, exact-match copies {accuracy:.1%}")
        if accuracy >= target_accuracy:
            break
    seconds = time.perf_counter() - start
    return CopyTaskResult(model, accuracy, epoch, seconds, losses, state)


# ------------------------------------------------------- Bahdanau: the reversal task


@dataclass
class ReverseTaskResult:
    """What `train_reverse_task` returns."""

    model: Seq2Seq
    accuracy: float  # exact-match greedy reversals of fresh sequences
    steps: int
    seconds: float
    losses: list[float]  # cross-entropy per token of each batch


@checked
def reverse_batch(
    batch_size: int,
    *,
    vocab_size: int = 12,
    max_len: int = 8,
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "B {max_len}"], Int[Tensor, " B"], Int[Tensor, "B {max_len}+2"]]:
    """Sources of random length ``2..max_len`` (tokens ``3..V-1``, padding 0) and their
    reversals framed by ``<bos>`` = 1 and ``<eos>`` = 2: ``(src, valid_lens, tgt)``.

    Reversal makes the alignment an anti-diagonal: target token ``t`` must look at source
    position ``n - 1 - t``, which is what the Bahdanau heatmap shows once it has learned.
    """
    lens = torch.randint(2, max_len + 1, (batch_size,), generator=generator)
    tokens = torch.randint(3, vocab_size, (batch_size, max_len), generator=generator)
    positions = torch.arange(max_len)
    src = tokens.masked_fill(positions >= lens.unsqueeze(1), 0)
    tgt = torch.zeros(batch_size, max_len + 2, dtype=torch.long)
    tgt[:, 0] = 1
    for b in range(batch_size):
        n = int(lens[b])
        tgt[b, 1 : n + 1] = src[b, :n].flip(0)
        tgt[b, n + 1] = 2
    return src, lens, tgt


def train_reverse_task(
    *,
    vocab_size: int = 12,
    max_len: int = 8,
    embed_size: int = 32,
    num_hiddens: int = 64,
    num_layers: int = 1,
    batch_size: int = 64,
    steps: int = 600,
    lr: float = 5e-3,
    seed: int = 0,
    progress: bool | None = None,
) -> ReverseTaskResult:
    """Train D2L's Bahdanau encoder-decoder to reverse sequences (cross-entropy with
    padding ignored, Adam, teacher forcing), then measure exact-match greedy reversals
    of 200 fresh sequences."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Seq2Seq(
        Seq2SeqEncoder(
            vocab_size=vocab_size,
            embed_size=embed_size,
            num_hiddens=num_hiddens,
            num_layers=num_layers,
        ),
        Seq2SeqAttentionDecoder(
            vocab_size=vocab_size,
            embed_size=embed_size,
            num_hiddens=num_hiddens,
            num_layers=num_layers,
        ),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss(ignore_index=0)
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc="reverse", disable=None if progress is None else not progress)
    for _ in bar:
        src, lens, tgt = reverse_batch(
            batch_size, vocab_size=vocab_size, max_len=max_len, generator=gen
        )
        logits = model(src, tgt[:, :-1], lens)
        loss = loss_fn(logits.reshape(-1, vocab_size), tgt[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # GRUs: D2L clips too
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    src, lens, tgt = reverse_batch(
        200,
        vocab_size=vocab_size,
        max_len=max_len,
        generator=torch.Generator().manual_seed(seed + 1),
    )
    out, _ = greedy_decode_seq2seq(model, src, lens, tgt.shape[1], 1)
    real = tgt != 0
    accuracy = float(((out == tgt) | ~real).all(dim=1).float().mean())
    return ReverseTaskResult(model, accuracy, steps, time.perf_counter() - start, losses)
