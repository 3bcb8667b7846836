"""Dtype names and the default device: one table for every entry point.

The command line, the pytest plugin, the benchmark harness and the tools name dtypes the
same way (``float32``, ``bfloat16``, ...) and pick the same default device, from here.
"""

import torch

__all__ = ["DTYPES", "best_device", "dtype_name", "parse_dtype"]

#: every dtype attnref computes in, by the name the command line takes
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; a clear error for any other name.

    Raises:
        ValueError: a name that is not in `DTYPES`.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def best_device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
