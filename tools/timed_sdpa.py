"""torch's SDPA, timing itself: how long the backend's own calls take in an audit.

`tools/audit_split.py` audits this backend and reads the total back, to report the
judge's share of an audit (wall time against the time inside the backend's calls, summed
in the worker). The figure is measured in the backend's process: it is the backend's
word, used here only to size the judge against an honest kernel, never in a verdict.
With ``ATTNREF_TIMED_SDPA`` set, each call prints its worker's running total on the
audit's standard output (``TIMED_SDPA tag calls seconds``, the tag drawn when the worker
imports this module: workers in PID namespaces of their own share process ids, and an
audit with ``--jobs`` has several): the worker's sandbox lets it write no file outside
its scratch folder.
"""

import os
import time
from typing import Any

import torch

_TOTAL = [0.0, 0]
_TAG = os.urandom(6).hex()  # this worker's, apart from every other's


def sdpa(*args: Any, **kwargs: Any) -> Any:
    """torch.nn.functional.scaled_dot_product_attention, its time added to a file."""
    t0 = time.perf_counter()
    out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    _TOTAL[0] += time.perf_counter() - t0
    _TOTAL[1] += 1
    if os.environ.get("ATTNREF_TIMED_SDPA"):  # one write: lines of two workers never mix
        os.write(1, f"TIMED_SDPA {_TAG} {_TOTAL[1]} {_TOTAL[0]:.6f}\n".encode())
    return out


def _declare() -> None:
    from attnref.conformance import Capabilities

    # as the torch-sdpa built-in is declared (torch raises on is_causal with a mask):
    # the same calls, so that its time compares with the built-in's audit
    sdpa.capabilities = Capabilities(causal_with_mask=False)  # type: ignore[attr-defined]


_declare()
