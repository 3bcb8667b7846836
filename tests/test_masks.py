"""Masks: polarity, both valid_lens forms, both causal alignments, and bad input."""

import pytest
import torch

from attnref import masks


def test_sequence_mask_is_d2ls() -> None:
    X = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert torch.equal(
        masks.sequence_mask(X, torch.tensor([1, 2])), torch.tensor([[1, 0, 0], [4, 5, 0]])
    )
    assert torch.equal(X, torch.tensor([[1, 2, 3], [4, 5, 6]])), "X must not be modified"
    filled = masks.sequence_mask(torch.ones(2, 3), torch.tensor([0, 3]), value=-1.0)
    assert torch.equal(filled, torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]))


def test_valid_lens_to_mask_both_forms() -> None:
    m1 = masks.valid_lens_to_mask(torch.tensor([1, 3]), 2, 4)
    assert m1.shape == (2, 2, 4)
    assert m1[0].tolist() == [[True, False, False, False]] * 2
    assert m1[1].tolist() == [[True, True, True, False]] * 2
    m2 = masks.valid_lens_to_mask(torch.tensor([[1, 2], [0, 4]]), 2, 4)
    assert m2[0].tolist() == [[True, False, False, False], [True, True, False, False]]
    assert m2[1].tolist() == [[False] * 4, [True] * 4]


@pytest.mark.parametrize(
    ("lens", "message"),
    [
        (torch.tensor([-1, 2]), r"valid_lens must lie in \[0, 4\].*from -1 to 2"),
        (torch.tensor([2, 5]), r"valid_lens must lie in \[0, 4\].*from 2 to 5"),
        (torch.tensor([[1, 2, 3]]), r"one length per query, but there are 2 queries"),
    ],
)
def test_valid_lens_bad_values(lens: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        masks.valid_lens_to_mask(lens, 2, 4)


def test_valid_lens_must_be_integers() -> None:
    with pytest.raises(TypeError, match="valid_lens"):
        masks.valid_lens_to_mask(torch.tensor([1.5, 2.0]), 2, 4)


def test_padding_and_std_masks_are_the_annotated_transformers() -> None:
    tgt = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert masks.padding_mask(tgt, 0).tolist() == [[[True, True, False]], [[True, False, False]]]
    assert masks.subsequent_mask(3).tolist() == [
        [[True, False, False], [True, True, False], [True, True, True]]
    ]
    std = masks.make_std_mask(tgt, 0)
    assert std.shape == (2, 3, 3)
    assert std[0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert std[1].tolist() == [[True, False, False]] * 3


def test_causal_alignments() -> None:
    top = masks.causal_mask(2, 4, "top_left")
    bottom = masks.causal_mask(2, 4, "bottom_right")
    assert top.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert bottom.tolist() == [[True, True, True, False], [True, True, True, True]]
    # more queries than keys: bottom-right leaves the first queries with no visible key
    assert masks.causal_mask(3, 1, "bottom_right").tolist() == [[False], [False], [True]]
    assert torch.equal(masks.causal_mask(5, 5, "top_left"), masks.causal_mask(5, 5, "bottom_right"))


def test_unknown_alignment() -> None:
    with pytest.raises(TypeError, match="parameter 'alignment'"):
        masks.causal_mask(2, 3, "diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="causal_alignment must be one of"):
        masks.causal_offset(2, 3, "diagonal")


def test_additive_mask() -> None:
    m = masks.additive_mask(torch.tensor([True, False]), torch.float16)
    assert m.dtype == torch.float16
    assert m.tolist() == [0.0, float("-inf")]
    with pytest.raises(ValueError, match="floating-point dtype"):
        masks.additive_mask(torch.tensor([True]), torch.int64)


def test_a_sliding_window_is_inclusive_at_both_ends() -> None:
    from attnref.masks import sliding_window_mask

    # bottom-right, Tq = 2, Tk = 6: the queries sit at positions 4 and 5
    mask = sliding_window_mask(2, 6, (2, 0))
    assert mask.tolist() == [
        [False, False, True, True, True, False],
        [False, False, False, True, True, True],
    ]
    assert sliding_window_mask(3, 3, (0, 1), "top_left").tolist() == [
        [True, True, False],
        [False, True, True],
        [False, False, True],
    ]
    assert bool(sliding_window_mask(4, 7, (-1, -1)).all())
    with pytest.raises(ValueError, match="window must be"):
        sliding_window_mask(2, 2, (-3, 0))
