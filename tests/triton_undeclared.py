"""A Triton kernel whose module sets up Triton's interpreter itself and does not declare
it (``interpreter=""``), as a user's first try often does: the worker tells, and audits
it as interpreted (``tests.triton_undeclared:flash``, ``--api flash``)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as its docs say

from dataclasses import replace
from typing import Any

from tests.planted_triton import CLAIMS, right


def flash(*args: Any, **kwargs: Any) -> Any:
    """attnref's Triton flash kernel, its interpreter set up by this module."""
    return right(*args, **kwargs)


flash.capabilities = replace(CLAIMS, interpreter="")  # type: ignore[attr-defined]
