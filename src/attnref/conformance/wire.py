"""What crosses between the judge and the worker: plain data, decoded by a restricted decoder.

The worker runs backend code, so every byte it sends back is untrusted. Nothing here
unpickles: a message is a JSON tree (``None``, booleans, numbers, strings, and nodes
tagged ``tuple``, ``list``, ``dict``, ``tensor``, ``unsupported``) followed by the raw
bytes of the tensors in it. `decode` rebuilds that tree and nothing else: a tensor is
made by attnref from its bytes, dtype, shape, strides and offset, so it is always a plain
strided ``torch.Tensor``, whatever the backend returned. What the worker could not
express (an object of another type, a tensor subclass, a sparse or nested tensor) arrives
as an ``unsupported`` node that names it, and `decode` raises `Rejected` with that name.

The same codec carries jobs the other way, so no pickle is used in either direction.
"""

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import re
import struct
from typing import Any

import torch
from jaxtyping import Shaped
from torch import Tensor

from attnref._checking import checked_internal

__all__ = [
    "DTYPES",
    "GUARD",
    "GUARD_BYTE",
    "MAX_DEPTH",
    "SHARED",
    "SHARED_FROM",
    "Arena",
    "Rejected",
    "broken_guards",
    "can_share",
    "decode",
    "encode",
    "encode_shared",
    "map_shared",
]

#: the tensor dtypes that may cross, by name
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,  # FP8 KV caches (FlashAttention 3's, vLLM's, FlashMLA's)
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
#: how deeply containers may nest
MAX_DEPTH = 16
_HEADER = struct.Struct("<Q")
_CUDA = re.compile(r"cuda(:[0-9]{1,3})?")


class Rejected(Exception):  # noqa: N818 (a verdict on what the backend sent)
    """A message holds something the audit does not accept; the message names it."""


def _describe(obj: object) -> str:
    kind = type(obj)
    if isinstance(obj, Tensor):
        if kind is not Tensor:
            return f"a tensor subclass {kind.__module__}.{kind.__qualname__}"
        return f"a {obj.layout} tensor".replace("torch.", "")
    return f"an object of type {kind.__module__}.{kind.__qualname__}"


@checked_internal
def _storage(t: Shaped[Tensor, "..."]) -> torch.UntypedStorage:
    """``t``'s storage, every byte of which crosses (a CPU copy of it for a tensor on a
    device)."""
    storage = t.untyped_storage()
    if t.device.type != "cpu":
        storage = storage.cpu()  # type: ignore[no-untyped-call]
    return storage


def _parts(obj: Any) -> tuple[bytes, list[torch.UntypedStorage], list[int]]:
    """``obj``'s message up to its tensors' bytes, the storages whose bytes follow, and
    their lengths."""
    blobs: list[torch.UntypedStorage] = []

    def node(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            return {"unsupported": f"containers nested deeper than {MAX_DEPTH}"}
        if x is None or isinstance(x, bool | str) or type(x) in (int, float):
            return x
        if type(x) is Tensor and x.layout == torch.strided:
            name = str(x.dtype).removeprefix("torch.")
            if name not in DTYPES:
                return {"unsupported": f"a tensor of dtype {x.dtype}"}
            blobs.append(_storage(x))
            return {
                "tensor": len(blobs) - 1,
                "dtype": name,
                "shape": list(x.shape),
                "stride": list(x.stride()),
                "offset": x.storage_offset(),
                "device": str(x.device),
            }
        if type(x) is tuple:
            return {"tuple": [node(y, depth + 1) for y in x]}
        if type(x) is list:
            return {"list": [node(y, depth + 1) for y in x]}
        if type(x) is dict:
            return {"dict": [[node(k, depth + 1), node(v, depth + 1)] for k, v in x.items()]}
        return {"unsupported": _describe(x)}

    head = json.dumps(node(obj, 0)).encode()
    lengths = [b.nbytes() for b in blobs]
    sizes = struct.pack(f"<{len(blobs)}Q", *lengths)
    return (
        b"".join([_HEADER.pack(len(head)), head, _HEADER.pack(len(blobs)), sizes]),
        blobs,
        lengths,
    )


def encode(obj: Any) -> bytearray:
    """``obj`` as a message. Tensors travel as their storage's bytes and how they view it;
    anything the codec cannot carry becomes an ``unsupported`` node naming its type."""
    return _join(*_parts(obj))


def _join(start: bytes, blobs: list[torch.UntypedStorage], lengths: list[int]) -> bytearray:
    """One buffer: ``start``, then each storage copied into it once (megabytes at the long
    sizes)."""
    out = bytearray(len(start) + sum(lengths))
    out[: len(start)] = start
    at, base = len(start), ctypes.addressof(ctypes.c_char.from_buffer(out))
    for blob, n in zip(blobs, lengths, strict=True):
        if n:
            ctypes.memmove(base + at, blob.data_ptr(), n)
        at += n
    return out


#: what starts a message whose tensors' bytes are in a shared memory file (`encode_shared`)
SHARED = b"ATTNSHM\x00"
#: the tensor bytes from which a job is sent through a shared memory file, where it can
SHARED_FROM = 2**20
_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


#: bytes kept free before and after each tensor a job carries: the worker fills them
#: with `GUARD_BYTE` and reads them back after the call (`guarded`, `broken_guards`), so
#: that a backend that wrote past the end (or before the start) of an input, or of a
#: cache it appends to, is told so, where the write would otherwise land unseen
GUARD = 64
#: what the guard bytes hold (not 0: a stray zero or a rounded 0.0 is the likeliest write)
GUARD_BYTE = 0xA5


def _aligned(lengths: list[int] | tuple[int, ...]) -> list[int]:
    """Where each tensor's bytes start in a shared file (each on a 64-byte boundary, as
    kernels may need, with `GUARD` bytes before and after it), and, last, where the file
    ends."""
    offsets, at = [], 0
    for n in lengths:
        at = -(-(at + GUARD) // 64) * 64
        offsets.append(at)
        at += n
    return [*offsets, at + GUARD]


def can_share() -> bool:
    """Whether this platform has sealed memory files (Linux 3.17 and later)."""
    return hasattr(os, "memfd_create") and all(hasattr(fcntl, s) for s in (*_SEALS, "F_ADD_SEALS"))


#: ``F_SEAL_FUTURE_WRITE`` (Linux 5.1; not in Python 3.11's fcntl): no write and no new
#: writable shared mapping from now on, while the mappings made before keep writing
_F_SEAL_FUTURE_WRITE = 0x0010


class Arena:
    """One memory file reused for every large job of one worker (`encode_shared`).

    A new file per job costs its pages anew each time (the kernel zeroes each one as the
    judge first writes it, and frees it after): a quick audit's long cases wrote 3.5 GiB
    that way, at about 2 GB/s. The arena's file is made once (again, larger, when a job
    outgrows it), mapped here for writing, and then sealed: no shrinking or growing, and
    no write or writable shared mapping made after the seal, from either side (Linux's
    ``F_SEAL_FUTURE_WRITE``). The judge writes each job through the mapping it made
    before sealing; the worker maps the file copy-on-write, as it does a one-off file.
    The judge writes a job only after the worker answered the last one (or was
    stopped), and never reads the file: what a worker does with its own mapping reaches
    nothing but its own inputs. Where the platform refuses the seal, the arena is off
    and each job gets a one-off sealed file.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._base = 0
        self.off = False

    def put(self, blobs: list[torch.UntypedStorage], lengths: list[int]) -> int | None:
        """Copy the storages into the file at `_aligned`'s offsets; a new descriptor of
        the file to send (the caller closes it), or None where the arena is off."""
        offsets = _aligned(lengths)
        if self.off:
            return None
        if self._map is None or offsets[-1] > len(self._map):
            self.close()
            # a quarter to spare, so that a run of growing jobs makes few files
            if not self._open(max(offsets[-1] * 5 // 4, 2 * 2**20)):
                return None
        for blob, n, at in zip(blobs, lengths, offsets, strict=False):
            if n:
                ctypes.memmove(self._base + at, blob.data_ptr(), n)
        assert self._fd is not None
        return os.dup(self._fd)

    def _open(self, size: int) -> bool:
        fd = os.memfd_create("attnref-jobs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        except OSError:  # no such seal here: one-off sealed files instead
            os.close(fd)
            self.off = True
            return False
        self._fd, self._map = fd, mapped
        self._base = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
        return True

    def close(self) -> None:
        """Free the file (a worker's mapping of it stays valid until it unmaps it)."""
        fd, mapped, self._fd, self._map = self._fd, self._map, None, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a view lives on: the map goes with it
                mapped.close()
        if fd is not None:
            os.close(fd)


def encode_shared(obj: Any, arena: Arena | None = None) -> tuple[bytes | bytearray, int | None]:
    """``obj`` as a message for the worker, and the sealed memory file that holds its
    tensors' bytes, or None. Where the tensors hold `SHARED_FROM` bytes or more and the
    platform has sealed memory files, the message is short (`SHARED`, then `encode`'s
    message up to the tensors' bytes) and the file holds those bytes: one copy of each
    storage (a pipe copies each byte several times, in chunks of its buffer). Otherwise
    it is `encode`'s message, and no file. ``arena``: the worker's reused file (`Arena`);
    without one, a file of this job's own.

    The file is sealed before it is sent: the worker can never write it, so it maps it
    copy-on-write (a kernel that writes its inputs writes its own pages), and nothing
    it does reaches the judge's tensors, which the file only copies.
    """
    start, blobs, lengths = _parts(obj)
    if sum(lengths) < SHARED_FROM or not can_share():
        return _join(start, blobs, lengths), None
    if arena is not None:
        fd = arena.put(blobs, lengths)
        if fd is not None:
            return SHARED + start, fd
    offsets = _aligned(lengths)  # one more than the blobs: where the file ends
    fd = os.memfd_create("attnref-job", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, offsets[-1])
        for blob, n, at in zip(blobs, lengths, offsets, strict=False):
            view = memoryview((ctypes.c_char * n).from_address(blob.data_ptr())) if n else b""
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], at + done)
        seals = 0
        for name in _SEALS:
            seals |= getattr(fcntl, name)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return SHARED + start, fd


def map_shared(fd: int) -> "mmap.mmap | bytes":
    """The bytes of a sealed memory file from `encode_shared`, mapped copy-on-write (the
    worker's side); ``fd`` is closed."""
    try:
        size = os.fstat(fd).st_size
        if not size:
            return b""
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _fill(address: int, size: int) -> None:
    """Write `GUARD_BYTE` into the `GUARD` bytes before and after ``size`` bytes at
    ``address`` (memory `decode` laid out with that room)."""
    ctypes.memset(address - GUARD, GUARD_BYTE, GUARD)
    ctypes.memset(address + size, GUARD_BYTE, GUARD)


def broken_guards(guards: dict[int, int], address: int) -> str | None:
    """Where a write outside the storage at ``address`` (one of ``guards``, `decode`'s)
    changed its guard bytes: ``"after its end"``, ``"before its start"``, or None where
    both sides hold `GUARD_BYTE` still (or ``address`` is not guarded)."""
    size = guards.get(address)
    if size is None:
        return None
    intact = bytes([GUARD_BYTE]) * GUARD
    if ctypes.string_at(address + size, GUARD) != intact:
        return "after its end"
    if ctypes.string_at(address - GUARD, GUARD) != intact:
        return "before its start"
    return None


def decode(
    data: bytes | bytearray,
    device: str | None = None,
    shared: "mmap.mmap | bytes | None" = None,
    guards: "dict[int, int] | None" = None,
) -> Any:
    """The tree ``data`` holds, built only of ``None``, ``bool``, ``int``, ``float``,
    ``str``, tuples, lists, dicts and plain strided tensors (on ``device`` if given).
    ``shared``: the tensors' bytes, where ``data`` came from `encode_shared` (its
    `SHARED` prefix removed); the tensors are views of it. ``guards``: filled with each
    CPU tensor's storage (its address: its size in bytes), whose `GUARD` bytes on each
    side hold `GUARD_BYTE` (the worker's side; `broken_guards` reads them).

    Raises:
        Rejected: the message is malformed, or names something the audit does not accept.
    """
    try:
        view = memoryview(data)
        (n,) = _HEADER.unpack_from(view, 0)
        head = json.loads(bytes(view[8 : 8 + n]))
        at = 8 + n
        (count,) = _HEADER.unpack_from(view, at)
        sizes = struct.unpack_from(f"<{count}Q", view, at + 8)
        at += 8 + 8 * count
    except (struct.error, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise Rejected(f"a malformed message ({type(e).__name__}: {e})") from None
    starts = [at]
    for size in sizes:
        starts.append(starts[-1] + size)
    if shared is not None:  # the tensors' bytes are shared's, each 64-byte aligned
        starts = _aligned(sizes)  # (a reused file, `Arena`, may be longer)
        if starts[-1] > len(shared):
            raise Rejected(f"a malformed message ({len(shared)} bytes, {starts[-1]} announced)")
    elif starts[-1] != len(data):
        raise Rejected(f"a malformed message ({len(data)} bytes, {starts[-1]} announced)")

    def tensor(x: dict[str, Any]) -> Tensor:
        index, dtype = x.get("tensor"), DTYPES.get(x.get("dtype", ""))
        shape: Any = x.get("shape")
        stride: Any = x.get("stride")
        offset: Any = x.get("offset")
        if not (type(index) is int and 0 <= index < len(sizes)) or dtype is None:
            raise Rejected(f"a tensor the audit cannot read: {str(x)[:200]}")
        dims = [shape, stride]
        if not all(type(d) is list and all(type(i) is int and i >= 0 for i in d) for d in dims):
            raise Rejected(f"a tensor with a bad shape or strides: {str(x)[:200]}")
        if len(shape) != len(stride) or type(offset) is not int or offset < 0:
            raise Rejected(f"a tensor with a bad shape, strides or offset: {str(x)[:200]}")
        item = torch.empty((), dtype=dtype).element_size()
        size = sizes[index]
        if size % item:
            raise Rejected(f"a tensor of {size} bytes, not a whole number of {dtype} elements")
        reach = offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
        if 0 not in shape and reach >= size // item:
            raise Rejected(
                f"a tensor whose view {tuple(shape)} (strides {tuple(stride)}, offset "
                f"{offset}) reaches past its {size // item} elements"
            )
        numel = 1
        for s in shape:
            numel *= s
        if numel > 2**32:
            raise Rejected(f"a tensor of {numel} elements, more than the audit reads")
        if not size:
            flat = torch.empty(0, dtype=torch.uint8)
        elif shared is not None:  # a view of the mapping, copy-on-write
            flat = torch.frombuffer(shared, dtype=torch.uint8, count=size, offset=starts[index])
            if guards is not None and isinstance(shared, mmap.mmap):  # its own pages
                _fill(flat.data_ptr(), size)
                guards[flat.data_ptr()] = size
        elif guards is None:
            flat = torch.frombuffer(
                bytearray(view[starts[index] : starts[index + 1]]), dtype=torch.uint8
            )
        else:  # the bytes between guards of their own
            room = bytearray(GUARD) + view[starts[index] : starts[index + 1]] + bytearray(GUARD)
            flat = torch.frombuffer(room, dtype=torch.uint8, count=size, offset=GUARD)
            _fill(flat.data_ptr(), size)
            guards[flat.data_ptr()] = size
        out = flat.view(dtype).as_strided(shape, stride, offset)
        where = device or x.get("device", "cpu")
        if not (where == "cpu" or (type(where) is str and _CUDA.fullmatch(where))):
            raise Rejected(f"a tensor on an unknown device {str(where)[:50]!r}")
        return out if where == "cpu" else out.to(where)

    def build(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 1:
            raise Rejected(f"containers nested deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if type(x) is not dict or len(x) < 1:
            raise Rejected(f"a malformed message node: {str(x)[:200]}")
        if "unsupported" in x:
            raise Rejected(str(x["unsupported"])[:300])
        if "tensor" in x:
            return tensor(x)
        ((tag, items),) = x.items() if len(x) == 1 else ((None, None),)
        if type(items) is not list:
            raise Rejected(f"a malformed message node: {str(x)[:200]}")
        if tag == "tuple":
            return tuple(build(y, depth + 1) for y in items)
        if tag == "list":
            return [build(y, depth + 1) for y in items]
        if tag == "dict":
            if not all(type(p) is list and len(p) == 2 for p in items):
                raise Rejected(f"a malformed dict: {str(x)[:200]}")
            pairs = [(build(k, depth + 1), build(v, depth + 1)) for k, v in items]
            if not all(isinstance(k, str | int | float | bool) or k is None for k, _ in pairs):
                raise Rejected("a dict whose keys are not strings or numbers")
            return dict(pairs)
        raise Rejected(f"a malformed message node: {str(x)[:200]}")

    return build(head, 0)
