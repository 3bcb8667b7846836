"""The adapter cookbook (examples/adapters): each adapter imports and declares valid
capabilities when its library is installed (``nox -s peers`` installs them all)."""

import importlib.util
import warnings
from dataclasses import replace

import pytest
import torch
from examples.adapters.audit_all import ADAPTERS, FAMILIES

from attnref.conformance import Capabilities, check_case
from attnref.conformance.backends import load_backend
from attnref.conformance.cases import Case
from attnref.conformance.strategies import inside

#: adapters of a library that gets every call wrong (docs/adapters.md)
WRONG_EVERYWHERE = ("examples.adapters.torchtune_attention:mha_cached",)


@pytest.mark.parametrize(("spec", "library"), ADAPTERS, ids=[s for s, _ in ADAPTERS])
def test_each_adapter_imports_and_declares_valid_capabilities(spec: str, library: str) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed (nox -s peers installs it)")
    api = FAMILIES.get(spec)
    if spec.startswith("examples.adapters.keras_"):
        # Keras picks its backend once a process: each Keras adapter is imported only in
        # a worker of its own, which sends its declaration back as data
        case = Case("smoke", batch=(2,), h=2, g=2, Tq=5, Tk=7)
        assert check_case("forward", spec, case, torch.float32) == "pass"
        return
    backend = load_backend(spec, api)
    assert isinstance(backend.capabilities, Capabilities)
    assert backend.capabilities.dtypes
    caps = backend.capabilities
    if api == "context-parallel":  # its ranks in their workers, two of them
        case = Case("smoke", batch=(2,), h=2, g=2, Tq=8, Tk=8, causal="bottom_right")
        verdict = check_case("cp_agreement", backend, case, torch.float32, api=api, world_size=2)
        assert verdict == "pass", verdict
        return
    if api == "gated-delta":  # a recurrence: judged by its own property
        case = Case("smoke", batch=(1,), h=2, g=1, Tq=70, Tk=70, Dh=8, Dv=8)
        isolate = bool(caps.interpreter)
        verdict = check_case("gdn_forward", backend, case, torch.float32, isolate=isolate)
        assert verdict == "pass", verdict
        return
    # one plain case, moved inside a narrow declaration, runs end to end and agrees
    case = inside(Case("smoke", batch=(2,), h=2, g=2, Tq=5, Tk=7), caps)
    if caps.causal_only and caps.window:  # NATTEN: a neighbourhood shorter than T
        case = replace(case, window=(2, 0))
    with warnings.catch_warnings():  # the libraries' own deprecation warnings
        warnings.simplefilter("ignore")
        # an interpreted kernel runs in a worker, which sets its interpreter up first
        isolate = bool(caps.interpreter)
        dtype = torch.float32 if torch.float32 in caps.dtypes else caps.dtypes[0]
        verdict = check_case("forward", backend, case, dtype, isolate=isolate)
    # the cached torchtune prefill attends its empty cache slots in every call (a finding)
    assert verdict.startswith("FAIL") if spec in WRONG_EVERYWHERE else verdict == "pass"


def test_the_adapters_helpers_keep_batch_dimensions() -> None:
    from attnref.adapters import as_4d, expand_mask, unflatten

    q = torch.randn(2, 3, 4, 5, 8)
    assert as_4d(q).shape == (6, 4, 5, 8)
    assert unflatten(as_4d(q), q, 8).shape == q.shape
    mask = torch.ones(2, 1, 1, 5, 7, dtype=torch.bool)
    k = torch.randn(2, 3, 4, 7, 8)
    full = expand_mask(mask, q, k)
    assert full is not None
    assert full.shape == (6, 1, 5, 7)
    empty = torch.randn(0, 4, 5, 0)  # no element: the batch size is not inferred
    assert as_4d(empty).shape == (0, 4, 5, 0)


def test_the_adapters_helpers_are_checked_and_say_what_is_wrong() -> None:
    from attnref.adapters import additive, as_4d, declare, expand_mask, no_dropout

    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 7\) does not broadcast"):
        expand_mask(torch.ones(4, 7, dtype=torch.bool), q, k)
    with pytest.raises(Exception, match="parameter 't'"):  # shapes are checked, by name
        as_4d(torch.randn(5, 8))
    with pytest.raises(NotImplementedError, match=r"dropout_p = 0 only, got 0\.1"):
        no_dropout(0.1)
    mask = torch.tensor([[True, False]])
    assert additive(mask, torch.float16, -1e4).tolist() == [[0.0, -1e4]]
    assert additive(mask, torch.float32, float("-inf"))[0, 1] == float("-inf")
    assert additive(torch.zeros(1, 2), torch.float64, -1.0).dtype == torch.float64

    def fn() -> None: ...

    declare(fn, dropout=False)
    assert isinstance(fn.capabilities, Capabilities)  # type: ignore[attr-defined]
    assert fn.capabilities.family == "sdpa"  # type: ignore[attr-defined]
    assert not fn.capabilities.dropout  # type: ignore[attr-defined]
    declare(fn, "flash", window=False)
    assert fn.capabilities.family == "flash"  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        declare(fn, no_such_capability=True)
    with pytest.raises(ValueError, match="unknown API family 'nope'"):
        declare(fn, "nope")


def test_flashinfer_paged_layout_is_the_block_table_in_csr_form() -> None:
    from examples.adapters.flashinfer_paged import paged_layout

    block_table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    indptr, indices, last = paged_layout(torch.tensor([7, 4]), block_table, 4)
    assert indptr.tolist() == [0, 2, 3]
    assert indices.tolist() == [5, 2, 0]
    assert last.tolist() == [3, 4]


@pytest.mark.slow  # two audits (4 s); the MLA adapter below is the default tier's
@pytest.mark.usefixtures("unchecked")
def test_flashinfer_style_decode_through_the_adapter_passes_and_its_tail_bug_fails() -> None:
    """The adapter of docs/kvcache.md, on FlashInfer's convention written in plain torch:
    it passes the flash-kvcache properties it can take (one query per request; the rest
    are declared refusals), and counting the last page's tail is caught."""
    from attnref.conformance import audit
    from attnref.conformance.properties import PROPERTIES

    props = [p.id for p in PROPERTIES.values() if p.families == ("flash-kvcache",)]
    good = load_backend("examples.adapters.flashinfer_paged:flashinfer_reference", "flash-kvcache")
    report = audit(good, properties=props, dtypes=(torch.float32,), progress=False, isolate=False)
    assert report.ok, report.format_table()
    assert {"kvcache", "kvcache_pages"} <= {
        r.property for r in report.results if r.status == "pass"
    }
    bad = load_backend(
        "examples.adapters.flashinfer_paged:flashinfer_tail_counted", "flash-kvcache"
    )
    report = audit(bad, properties=["kvcache"], dtypes=(torch.float32,), progress=False)
    assert not report.ok


def test_flashinfer_mla_csr_layout_is_the_block_table_in_csr_form() -> None:
    from examples.adapters.flashinfer_mla import csr_layout

    block_table = torch.tensor([[5, 2, 9], [0, 9, 9], [7, 9, 9]], dtype=torch.int32)
    indptr, indices = csr_layout(torch.tensor([7, 4, 0]), block_table, 4)
    assert indptr.tolist() == [0, 2, 3, 3]
    assert indices.tolist() == [5, 2, 0]


@pytest.mark.slow  # 20-32 s on a loaded machine: the default tier ran 240 s of its 180
@pytest.mark.usefixtures("unchecked")
def test_flashinfer_style_mla_through_the_adapter_passes_and_a_base2_lse_fails() -> None:
    """The MLA adapter on FlashInfer's convention written in plain torch (split query and
    cache, CSR pages, a base-2 LSE): it passes the mla family's own properties, and taking
    the base-2 LSE as natural (class 35) is caught."""
    from attnref.conformance import audit
    from attnref.conformance.properties import PROPERTIES

    props = [p.id for p in PROPERTIES.values() if p.families == ("mla",)]
    good = load_backend("examples.adapters.flashinfer_mla:flashinfer_reference", "mla")
    report = audit(good, properties=props, dtypes=(torch.float32,), progress=False, isolate=False)
    assert report.ok, report.format_table()
    bad = load_backend("examples.adapters.flashinfer_mla:flashinfer_lse_base2", "mla")
    report = audit(bad, properties=["mla"], dtypes=(torch.float32,), progress=False)
    assert not report.ok
