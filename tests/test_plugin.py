"""The pytest plugin: ``pytest --attnref-backend=...`` audits a backend in someone else's CI."""

import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]


def plugin_run(pytester: pytest.Pytester, *options: str) -> pytest.RunResult:
    """pytest in a subprocess with these options (and no cache)."""
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *options)


def test_without_the_option_the_plugin_adds_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_one(): pass")
    result = plugin_run(pytester)
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_one_test_per_property_and_dtype_with_junit(pytester: pytest.Pytester) -> None:
    result = plugin_run(
        pytester,
        "--attnref-backend=mutant.gqa_tiled",
        "--attnref-dtype=float32",
        "--attnref-dtype=float16",
        "--attnref-property=gqa",
        "--attnref-property=causality",
        "--junitxml=report.xml",
    )
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "collected 4 items",  # the audit's items are counted
            "*GQA against expanded heads: the call with grouped KV heads: max error*",
            "case = Case(name='gqa'*",
            # node ids like pytest's own; the short summary shows the failure itself
            "FAILED attnref/mutant.gqa_tiled::gqa[[]float32[]] - GQA against expanded heads*",
        ]
    )
    cases = list(ET.parse(pytester.path / "report.xml").getroot().iter("testcase"))
    assert {c.get("classname") for c in cases} == {"attnref.mutant.gqa_tiled"}
    names = sorted(c.get("name", "") for c in cases)
    assert names == sorted(
        f"{p}[{d}]" for p in ("gqa", "causality") for d in ("float32", "float16")
    )


@pytest.mark.slow  # 20-32 s on a loaded machine: the default tier ran 240 s of its 180
def test_a_user_module_passes_and_undeclared_is_a_skip(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        mykernel="""
import torch
from attnref.conformance import Capabilities

def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

# torch's SDPA takes no mask together with is_causal=True
attention.capabilities = Capabilities(dtypes=(torch.float32,), gqa=False, causal_with_mask=False)
"""
    )
    result = plugin_run(
        pytester,
        "--attnref-backend=mykernel:attention",
        "--attnref-property=forward",
        "--attnref-property=gqa",
        "-rs",
    )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*GQA not declared*"])


@pytest.mark.slow  # a pytest subprocess that imports torch: 4-7 s
def test_a_bad_backend_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = plugin_run(pytester, "--attnref-backend=nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attnref-backend: unknown backend 'nope'*"])


@pytest.mark.slow  # 13 s; the default tier audits a flash-convention kernel with the CLI
def test_a_flash_convention_kernel_with_attnref_api(pytester: pytest.Pytester) -> None:
    result = plugin_run(
        pytester,
        "--attnref-backend=attnref.conformance.families.flash:flash_reference",
        "--attnref-api=flash",
        "--attnref-property=window_none",
        "--attnref-dtype=float32",
    )
    result.assert_outcomes(passed=1)


@pytest.mark.slow  # a pytest session of its own: 7 s
def test_min_judged_fails_a_thin_property(pytester: pytest.Pytester) -> None:
    result = plugin_run(
        pytester,
        "--attnref-backend=torch-sdpa",
        "--attnref-dtype=float32",
        "--attnref-property=scale",
        "--attnref-property=settled_output",
        "--attnref-min-judged=10000",
    )
    # scale drew its 25 cases and judged fewer than 10000; settled_output has one case
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*thin: judged on 25 of 25 drawn cases*--attnref-min-judged 10000*"]
    )
