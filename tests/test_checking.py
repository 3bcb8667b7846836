"""One runtime-checking mechanism covers the whole package, and it can be switched off."""

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from jaxtyping import AbstractArray, TypeCheckError
from torch import Tensor, nn

import attnref
from attnref import functional as F
from attnref._checking import CHECKED_ATTR, checking_enabled, set_checking

#: the optional extras some modules import (attnref.interpreted's Triton kernels need
#: the interpret extra): a module that needs one not installed here is left out
OPTIONAL = ("triton", "jax")


def _modules() -> Iterator[types.ModuleType]:
    yield attnref
    for info in pkgutil.walk_packages(attnref.__path__, prefix="attnref."):
        if info.name == "attnref.__main__":
            continue
        try:
            yield importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if e.name not in OPTIONAL:
                raise


def _annotations(fn: Callable[..., Any]) -> list[object]:
    sig = inspect.signature(inspect.unwrap(fn))
    return [p.annotation for p in sig.parameters.values()] + [sig.return_annotation]


def _flatten(annotation: object) -> Iterator[object]:
    yield annotation
    for arg in typing.get_args(annotation):
        yield from _flatten(arg)


def _is_tensor_type(t: object) -> bool:
    return t is Tensor or (isinstance(t, type) and issubclass(t, AbstractArray))


def _public_tensor_functions() -> Iterator[tuple[str, Callable[..., Any]]]:
    for module in _modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj
            elif inspect.isclass(obj) and issubclass(obj, nn.Module):
                yield f"{module.__name__}.{name}.forward", obj.forward


FUNCTIONS = list(_public_tensor_functions())


def test_the_walk_finds_the_package() -> None:
    names = {n for n, _ in FUNCTIONS}
    assert "attnref.functional.scaled_dot_product_attention" in names
    assert "attnref.layers.attention.MultiHeadAttention.forward" in names


@pytest.mark.parametrize(("name", "fn"), FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_every_public_tensor_function_is_checked(name: str, fn: Callable[..., Any]) -> None:
    types_used = [t for a in _annotations(fn) for t in _flatten(a)]
    if not any(_is_tensor_type(t) for t in types_used):
        return  # takes and returns no tensor
    assert getattr(fn, CHECKED_ATTR, False), f"{name} takes or returns a tensor but is unchecked"
    bare = [t for t in types_used if t is Tensor]
    assert not bare, f"{name} annotates a bare Tensor: declare its dtype and shape"


def test_wrong_shape_names_the_argument() -> None:
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(TypeCheckError, match="parameter 'key'"):
        F.scaled_dot_product_attention(q, torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 8))


def test_wrong_dtype_names_the_argument() -> None:
    with pytest.raises(TypeCheckError, match="parameter 'valid_lens'"):
        F.masked_softmax(torch.randn(2, 3, 4), torch.tensor([1.5, 2.0]))


def test_checking_can_be_switched_off_and_on() -> None:
    bad = (torch.randn(2, 5, 8), torch.randn(2, 7, 4), torch.randn(2, 7, 8))
    assert checking_enabled()
    set_checking(False)
    try:
        assert not checking_enabled()
        with pytest.raises(RuntimeError):  # torch's own error now, not the checker's
            F.scaled_dot_product_attention(*bad)
    finally:
        set_checking(True)
    with pytest.raises(TypeCheckError):
        F.scaled_dot_product_attention(*bad)


def test_the_suite_checks_private_helpers_too() -> None:
    from attnref._checking import CHECK_INTERNALS

    assert CHECK_INTERNALS, "tests/conftest.py sets ATTNREF_CHECK_INTERNALS=1 before import"
    assert getattr(F._softmax_rows, CHECKED_ATTR, False)
    with pytest.raises(TypeCheckError, match="parameter 'scores'"):
        F._softmax_rows(torch.ones(3, 4, dtype=torch.int64), None)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"JAXTYPING_DISABLE": "1"}, "checking=False internals=False"),
        # a Python importing torch each (3 s): the slow tier reads the other two
        pytest.param(
            {"ATTNREF_CHECK_INTERNALS": "0"},
            "checking=True internals=False",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"ATTNREF_CHECK_INTERNALS": "1"}, "checking=True internals=True", marks=pytest.mark.slow
        ),
    ],
)
def test_environment_switches(env: dict[str, str], expected: str) -> None:
    code = (
        "import attnref, attnref.functional as F; "
        "print(f'checking={attnref.checking_enabled()} '"
        "f'internals={hasattr(F._softmax_rows, \"__attnref_checked__\")}')"
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAXTYPING_DISABLE", "ATTNREF_CHECK_INTERNALS")
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == expected


def test_an_audit_s_worker_checks_as_its_judge_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge runs an audit unchecked (unless ``ATTNREF_CHECK_JUDGE=1``), and so does
    the worker, even one started while checking was still on (the CLI starts it first,
    to read the declaration): its harness costs per call what the judge's does."""
    from attnref.conformance import audit
    from attnref.conformance.executors import start_executor

    spec = "tests.torch_sdpa:sdpa_unless_checked"
    assert checking_enabled()
    for judge, status in (("0", "pass"), ("1", "fail")):
        monkeypatch.setenv("ATTNREF_CHECK_JUDGE", judge)
        executor = start_executor(spec)
        try:
            report = audit(
                executor.backend, properties=["forward"], dtypes=[torch.float32], executor=executor
            )
        finally:
            executor.close()
        (result,) = report.results
        assert result.status == status, (judge, result.message)
        if status == "fail":
            assert "shape checking is on" in result.message
