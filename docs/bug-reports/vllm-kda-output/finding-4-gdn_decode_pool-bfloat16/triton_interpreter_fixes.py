"""Two steps of Triton's interpreter (3.9) done as the compiled kernel does them.

**bfloat16, computed as a GPU computes it.**

Triton 3.9's interpreter keeps a bfloat16 value as its raw 16 bits in a NumPy ``uint16``
array (NumPy has no bfloat16), and its arithmetic, ``tl.dot`` included, then works on
those bits as integers: ``x * y`` and a dot of bfloat16 tiles come out as garbage (errors
of 8e8 in SGLang's decode). A float32 value cast to bfloat16 is truncated, where a GPU's
cast (``.to(tl.bfloat16)``, whose default rounding is round-to-nearest-even) rounds.

`fix` replaces those four steps of the interpreter, in the worker's process only, by what
the device does: a binary or unary operation on bfloat16 computes in float32 (exact for a
product or a sum of two bfloat16 values, then rounded once: the correctly rounded
result), a dot reads its bfloat16 tiles as float32 and accumulates in its accumulator's
dtype, and a cast to bfloat16 rounds to nearest even. The interpreter's own check of
itself (`attnref.interpreted.checks`) then decides, as for every dtype, whether bfloat16
is judged. Nothing else of the interpreter changes.

Weighed against the alternative, leaving bfloat16 out of every Triton audit: the
production kernels of DeepSeek's sparse attention (SGLang's ``triton_sparse_mla``) take
and return bfloat16 only, so without this they could not be audited at all.

**A module-level ``tl.constexpr`` combined with a tensor.** A kernel that writes ``_G =
tl.constexpr(128)`` at module level and ``(_G + g)[None, :]`` inside (SGLang's sparse MLA
kernels) is compiled with ``_G`` a constant; the interpreter runs the Python function as
it is, where ``constexpr.__add__`` wraps the tensor ``128 + g`` in a ``constexpr``, and
indexing that fails. `fix` makes such arithmetic return the tensor, as compiling does.

**A loop's variable.** In ``for i in range(n)`` (or ``tl.range``) the compiled kernel's
``i`` is a tensor (an ``scf.for`` induction variable), so ``i.to(tl.int64)`` is valid
Triton (fla's ``chunk_gated_delta_rule_fwd_kernel_h``); the interpreter runs the Python
loop, where ``i`` is an ``int`` without ``.to``, and the kernel would fail with an
``AttributeError`` a device never raises. `fix` rewrites such a loop, as the interpreter
already rewrites assignments, to give its variable as a tensor; ``tl.static_range``'s,
a constant when compiled, stays an ``int``.

**A builtin under a name of the kernel's module.** ``exp = tl.exp`` at module level, and
``exp(b_g)`` in the kernel (fla's ``ops/op.py``, vendored by vLLM and SGLang), compiles
as ``tl.exp``; the interpreter makes ``triton.language``'s builtins callable by replacing
the module's attributes for the call, so the alias still names the builtin as it was,
which raises "Did you forget to add @triton.jit?". `fix` gives such names, in the
kernel's module (and a device function's), the interpreter's version too, and restores
them with the rest after the call.
"""

import ast
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["PATCHED", "fix", "to_bfloat16_bits", "to_float32"]

#: what `fix` changes, as the report says it
PATCHED = (
    "bfloat16 computed as on a device (Triton's interpreter works on the raw bits): "
    "operations in float32 rounded once, dots accumulated in float32, casts by value "
    "rounded to nearest even, sums, cumulative sums and min/max over the values in "
    "float32 rounded once; a module-level constexpr combined with a tensor gives the tensor; "
    "a range loop's variable is a tensor; a module's alias of a triton.language builtin "
    "(exp = tl.exp) is called as the builtin"
)

#: the arithmetic of ``tl.constexpr`` that `fix` lets return a tensor
_CONSTEXPR_OPS = ("add", "sub", "mul", "mod", "truediv", "floordiv")


def to_float32(bits: Any) -> Any:
    """bfloat16 values kept as ``uint16`` bits, as float32 (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def to_bfloat16_bits(x: Any) -> Any:
    """float32 values rounded to the nearest bfloat16 (ties to even), as ``uint16`` bits;
    NaN stays NaN, an overflow is infinity."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(x)
    quiet = (bits >> 16) | np.uint32(0x40)
    return np.where(nan, quiet, rounded).astype(np.uint16).reshape(x.shape)


def fix() -> bool:
    """Patch the interpreter of the ``triton`` package imported here (module docstring).
    Returns False where it was already patched."""
    import triton.language as tl
    from triton.runtime import interpreter

    _fix_constexpr(tl)
    _fix_loop_variables(interpreter)
    _fix_builtin_aliases(interpreter, tl)

    builder: Any = interpreter.InterpreterBuilder
    if getattr(builder, "_attnref_bfloat16", False):
        return False
    handle = interpreter.TensorHandle
    bitwise = {np.bitwise_and, np.bitwise_or, np.bitwise_xor, np.left_shift, np.right_shift}

    def is_bf16(x: Any) -> bool:
        return bool(getattr(x.dtype, "scalar", x.dtype) == tl.bfloat16)

    binary, unary, dot, cast = (
        builder.binary_op,
        builder.unary_op,
        builder.create_dot,
        builder.cast_impl,
    )

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if is_bf16(lhs) and is_bf16(rhs) and op not in bitwise:
            out = op(to_float32(lhs.data), to_float32(rhs.data))
            if out.dtype != np.bool_:
                out = to_bfloat16_bits(out)
            return handle(out, lhs.dtype.scalar)
        return binary(self, lhs, rhs, op)

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        if is_bf16(arg):
            return handle(to_bfloat16_bits(op(to_float32(arg.data))), arg.dtype.scalar)
        return unary(self, arg, op)

    def create_dot(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
        if is_bf16(a) or is_bf16(b):
            a = handle(to_float32(a.data), tl.float32) if is_bf16(a) else a
            b = handle(to_float32(b.data), tl.float32) if is_bf16(b) else b
        return dot(self, a, b, d, *rest)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        source, target = src.dtype.scalar, dst_type.scalar
        if source == tl.float32 and target == tl.bfloat16:
            return handle(to_bfloat16_bits(src.data), target)
        if source == tl.bfloat16 and target == tl.float32:
            return handle(to_float32(src.data), target)
        if target == tl.bfloat16 and source != tl.bfloat16:  # an index, a half: by value
            return handle(to_bfloat16_bits(np.asarray(src.data, dtype=np.float32)), target)
        if source == tl.bfloat16 and target != tl.bfloat16 and not dst_type.is_ptr():
            return cast(self, handle(to_float32(src.data), tl.float32), dst_type)
        return cast(self, src, dst_type)

    builder.binary_op = binary_op
    builder.unary_op = unary_op
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    _fix_reductions(interpreter, is_bf16)
    builder._attnref_bfloat16 = True
    return True


def _fix_reductions(interpreter: Any, is_bf16: Callable[[Any], bool]) -> None:
    """``tl.sum``, ``tl.cumsum``, ``tl.cumprod`` and the min/max/argmin/argmax fast paths
    over bfloat16: the interpreter ran NumPy's reductions on the raw bits (a sum of
    -35.3 came out as 2.4e34, or 0.0): each now reduces the values in float32 and rounds
    the result to bfloat16 once (a GPU rounds each step of its tree; the difference is
    within the bfloat16 rounding the oracle's bound allows for the kernel's sums)."""
    reduce_ops, scan_ops = interpreter.ReduceOps, interpreter.ScanOps

    def in_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
        def apply(data: Any, *args: Any, **kwargs: Any) -> Any:
            return to_bfloat16_bits(np.asarray(fn(to_float32(data), *args, **kwargs)))

        return apply

    reduce_sum, min_max = reduce_ops.sum, reduce_ops.min_max
    cumsum, cumprod = scan_ops.cumsum, scan_ops.cumprod

    def sum_(self: Any, input: Any) -> Any:
        if not is_bf16(input):
            return reduce_sum(self, input)
        total = in_float32(np.sum)(input.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(total, input.dtype)

    def min_max_(self: Any, input: Any, val_reduce_op: Any, idx_reduce_op: Any = None) -> Any:
        data = input[0] if isinstance(input, tuple) else input
        if not is_bf16(data):
            return min_max(self, input, val_reduce_op, idx_reduce_op)
        values = to_float32(data.handle.data)
        val = idx = None
        if val_reduce_op:
            bits = to_bfloat16_bits(
                np.asarray(val_reduce_op(values, axis=self.axis, keepdims=self.keep_dims))
            )
            val = self.to_tensor(bits, data.dtype)
        if idx_reduce_op:
            found = idx_reduce_op(values, axis=self.axis, keepdims=self.keep_dims)
            idx = self.to_tensor(found, interpreter.tl.int32)
        if val is not None and idx is not None:
            return val, idx
        return val if val is not None else idx

    def scan(original: Any, op: Any) -> Any:
        def method(self: Any, input: Any) -> Any:
            if not is_bf16(input):
                return original(self, input)
            return [self.to_tensor(in_float32(op)(input.handle.data, axis=self.axis), input.dtype)]

        return method

    reduce_ops.sum, reduce_ops.min_max = sum_, min_max_
    scan_ops.cumsum, scan_ops.cumprod = scan(cumsum, np.cumsum), scan(cumprod, np.cumprod)


def _fix_constexpr(tl: Any) -> None:
    """``constexpr <op> tensor`` (and the reflected forms) returns the tensor."""
    cls = tl.constexpr
    if getattr(cls, "_attnref_tensors", False):
        return
    for name in _CONSTEXPR_OPS:
        for dunder in (f"__{name}__", f"__r{name}__"):
            original = getattr(cls, dunder, None)
            if original is None:
                continue

            def method(self: Any, other: Any, _original: Any = original, _d: str = dunder) -> Any:
                raw = other.value if isinstance(other, cls) else other
                if isinstance(raw, tl.tensor):
                    return getattr(raw, _d.replace("__r", "__", 1) if _d.startswith("__r")
                                   else _d.replace("__", "__r", 1))(self.value)  # fmt: skip
                return _original(self, other)

            setattr(cls, dunder, method)
    cls._attnref_tensors = True


def _dynamic_range(it: ast.expr) -> bool:
    """Whether a loop iterates ``range(...)`` or ``tl.range(...)`` (not ``static_range``)."""
    if not isinstance(it, ast.Call):
        return False
    f = it.func
    return (isinstance(f, ast.Name) and f.id == "range") or (
        isinstance(f, ast.Attribute) and f.attr == "range"
    )


def _fix_loop_variables(interpreter: Any) -> None:
    """``for i in range(n)``: ``i`` given to the body as a tensor (module docstring)."""
    cls = interpreter.ASTTransformer
    if getattr(cls, "_attnref_loops", False):
        return

    def visit_For(self: Any, node: ast.For) -> ast.For:  # noqa: N802 (ast's visitor name)
        node = self.generic_visit(node)
        if _dynamic_range(node.iter) and isinstance(node.target, ast.Name):
            name = node.target.id
            to_tensor = ast.Attribute(
                value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                attr="to_tensor",
                ctx=ast.Load(),
            )
            call = ast.Call(
                func=to_tensor,
                args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                keywords=[],
            )
            convert = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=call)
            node.body.insert(0, ast.copy_location(convert, node))
        return node

    cls.visit_For = visit_For
    cls._attnref_loops = True


def _fix_builtin_aliases(interpreter: Any, tl: Any) -> None:
    """A kernel's global that is a ``triton.language`` builtin (``exp = tl.exp``) called
    as the interpreter calls the builtin itself, for as long as the call (module
    docstring)."""
    if getattr(interpreter, "_attnref_aliases", False):
        return
    original = interpreter._patch_lang

    def patch_lang(fn: Any) -> Any:
        scope = original(fn)
        names = fn.__globals__
        aliases = [(n, m) for n, m in list(names.items()) if tl.core.is_builtin(m)]
        for name, member in aliases:

            def called(*args: Any, _member: Any = member, **kwargs: Any) -> Any:
                kwargs = {k: v for k, v in kwargs.items() if k != "_semantic"}
                return _member(*args, **kwargs, _semantic=interpreter.interpreter_semantic)

            names[name] = called
        restore = scope.restore

        def restore_all() -> None:
            for name, member in aliases:
                names[name] = member
            restore()

        scope.restore = restore_all
        return scope

    interpreter._patch_lang = patch_lang
    interpreter._attnref_aliases = True
