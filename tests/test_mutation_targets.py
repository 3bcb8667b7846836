"""The planted bugs of tools/property_mutations.py still find their lines.

The mutation run itself is slow (tests/test_tools.py, slow tier); this default-tier check
catches, in a second, a refactor that moved or renamed a line a mutation edits, which
would otherwise surface only as a red slow tier."""

import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutations() -> list[Any]:
    spec = importlib.util.spec_from_file_location(
        "property_mutations", ROOT / "tools" / "property_mutations.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.MUTATIONS)


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m.name)
def test_every_mutation_finds_its_line_exactly_once(mutation: Any) -> None:
    source = (ROOT / mutation.file).read_text()
    count = source.count(mutation.old)
    assert count == 1, f"{mutation.name}: {mutation.old!r} is in {mutation.file} {count} times"
    for test in mutation.tests:
        path = test.split("::")[0]
        assert (ROOT / path).is_file(), f"{mutation.name}: no test file {path}"
