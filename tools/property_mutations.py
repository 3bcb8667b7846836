"""Prove that every property test can fail: plant one bug per property and watch it fail.

Each mutation edits one line of ``src/attnref`` in a scratch copy of the repository, runs
the property tests that should catch it, and records whether they failed. The working
tree is never touched. Run from the repository root::

    python tools/property_mutations.py            # all mutations, a table at the end
    python tools/property_mutations.py -k gqa     # those whose name contains "gqa"

Exit code 0 only if every mutation was caught. Takes a few minutes on 2 cores.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUNC = "src/attnref/functional.py"
MASKS = "src/attnref/masks.py"
ATTN = "src/attnref/layers/attention.py"
POS = "src/attnref/layers/positional.py"
PROPS = "tests/property/test_functional_props.py"
LAYERS = "tests/property/test_layers_props.py"
VARIANTS = "tests/property/test_variants_props.py"
CACHE = "src/attnref/cache.py"
ROTARY = "src/attnref/rotary.py"
VARLEN = "src/attnref/varlen.py"
SERVING = "tests/test_serving.py"
LINEAR = "src/attnref/linear.py"
LINEAR_PROPS = "tests/property/test_linear_props.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # node ids that must fail


MUTATIONS = [
    Mutation(
        "empty_row_nan",
        FUNC,
        "    return weights if empty is None else weights.masked_fill(empty, 0.0)",
        "    return weights",
        (f"{PROPS}::test_weights_are_probabilities_over_visible_keys",),
    ),
    Mutation(
        "empty_row_nan_in_backward",
        FUNC,
        "        scores = scores.masked_fill(empty, 0.0)",
        "        pass",
        ("tests/test_functional.py::test_safe_softmax_gradient_is_finite_with_an_empty_row",),
    ),
    Mutation(
        "masked_value_nan_leaks",
        FUNC,
        "    return _repeat_kv_heads(v, p.q.shape[-3]).masked_fill(hidden_for_all, 0.0)",
        "    return v",
        (f"{PROPS}::test_hidden_keys_and_values_never_matter",),
    ),
    Mutation(
        "scale_divides_by_d",
        FUNC,
        "return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0",
        "return 1.0 / head_dim if head_dim > 0 else 1.0",
        (f"{PROPS}::test_agrees_with_independent_float64", f"{PROPS}::test_agrees_with_torch_sdpa"),
    ),
    Mutation(
        "causal_diagonal_excludes_self",
        MASKS,
        "return cols <= at + offset",
        "return cols < at + offset",
        (
            f"{PROPS}::test_agrees_with_independent_float64",
            f"{PROPS}::test_agrees_with_torch_sdpa",
            f"{PROPS}::test_weights_are_probabilities_over_visible_keys",
        ),
    ),
    Mutation(
        "bottom_right_treated_as_top_left",
        MASKS,
        'return 0 if alignment == "top_left" else num_keys - num_queries',
        "return 0",
        (f"{PROPS}::test_agrees_with_independent_float64",),
    ),
    Mutation(
        "online_softmax_no_rescale",
        FUNC,
        "rescale = torch.exp(row_max - safe_max)",
        "rescale = torch.ones_like(row_max)",
        (f"{PROPS}::test_chunked_equals_materialised_for_every_block_size",),
    ),
    Mutation(
        "valid_lens_2d_off_by_one",
        MASKS,
        "return (keys < lens).expand(valid_lens.shape[0], num_queries, num_keys)",
        "return (keys <= lens - (valid_lens.dim() == 1)).expand("
        "valid_lens.shape[0], num_queries, num_keys)",
        (f"{PROPS}::test_valid_lens_forms_and_masks_agree",),
    ),
    Mutation(
        "mask_read_reversed",
        FUNC,
        "        bm = ~_key_block(p.bool_mask, start, stop, Tk)",
        "        bm = ~_key_block(p.bool_mask, start, stop, Tk).flip(-1)",
        (f"{PROPS}::test_permuting_key_value_pairs_changes_nothing",),
    ),
    Mutation(
        "gqa_grouped_tiled",
        FUNC,
        "    stacked = x.contiguous().reshape(*x.shape[:-3], g, (h // g) * x.shape[-2], "
        "x.shape[-1])\n    return (stacked @ y).reshape(*x.shape[:-1], y.shape[-1])",
        "    return x @ torch.cat([y] * (h // g), dim=-3)",
        (
            f"{PROPS}::test_gqa_equals_expanded_heads",
            f"{LAYERS}::test_mha_equals_heads_one_by_one",
            f"{LAYERS}::test_gqa_module_equals_mha_with_repeated_kv_heads",
        ),
    ),
    Mutation(  # the mapping as copies (expand_kv_heads), which the test compares against
        "gqa_tiled",
        FUNC,
        "    return x.repeat_interleave(num_heads // g, dim=-3)",
        "    return x.repeat(*([1] * (x.dim() - 3)), num_heads // g, 1, 1)",
        (f"{PROPS}::test_gqa_equals_expanded_heads",),
    ),
    Mutation(
        "softmax_over_queries",
        FUNC,
        "    weights = torch.softmax(scores, dim=-1)",
        "    weights = torch.softmax(scores, dim=-2)",
        (f"{PROPS}::test_rows_depend_only_on_their_own_query",),
    ),
    Mutation(
        "transpose_qkv_bare_reshape",
        FUNC,
        "return X.reshape(B, T, num_heads, H // num_heads).permute(0, 2, 1, 3)  # (B, h, T, Dh)",
        "return X.reshape(B, num_heads, T, H // num_heads)",
        (
            f"{PROPS}::test_transpose_output_inverts_transpose_qkv",
            f"{LAYERS}::test_self_attention_is_permutation_equivariant",
            f"{LAYERS}::test_mha_permuting_key_value_pairs_changes_nothing",
        ),
    ),
    Mutation(
        "sin_cos_swapped",
        POS,
        "P[:, 0::2] = torch.sin(angles)",
        "P[:, 0::2] = torch.cos(angles)",
        (f"{LAYERS}::test_sinusoidal_offset_is_one_rotation",),
    ),
    Mutation(
        "nadaraya_watson_unnormalised",
        FUNC,
        "weights = torch.softmax(-(diffs**2) / 2, dim=-1)",
        "weights = torch.softmax(-(diffs**2) / 2, dim=-2)",
        (f"{LAYERS}::test_nadaraya_watson_predictions_lie_within_targets",),
    ),
    Mutation(
        "nadaraya_watson_linear_kernel",
        FUNC,
        "weights = torch.softmax(-(diffs**2) / 2, dim=-1)",
        "weights = torch.softmax(-diffs / 2, dim=-1)",
        (f"{LAYERS}::test_nadaraya_watson_large_width_is_nearest_neighbour",),
    ),
    Mutation(
        "sdpa_key_gradient_dropped",
        FUNC,
        "scores = _heads_matmul(p.q, k.transpose(-2, -1))  # (*batch, h, Tq, block); q is",
        "scores = _heads_matmul(p.q, k.detach().transpose(-2, -1))  # (*batch, h, Tq, block); q is",
        (f"{LAYERS}::test_sdpa_gradcheck",),
    ),
    Mutation(
        "safe_softmax_gradient_detached",
        FUNC,
        "        scores = scores.masked_fill(hidden, _NEG_INF)\n    return _softmax_rows",
        "        scores = scores.masked_fill(hidden, _NEG_INF).detach()\n    return _softmax_rows",
        (f"{LAYERS}::test_masked_softmax_gradcheck",),
    ),
    Mutation(
        "d2l_masked_softmax_gradient_detached",
        FUNC,
        "    return torch.softmax(masked.reshape(B, Tq, Tk), dim=-1)",
        "    return torch.softmax(masked.reshape(B, Tq, Tk).detach(), dim=-1) + 0 * X",
        (f"{LAYERS}::test_masked_softmax_gradcheck",),
    ),
    Mutation(
        "additive_features_detached",
        FUNC,
        "features = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1))  # (B, Tq, Tk, H)",
        "features = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1).detach())  # (B, Tq, Tk, H)",
        (f"{LAYERS}::test_additive_attention_gradcheck",),
    ),
    # the variants (docs/variants.md)
    Mutation(
        "window_left_bound_exclusive",
        MASKS,
        "        seen = seen & (cols >= pos - left)",
        "        seen = seen & (cols > pos - left)",
        (f"{VARIANTS}::test_variants_agree_with_independent_float64",),
    ),
    Mutation(
        "softcap_dropped",
        FUNC,
        "        scores = p.softcap * torch.tanh(scores / p.softcap)",
        "        pass",
        (
            f"{VARIANTS}::test_variants_agree_with_independent_float64",
            f"{VARIANTS}::test_softcapped_scores_lie_within_the_cap",
        ),
    ),
    Mutation(
        "alibi_distance_signed",
        FUNC,
        "        distance = (pos + p.offset - cols).abs_()  # (Tq, block)",
        "        distance = pos + p.offset - cols",
        (f"{VARIANTS}::test_variants_agree_with_independent_float64",),
    ),
    Mutation(
        "chunked_sink_counted_twice",
        FUNC,
        "        out = apply_sinks(out, lse, sinks)",
        "        out = apply_sinks(out, lse - math.log(2), sinks)",
        (f"{VARIANTS}::test_chunked_equals_materialised_with_every_variant",),
    ),
    Mutation(
        "lse_base2",
        FUNC,
        "        return torch.logsumexp(scores, dim=-1)",
        "        return torch.logsumexp(scores, dim=-1) / math.log(2)",
        (f"{VARIANTS}::test_variants_agree_with_independent_float64",),
    ),
    Mutation(
        "merge_by_max",
        FUNC,
        "    lse = torch.logaddexp(a, b)",
        "    lse = torch.maximum(a, b)",
        (f"{VARIANTS}::test_merging_two_parts_of_the_keys_equals_attending_all",),
    ),
    # the packed, paged and rotary references, and the model's rolling window cache
    Mutation(
        "rolling_cache_drops_one_too_many",
        CACHE,
        "        keep = max(all_keys.shape[2] - self.window, 0)",
        "        keep = max(all_keys.shape[2] - self.window + 1, 0)",
        (
            "tests/property/test_cache_props.py::test_lm_logits_at_every_step_equal_the_full_forward",
        ),
    ),
    Mutation(
        "rotary_not_a_rotation",
        ROTARY,
        "        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)",
        "        turned = torch.cat((x1 * c - x2 * s, x1 * s - x2 * c), dim=-1)",
        (f"{SERVING}::test_rotary_scores_depend_only_on_the_relative_position",),
    ),
    Mutation(
        "varlen_top_left",
        VARLEN,
        '        causal_alignment="bottom_right",',
        '        causal_alignment="top_left",',
        (f"{SERVING}::test_varlen_equals_each_sequence_alone_with_empty_and_one_token_sequences",),
    ),
    Mutation(
        "chunk_end_state_not_decayed",
        LINEAR,
        "            to_end = (run[:, -1:, :] - run).exp()  # (HV, C, K): from token j to the end",
        "            to_end = (run[:, -1:, :] - run).exp() * 0 + 1",
        (f"{LINEAR_PROPS}::test_the_chunked_form_equals_the_recurrence",),
    ),
    Mutation(
        "correction_reads_the_undecayed_state",
        LINEAR,
        "            if g is not None:\n                S = S * g[b, t].exp()[:, None, None]",
        "            if False:\n                S = S * g[b, t].exp()[:, None, None]",
        (f"{LINEAR_PROPS}::test_a_hand_worked_two_token_example",),
    ),
]


def run(mutation: Mutation, scratch: Path) -> dict[str, bool]:
    """Apply ``mutation`` in ``scratch`` and report, per test, whether it failed."""
    target = scratch / mutation.file
    original = target.read_text()
    if original.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: the line to mutate is not found exactly once")
    target.write_text(original.replace(mutation.old, mutation.new))
    try:
        return {test: _pytest(test, scratch) == 1 for test in mutation.tests}
    finally:
        target.write_text(original)


#: what every test run imports and no mutation touches: imported once here, before the
#: first fork, so that each run starts in a second, not in the 5-8 s of a fresh
#: interpreter importing torch (37 runs: most of this tool's time was start-up)
SHARED = ("torch", "numpy", "hypothesis", "jaxtyping", "beartype")


def _pytest(test: str, scratch: Path) -> int:
    """Run one test of the mutated copy ``scratch`` in a fork of this process (which has
    imported `SHARED`, never attnref: the child imports the copy's), in the child's own
    pytest, one process (-n 0); its exit code. Where there is no fork, a fresh
    interpreter runs it."""
    args = ["-x", "-q", "-n", "0", "-p", "no:cacheprovider", test]
    # hypothesis' plugin module, imported here already, cannot have its asserts rewritten
    args[:0] = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    env = {"PYTHONPATH": str(scratch / "src"), "HYPOTHESIS_PROFILE": "mutations"}
    if not hasattr(os, "fork"):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *args],
            cwd=scratch,
            env=os.environ | env,
            capture_output=True,
            text=True,
        )
        return done.returncode
    for name in SHARED:
        __import__(name)
    pid = os.fork()
    if pid == 0:  # the child: the copy's attnref and tests, the output dropped
        code = 3
        try:
            os.environ.update(env)
            os.chdir(scratch)
            sys.path[:0] = [str(scratch / "src"), str(scratch)]
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            import pytest

            code = int(pytest.main(args))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    all_caught = True
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(ROOT, scratch, ignore=shutil.ignore_patterns(".venv", ".git", ".*cache*"))
        shutil.rmtree(scratch / ".hypothesis", ignore_errors=True)
        where = subprocess.run(
            [sys.executable, "-c", "import attnref; print(attnref.__file__)"],
            env=os.environ | {"PYTHONPATH": str(scratch / "src")},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if not where.startswith(str(scratch)):
            raise SystemExit(f"the scratch copy is not the attnref imported: {where}")
        for m in chosen:
            start = time.monotonic()
            caught = run(m, scratch)
            took = f"{time.monotonic() - start:5.1f} s"
            for test, ok in caught.items():
                all_caught &= ok
                mark = "FAILED as it should" if ok else "NOT CAUGHT"
                print(f"{m.name:<38} {test.split('::')[1]:<58} {mark} {took}", flush=True)
    print("every mutation caught" if all_caught else "some mutation was NOT caught")
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
