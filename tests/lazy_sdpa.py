"""torch's SDPA behind a module that imports, when a worker resolves it, a module of
torch's that neither the judge nor the forkserver imported before: what a
context-parallel worker failed on when the virtual environment lay under ``$TMPDIR``
(`tests/test_sandbox.py`)."""

import torch.fx.experimental.symbolic_shapes  # noqa: F401  (imported lazily by torch)

from tests.torch_sdpa import sdpa

__all__ = ["sdpa"]
