"""The demo tasks: small problems the reference models learn on a CPU in under a minute.

- `copy_batches` / `copy_accuracy` / `train_copy_task`: the Annotated Transformer's
  synthetic copy task, trained with `attnref.training`'s loop (``attnref demo copy``).
- `reverse_batch` / `train_reverse_task`: D2L's Bahdanau model learns to reverse
  sequences, so that its alignment heatmap has a shape to recognise
  (``attnref demo reverse``).
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Int
from torch import Tensor, nn
from tqdm import tqdm

from attnref._checking import checked
from attnref.decoding import greedy_decode, greedy_decode_seq2seq
from attnref.layers.seq2seq import Seq2Seq, Seq2SeqAttentionDecoder, Seq2SeqEncoder
from attnref.layers.transformer import EncoderDecoder, make_model
from attnref.training import (
    Batch,
    LabelSmoothing,
    LossCompute,
    TrainState,
    make_optimizer,
    noam_scheduler,
    run_epoch,
)

__all__ = [
    "CopyTaskResult",
    "ReverseTaskResult",
    "copy_accuracy",
    "copy_batches",
    "reverse_batch",
    "train_copy_task",
    "train_reverse_task",
]


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
