"""Kernels of GPU languages run on a CPU, through their own interpreters.

A backend that declares ``Capabilities(interpreter="triton")`` (or ``"pallas"``) runs its
kernel's own code, launched as on a device, in its worker: Triton's interpreter
(``TRITON_INTERPRET=1``) or JAX's Pallas in interpret mode on JAX's CPU platform
(the kernel's launcher passes ``interpret=True``). This
module is what the worker does about it, before the backend's module is imported
(`prepare`):

- it sets the interpreter's environment, with every cache it writes in the worker's
  scratch folder (nothing written outside it);
- it makes Triton's autotuning run, for each call, the first configuration that the
  kernel's own ``prune_configs_by`` keeps (the interpreter has no benchmarker:
  ``@triton.autotune`` with several configurations fails), and says which;
- it checks the interpreter itself, on a kernel of attnref's own known to be right
  (`attnref.interpreted.triton_flash`), in every dtype: a dtype the interpreter computes
  wrong is left out of the audit, with the error measured (Triton 3.9's interpreter
  multiplies bfloat16 tiles into garbage), so that a kernel is never blamed for its
  interpreter; where the check fails in every dtype, nothing is judged;
- it makes Triton's interpreter compute bfloat16 as a device does, and a module-level
  ``constexpr`` combined with a tensor as compiling does (`attnref.interpreted.
  triton_fixes`: Triton 3.9's interpreter gets both wrong), and says so.

What an interpreter runs is the kernel's logic: its indices, masks, alignments, page and
split boundaries, descales and merges, as on every device. What it cannot show is said in
the report (`Interpreter.not_judged`): races between programs, a device's own numerics
(its fused multiply-adds, its tensor cores' rounding), memory ordering, and speed.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INTERPRETERS",
    "INTERPRETER_VARIABLE",
    "Interpreter",
    "autotuned",
    "prepare",
    "record",
]

#: names the interpreter of a backend given by its spec, in the judge's environment
#: (``attnref audit --interpreter``): its worker sets it up before the module's import
#: (a module that fails to import uninterpreted cannot say so itself)
INTERPRETER_VARIABLE = "ATTNREF_INTERPRETER"


@dataclass(frozen=True)
class Interpreter:
    """One interpreter: its environment, its caches, what it does not judge, and the
    work per call a kernel under it may do when it declares none."""

    name: str
    #: the package whose kernels it runs (its version goes in the report)
    package: str
    #: set before the backend's module is imported
    env: tuple[tuple[str, str], ...]
    #: variables naming folders it writes to: each is pointed into the scratch folder
    caches: tuple[str, ...]
    #: what running interpreted on a CPU cannot show
    not_judged: str
    #: `Capabilities.max_call_work` where the backend declares none
    default_work: int
    #: the checks of itself, in the worker, after `env` (`self_check`)
    check: Callable[[], dict[str, Any]]


def _triton_check() -> dict[str, Any]:
    from attnref.interpreted.checks import triton_self_check

    return triton_self_check()


def _pallas_check() -> dict[str, Any]:
    from attnref.interpreted.checks import pallas_self_check

    return pallas_self_check()


_NOT_JUDGED = (
    "it ran interpreted on a CPU: its logic is judged (indices, masks, alignments, tile, "
    "page and split boundaries, descales, merges); not judged are races between its "
    "programs, a GPU's own numerics (fused multiply-adds, tensor-core rounding), memory "
    "ordering and speed"
)

INTERPRETERS: dict[str, Interpreter] = {
    "triton": Interpreter(
        "triton",
        "triton",
        env=(("TRITON_INTERPRET", "1"),),
        caches=("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR"),
        not_judged=_NOT_JUDGED,
        # attnref's own kernel (16 x 16 tiles, head dim 64): 1.2 s at 2**23, B=1, h=4,
        # T=128 (2 cores, quiet); at 2**21 its quick audit took 15.6 min (with another
        # audit beside it), large_index and wide grids the most of it
        default_work=2**20,
        check=_triton_check,
    ),
    "pallas": Interpreter(
        "pallas",
        "jax",
        # not JAX_ENABLE_X64: it changes what a kernel computes (Pallas' flash kernel
        # fails to trace under it: int32 program ids against int64 constants), and a
        # kernel that takes float64 enables it itself
        env=(("JAX_PLATFORMS", "cpu"),),
        caches=("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"),
        not_judged=_NOT_JUDGED,
        default_work=2**20,
        check=_pallas_check,
    ),
}


def environment(name: str, scratch: str) -> dict[str, str]:
    """What interpreter ``name`` needs in the environment, its caches in ``scratch``."""
    interpreter = INTERPRETERS[name]
    env = dict(interpreter.env)
    for var in interpreter.caches:
        folder = os.path.join(scratch, "interpreter", var.lower())
        os.makedirs(folder, exist_ok=True)
        env[var] = folder
    return env


#: the autotuned kernels in this process, as `autotuned` says them
PINNED: list[dict[str, Any]] = []


def _pin_autotune() -> None:
    """Every Triton ``Autotuner`` runs, for each key, the first of its configurations that
    the kernel's own ``prune_configs_by`` keeps for that call: the interpreter cannot
    time them (Triton 3.9: no benchmarker), and the tile decides what a kernel does on
    short or odd lengths, so the one a device would never pick for a short sequence is
    not the one audited. The pin is made where every autotuner is built, the class's
    ``__init__``: a library that builds its own subclass without ``triton.autotune``
    (fla's ``CachedAutotuner``) is pinned too. `PINNED` records each kernel, its
    configurations and the first; `autotuned` says them for the report."""
    import triton.runtime.autotuner as autotuner

    cls = autotuner.Autotuner
    if getattr(cls, "_attnref_pinned", False):
        return
    original = cls.__init__

    def __init__(self: Any, fn: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, fn, *args, **kwargs)
        _first_kept(self)
        prunes = kwargs.get("prune_configs_by", args[7] if len(args) > 7 else None)
        base = getattr(fn, "fn", fn)  # a heuristics or jit wrapper: the kernel it wraps
        PINNED.append(
            {
                "kernel": str(getattr(base, "__name__", repr(base)))[:100],
                "configs": len(self.configs),
                "first": str(self.configs[0])[:300] if self.configs else "",
                "pruned": bool(prunes),
            }
        )

    cls.__init__ = __init__
    cls._attnref_pinned = True


def _first_kept(tuner: Any) -> None:
    """``tuner`` (a Triton ``Autotuner``) timed by its configurations' order, not run:
    the first that its pruning keeps for a key wins, and only it runs. A pruning that
    raises on a CPU (a performance model asking the device's properties) keeps the first
    configuration."""
    order = {config: i for i, config in enumerate(tuner.configs)}
    tuner._bench = lambda *args, config, **kwargs: [float(order[config])] * 3
    prune = tuner.prune_configs

    def pruned(kwargs: dict[str, Any]) -> list[Any]:
        try:
            return list(prune(kwargs))
        except Exception:
            return list(tuner.configs[:1])

    tuner.prune_configs = pruned


#: the most autotuned kernels the worker names to the judge (fla imports more than 50)
AUTOTUNED_NAMED = 50


def autotuned() -> list[dict[str, Any]]:
    """The autotuned kernels this process imported (`PINNED`), the first
    `AUTOTUNED_NAMED` of them: each one's name, its configurations' count, the first,
    and whether it prunes them per call. A library that imports more (fla-core 0.6.0
    imports over 50 autotuned kernels with its gated delta rule) is still audited: the
    report names the first ones."""
    return [dict(x) for x in PINNED[:AUTOTUNED_NAMED]]


def _configure_jax() -> None:
    """JAX on its CPU platform: set through its configuration as well as its
    environment, since JAX may be imported already (jaxtyping imports it, where it is
    installed, when attnref's shape-checked functions are defined); its backends start
    on first use, after this."""
    import jax

    config: Any = jax.config
    config.update("jax_platforms", "cpu")


def prepare(name: str, scratch: str) -> dict[str, Any]:
    """In the worker, before the backend's module is imported: interpreter ``name``'s
    environment (caches in ``scratch``), autotuning pinned, and its check of itself.
    Returns what the report says of it: ``{"interpreter", "version", "not_judged",
    "dtypes_out": {dtype: why}, "checked": {dtype: error}}``; an interpreter that is not
    installed, or fails its check in every dtype, is said in ``"error"``."""
    interpreter = INTERPRETERS[name]
    os.environ.update(environment(name, scratch))
    said: dict[str, Any] = {"interpreter": name, "not_judged": interpreter.not_judged}
    try:
        from importlib.metadata import version

        said["version"] = version(interpreter.package)
    except Exception:
        said["error"] = (
            f"the {name} interpreter needs the {interpreter.package!r} package, which is not "
            f"installed here (pip install 'attnref[interpret]')"
        )
        return said
    try:
        if name == "triton":
            _pin_autotune()
            from attnref.interpreted.triton_fixes import PATCHED, fix

            fix()
            said["patched"] = PATCHED
        if name == "pallas":
            _configure_jax()
        said.update(interpreter.check())
    except Exception as e:  # the interpreter's, before any code of the backend's ran
        said["error"] = f"{name}'s interpreter failed attnref's check of itself: {e!r}"[:500]
    return said


def record(value: object) -> dict[str, Any]:
    """What `prepare` said, as the judge reads it from the worker: its known fields,
    each of its type (the worker's first frame, sent before the backend loaded).

    Raises:
        ValueError: a field of the wrong type, or unknown.
    """
    if not isinstance(value, dict):
        raise ValueError(f"a dict, got {type(value).__name__}")
    texts = ("interpreter", "version", "not_judged", "patched", "error")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in texts and isinstance(item, str):
            out[key] = item[:1000]
        elif (
            key == "dtypes_out"
            and isinstance(item, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in item.items())
        ):
            out[key] = {k: v[:300] for k, v in item.items()}
        elif (
            key == "checked"
            and isinstance(item, dict)
            and all(isinstance(k, str) and isinstance(v, float) for k, v in item.items())
        ):
            out[key] = dict(item)
        elif key == "autotuned" and isinstance(item, list) and len(item) <= AUTOTUNED_NAMED:
            out[key] = [_autotuned_entry(x) for x in item]
        else:
            raise ValueError(f"field {key!r}: {str(item)[:80]}")
    return out


def _autotuned_entry(value: object) -> dict[str, Any]:
    """One kernel of `autotuned`, as the judge reads it (the worker's word: checked)."""
    if (
        not isinstance(value, dict)
        or set(value) != {"kernel", "configs", "first", "pruned"}
        or not isinstance(value["kernel"], str)
        or not isinstance(value["first"], str)
        or type(value["configs"]) is not int
        or type(value["pruned"]) is not bool
    ):
        raise ValueError(f"an autotuned kernel: {str(value)[:80]}")
    return {
        "kernel": value["kernel"][:100],
        "configs": value["configs"],
        "first": value["first"][:300],
        "pruned": value["pruned"],
    }
