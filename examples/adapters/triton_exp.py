"""``tl.exp`` as a jit function of its own, for examples/adapters/confirm.py: Triton's
interpreter swaps ``triton.language``'s builtins for its own during a call, not a
module's aliases of them (``exp = tl.exp`` in fla's ``ops/op.py``, vendored by vLLM), so
a plain script puts this in the alias's place to run such a kernel interpreted at all
(attnref's worker mends the interpreter instead: ``attnref.interpreted.triton_fixes``)."""

import triton
import triton.language as tl


@triton.jit
def exp(x):  # type: ignore[no-untyped-def]
    return tl.exp(x)
