"""Adapters that let `attnref audit` call third-party attention implementations.

Each module wraps one library behind torch SDPA's signature and declares, in a
``capabilities`` attribute, what the library claims to support (docs/adapters.md). Run
from the repository root: ``attnref audit --backend examples.adapters.hf_transformers:sdpa``.
``nox -s peers`` installs every library, pinned, and audits each adapter. The helpers
they share (layouts, masks, the declaration) are public in `attnref.adapters`.
"""
