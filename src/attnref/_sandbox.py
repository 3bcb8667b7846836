"""The sandbox a worker enters before it loads backend code (Linux; docs/untrusted.md).

Torch-free, and nothing but the standard library: the forkserver imports it, and a
worker calls `enter` first thing, while it is still one thread and no byte of the
backend's has run. What it enforces, each where the kernel offers it:

- **files** (Landlock, ABI 1): everything may be read and executed; only the worker's
  own scratch folder may be written (its ``TMPDIR`` and ``HOME``, and every compiler
  cache pointed there), its own ``/proc/<pid>`` (CUDA names its threads there), and the
  character devices of ``/dev`` (``/dev/null``, a GPU's) written and, from ABI 5,
  driven by ``ioctl``. The judge's installation, the report's folder, the working folder
  and site-packages are out of reach; so is mounting.
- **signals** (Landlock's scopes, ABI 6): no signal to a process outside the sandbox (the
  judge, the forkserver, other workers); no connection to an abstract UNIX socket made
  outside it. Tracing a process outside it is refused from ABI 1.
- **network** (seccomp): no new socket of any kind (``socket(2)``, and ``io_uring``, which
  could make one), so no connection to a loopback port, to the forkserver's socket, or to
  any other service of the machine; Landlock's TCP rules (ABI 4) say the same. A policy
  with ``network=True`` (the context-parallel family, whose ranks meet over TCP) leaves
  sockets open, and the report says so.
- **processes** (seccomp, and a PID namespace where the kernel lets an unprivileged
  process make one): the worker and whatever it starts stay in one process group
  (``setsid`` and ``setpgid`` are refused) that the judge kills when it stops the
  worker; in a PID namespace of their own, the worker is its first process, and when it
  ends, however it ends, the kernel kills every process in it. There it gets a ``/proc``
  of its namespace's own.
- **shared memory** (a mount namespace, private): a tmpfs of its own on ``/dev/shm``, so
  that POSIX semaphores work without the machine's ``/dev/shm``.

Why not a library: PyPI's ``landlock`` (1.0.0.dev5, alpha, May 2025) covers files only,
not the network rules or the scopes; seccomp and namespaces need a few system calls
more. This module is those calls, through ctypes, with a test for each.
"""

import contextlib
import ctypes
import errno
import os
import platform
import stat
import struct
import sys
from dataclasses import dataclass, field

from attnref._dies_with_parent import die_with_parent

__all__ = ["NO_SANDBOX", "PARTS", "Enforced", "Policy", "enter", "landlock_abi", "scratch_env"]

# ------------------------------------------------------------------ Landlock (uapi)

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # every arch
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

_PR_SET_NO_NEW_PRIVS = 38

# ------------------------------------------------------------------ seccomp (uapi)

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
#: x86-64's x32 system calls: the same architecture id, their numbers with this bit set
_X32_SYSCALL_BIT = 0x40000000
#: per architecture: its audit id, and the numbers of socket, setsid, setpgid, io_uring_setup
_ARCHES = {
    "x86_64": (0xC000003E, {"socket": 41, "setsid": 112, "setpgid": 109, "io_uring": 425}),
    "aarch64": (0xC00000B7, {"socket": 198, "setsid": 157, "setpgid": 154, "io_uring": 425}),
}

# ------------------------------------------------------------------ namespaces

_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNS = 0x10000000, 0x20000000, 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 1 << 14, 1 << 18
#: where POSIX shared memory and semaphores live (glibc's ``shm_open``, ``sem_open``)
SHM = "/dev/shm"

#: the variables that point a worker's writes at its scratch folder: temporary files, the
#: home folder, and the caches of the compilers a kernel may use
SCRATCH_VARIABLES = (
    "TMPDIR",
    "HOME",
    "XDG_CACHE_HOME",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TRITON_HOME",
    "CUDA_CACHE_PATH",
    "PYTHONPYCACHEPREFIX",
    "NUMBA_CACHE_DIR",
    "MPLCONFIGDIR",
)


#: set to 1 in the judge's environment, the workers enter no sandbox; set to some of
#: `PARTS`, comma-separated, they enter it without those (a way around a platform where
#: a part breaks a kernel: a driver that needs a file, a call or a namespace the sandbox
#: refuses; ``tools/sandbox_probe.py`` finds which). The report lists what was switched
#: off as missing, and ``--require-sandbox`` refuses it
NO_SANDBOX = "ATTNREF_NO_SANDBOX"

#: the parts of the sandbox, as the report names them and `NO_SANDBOX` switches them off
PARTS = ("lifetime", "processes", "network", "files", "signals")


@dataclass(frozen=True)
class Policy:
    """What a worker's sandbox allows beyond its scratch folder: ``network`` (sockets, for
    a family whose processes talk to each other), and with it ``unix`` (UNIX sockets too:
    NCCL's, on a GPU host; otherwise ``socket(AF_UNIX)`` is refused, and with it every
    pathname socket a Landlock before ABI 8 cannot fence off); ``off``: no sandbox at
    all; ``without``: the `PARTS` switched off (both from `NO_SANDBOX`,
    `from_environment`)."""

    network: bool = False
    unix: bool = True
    off: bool = False
    without: frozenset[str] = frozenset()
    #: folders the worker must not see into, each covered (in its mount namespace) by an
    #: empty one of its own, but for its scratch folder where that lies inside: for a
    #: worker that may open sockets, the judge's temporary folder, where the forkservers
    #: of this judge and of any other listen (each forks, for whoever connects, a process
    #: outside any sandbox; a connection that sends nothing crashes it)
    hidden: tuple[str, ...] = ()
    #: paths inside a ``hidden`` folder bound back in place once it is covered: the
    #: worker's scratch folder and the user's installation (the Python prefix, the
    #: folders on ``sys.path``, the working folder), so that hiding covers the sockets,
    #: never the user's code (a virtual environment under ``$TMPDIR``)
    kept: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls, network: bool = False, unix: bool = True) -> "Policy":
        """The policy `NO_SANDBOX` asks for (a ValueError naming the value where it is
        neither 1 nor a list of `PARTS`)."""
        value = os.environ.get(NO_SANDBOX, "").strip()
        if value in ("", "0"):
            return cls(network=network, unix=unix)
        if value == "1":
            return cls(network=network, unix=unix, off=True)
        parts = frozenset(p.strip() for p in value.split(",") if p.strip())
        if not parts or parts - set(PARTS):
            raise ValueError(
                f"{NO_SANDBOX}={value!r}: it must be 1 (no sandbox) or some of "
                f"{', '.join(PARTS)}, comma-separated (the parts to switch off)"
            )
        return cls(network=network, unix=unix, without=parts)

    def allowed(self) -> dict[str, str]:
        """What the policy leaves open, part by part, with why (for the report)."""
        if self.network and self.unix:
            return {"network": "sockets allowed: this family's processes talk over them"}
        if self.network:
            return {"network": "TCP sockets allowed: this family's processes talk over them"}
        return {}


@dataclass
class Enforced:
    """What `enter` enforced (``enforced``: the parts' names, with how) and what it could
    not (``missing``: the part, why), as the worker reports it before the backend loads."""

    enforced: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    def message(self) -> dict[str, dict[str, str]]:
        return {"enforced": dict(self.enforced), "missing": dict(self.missing)}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The Landlock ABI the kernel offers (0: none: another OS, an old kernel, or
    Landlock not enabled at boot)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_CREATE_RULESET_VERSION))  # fmt: skip
    return max(0, int(abi))


def scratch_env(scratch: str) -> dict[str, str]:
    """The variables that send a worker's writes to ``scratch`` (`SCRATCH_VARIABLES`)."""
    return dict.fromkeys(SCRATCH_VARIABLES, scratch)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: execute ... make_sym
    if abi >= 2:
        rights |= 1 << 13  # refer
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def _check(result: int, what: str) -> int:
    if result < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return result


def _landlock(
    scratch: str,
    abi: int,
    network: bool,
    shm: bool = False,
    *,
    files: bool = True,
    signals: bool = True,
) -> bool:
    """Restrict this process (and what it starts) with Landlock: with ``files``, writing
    in ``scratch`` only (and in `SHM` with ``shm``: a private one); with ``signals``, no
    signal out (ABI 6). Whether signals were scoped."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    handled_fs = _fs_rights(abi) if files else 0
    handled_net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 and not network else 0
    scoped = 0
    if abi >= 6 and signals:
        scoped = SCOPE_SIGNAL | (0 if network else SCOPE_ABSTRACT_UNIX_SOCKET)
    if not (handled_fs or handled_net or scoped):
        return False  # nothing to restrict (no signal scope before ABI 6)
    attr = struct.pack("=QQQ", handled_fs, handled_net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    fd = _check(
        libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), buf, ctypes.c_size_t(size),
                     ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )  # fmt: skip
    try:

        def allow(path: str, rights: int) -> None:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return  # a device that vanished, a folder that is not there: nothing to allow
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, target), 12)
                _check(
                    libc.syscall(ctypes.c_long(_SYS_ADD_RULE), ctypes.c_int(fd),
                                 ctypes.c_int(_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)),
                    f"landlock_add_rule({path})",
                )  # fmt: skip
            finally:
                os.close(target)

        if handled_fs:
            allow("/", FS_EXECUTE | FS_READ_FILE | FS_READ_DIR)
            allow(scratch, handled_fs)
            # its own /proc/<pid> (its threads' names, which CUDA's cuInit writes, and
            # clear_refs), held open so that the rule's inode stays the one procfs shows
            with contextlib.suppress(OSError):
                _PINNED.append(os.open("/proc/self", os.O_PATH | os.O_CLOEXEC))
                allow("/proc/self", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))
            if shm:
                allow(SHM, handled_fs)
            device = FS_READ_FILE | FS_WRITE_FILE
            device |= (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0)
            for folder in ("/dev", "/dev/dri"):
                with contextlib.suppress(OSError), os.scandir(folder) as entries:
                    for entry in entries:
                        if _is_char(entry.path):
                            allow(entry.path, device)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            _check(-1, "prctl(PR_SET_NO_NEW_PRIVS)")
        restricted = libc.syscall(
            ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)
        )
        _check(restricted, "landlock_restrict_self")
    finally:
        os.close(fd)
    return bool(scoped)


#: the worker's own ``/proc/<pid>``, open for its lifetime (`_landlock`)
_PINNED: list[int] = []


def _is_char(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


#: Linux's AF_UNIX (AF_LOCAL)
_AF_UNIX = 1


def _seccomp(network: bool, *, processes: bool = True, unix: bool = True) -> None:
    """A filter that refuses (EPERM), to this process and what it starts, ``setsid`` and
    ``setpgid`` (with ``processes``), unless ``network`` ``socket`` and
    ``io_uring_setup``, with ``network`` but not ``unix`` a ``socket`` of ``AF_UNIX``;
    and every call of another ABI."""
    arch, numbers = _ARCHES[platform.machine()]
    refused = [numbers["setsid"], numbers["setpgid"]] if processes else []
    if not network:
        refused += [numbers["socket"], numbers["io_uring"]]

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE|K, RET|K
    n = len(refused)
    # socket(AF_UNIX, ...): the call's first argument (its low word: seccomp_data's args
    # start at byte 16, little-endian on both architectures) is the domain
    domain = [] if (unix or not network) else [
        op(jeq, numbers["socket"], 0, 2),  # not socket(): to the allowance
        op(ld, 16),  # its domain
        op(jeq, _AF_UNIX, 1, 0),  # AF_UNIX: to the refusal
    ]  # fmt: skip
    m = len(domain)
    # every call of another ABI (32-bit compat, whose socketcall would open a socket) and
    # of x86-64's x32 ABI (the same numbers with a high bit) is refused: Python uses none
    program = [
        op(ld, 4),  # arch
        op(jeq, arch, 0, n + m + 3),  # another ABI: to the refusal
        op(ld, 0),  # the call's number
        op(jge, _X32_SYSCALL_BIT, n + m + 1, 0),  # x32: to the refusal
        *[op(jeq, nr, n + m - i, 0) for i, nr in enumerate(refused)],
        *domain,
        op(ret, _RET_ALLOW),
        op(ret, _RET_ERRNO | errno.EPERM),
    ]
    code = b"".join(program)
    filt = ctypes.create_string_buffer(code, len(code))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(program), ctypes.cast(filt, ctypes.c_void_p))
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _check(-1, "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        _check(-1, "prctl(PR_SET_SECCOMP)")


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _pid_namespace() -> tuple[int, bool] | None:
    """Move what this process starts next into a new PID namespace (with a user namespace
    around it where this process is not privileged), and this process into a mount
    namespace with a `SHM` of its own where the kernel allows one: the flags, and whether
    that `SHM` was made (`_private_shm`); None where the kernel refuses a PID namespace."""
    if _threads() != 1:
        return None  # a user namespace needs a process of one thread
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    user, pid, ns = _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNS
    for flags in (user | pid | ns, pid | ns, user | pid, pid):
        if libc.unshare(flags) == 0:
            if flags & _CLONE_NEWUSER:  # the same ids inside as outside
                with contextlib.suppress(OSError):
                    with open("/proc/self/setgroups", "w") as f:
                        f.write("deny")
                    with open("/proc/self/uid_map", "w") as f:
                        f.write(f"{uid} {uid} 1")
                    with open("/proc/self/gid_map", "w") as f:
                        f.write(f"{gid} {gid} 1")
            return flags, bool(flags & _CLONE_NEWNS) and _private_shm()
    return None


#: what `enter` says of the folders it covered (`Policy.hidden`)
COVERED = "the judge's temporary folder covered: no forkserver's socket in reach"


def _own_proc() -> None:
    """In the worker, in its PID and (private) mount namespaces: a ``/proc`` of the PID
    namespace's own. Its threads' ids are then the ones ``/proc/self/task`` lists: a
    driver that names its threads through ``/proc/self/task/<tid>/comm`` (CUDA's cuInit,
    which fails with error 304 where it cannot) finds them, and the worker sees no
    process outside its namespace. Where it cannot be mounted, ``/proc`` stays the
    machine's, and a thread's id there differs from the worker's own."""
    options = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    _libc().mount(b"proc", b"/proc", b"proc", options, None)


def _cover(folder: str, keep: tuple[str, ...] = ()) -> bool:
    """In the worker's private mount namespace: an empty tmpfs over ``folder``, so that
    what lies there (a socket) is out of its reach, with each path of ``keep`` (its
    scratch folder, the user's installation) that lies inside bound back in place;
    whether ``folder`` was covered."""
    if not os.path.isdir(folder):
        return False
    folder = os.path.realpath(folder)
    inside = [
        k
        for k in (os.path.realpath(k) for k in keep)
        if k != folder and os.path.commonpath([folder, k]) == folder and os.path.exists(k)
    ]
    libc = _libc()
    held = [os.open(k, os.O_PATH | os.O_CLOEXEC) for k in inside]
    try:
        options = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", options, b"mode=1777") != 0:
            return False
        for k, fd in zip(inside, held, strict=True):  # each again, where it was
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(k, exist_ok=True)
            else:  # a file on sys.path (a zip): a file to mount it on
                os.makedirs(os.path.dirname(k), exist_ok=True)
                open(k, "a").close()
            source = f"/proc/self/fd/{fd}".encode()
            libc.mount(source, k.encode(), None, _MS_BIND | _MS_REC, None)
        return True
    finally:
        for fd in held:
            os.close(fd)


def _private_shm() -> bool:
    """In this process's new mount namespace: stop mounts propagating to the machine's
    (every mount private), then a tmpfs of its own on `SHM`, which goes when the last
    process of the namespace ends. Whether it was made (never the machine's `SHM`: where
    the mounts cannot be made private, nothing is mounted)."""
    if not os.path.isdir(SHM):
        return False
    libc = _libc()
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    options = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    return bool(libc.mount(b"tmpfs", SHM.encode(), b"tmpfs", options, b"mode=1777") == 0)


def enter(scratch: str, policy: Policy | None = None, *, contain: bool = True) -> Enforced:
    """Enter the sandbox: from here on, this process (and all it starts) may write only in
    ``scratch``. With ``contain``, where the kernel allows a PID namespace, the process
    that returns is a new one, in a namespace of its own (`_contain`); the caller's
    process waits outside and ends as it ends. Call it while the process is one thread,
    before any code of the backend's has run. What the platform does not enforce is
    listed in the result's ``missing``, never an error (the judge decides).
    """
    policy = policy or Policy()
    done = Enforced()
    os.environ.update(scratch_env(scratch))
    import tempfile

    tempfile.tempdir = None  # from TMPDIR again
    sys.dont_write_bytecode = True
    if policy.off:
        done.missing["all"] = f"switched off ({NO_SANDBOX}=1 in the judge's environment)"
        return done
    if not sys.platform.startswith("linux"):
        done.missing["all"] = f"the sandbox is Linux-only (this is {sys.platform})"
        return done
    without = policy.without
    off = f"switched off ({NO_SANDBOX}={','.join(p for p in PARTS if p in without)})"
    if "lifetime" in without:
        done.missing["lifetime"] = off
    elif contain:
        _contain(done, policy.hidden, (scratch, *policy.kept))
    if policy.hidden and "forkservers" not in done.enforced:
        done.missing["forkservers"] = (
            "the judge's temporary folder is not covered (no mount namespace): a "
            "forkserver's socket, which forks a process outside any sandbox, is in reach"
        )
    sockets = policy.network or "network" in without
    processes = "processes" not in without
    tcp_only = sockets and policy.network and not policy.unix and "network" not in without
    try:
        if processes or not sockets or tcp_only:
            _seccomp(sockets, processes=processes, unix=not tcp_only)
        if processes:
            done.enforced["processes"] = "setsid and setpgid refused (seccomp)"
        if not sockets:
            done.enforced["network"] = "no new socket (seccomp)"
        if tcp_only:
            done.enforced["unix sockets"] = "no new UNIX socket (seccomp): no pathname one in reach"
    except (KeyError, OSError) as e:
        why = f"no seccomp filter for {platform.machine()}" if isinstance(e, KeyError) else str(e)
        if processes:
            done.missing["processes"] = why
        if not sockets:
            done.missing["network"] = why
        if tcp_only:
            done.missing["unix sockets"] = why
    for part in ("processes", "network"):
        if part in without:
            done.missing[part] = off
    files, signals = "files" not in without, "signals" not in without
    abi = landlock_abi() if files or signals else 0
    if abi == 0:
        why = "this kernel offers no Landlock (5.13 or later, enabled)"
        done.missing["files"] = why if files else off
        done.missing["signals"] = why if signals else off
        return done
    try:
        shm = "shared memory" in done.enforced
        scoped = _landlock(scratch, abi, sockets, shm, files=files, signals=signals)
    except OSError as e:
        done.missing["files"] = str(e) if files else off
        done.missing["signals"] = str(e) if signals else off
        return done
    if files:
        done.enforced["files"] = f"writes only in the scratch folder (Landlock ABI {abi})"
    else:
        done.missing["files"] = off
    if scoped:
        done.enforced["signals"] = "none outside the sandbox (Landlock scope)"
    elif signals:
        done.missing["signals"] = f"Landlock ABI {abi} has no signal scope (6 or later)"
    else:
        done.missing["signals"] = off
    return done


def _contain(done: Enforced, hidden: tuple[str, ...] = (), keep: tuple[str, ...] = ()) -> None:
    """`enter`'s ``contain``: where the kernel allows a PID namespace, this process (the
    one the judge knows, which stays outside and only waits) starts the namespace's
    first process, a reaper, which starts the worker and ends when it ends; its end
    ends every process in the namespace. Only the worker returns. Elsewhere nothing
    forks, and the process group is all that holds what the worker starts."""
    made = _pid_namespace()
    if made is None:
        done.missing["lifetime"] = "no PID namespace (the kernel refused one)"
        return
    status_r, status_w = os.pipe()
    reaper = os.fork()
    if reaper == 0:
        os.close(status_r)
        die_with_parent()
        worker = os.fork()
        if worker == 0:  # the worker: an ordinary process (a namespace's first one
            os.close(status_w)  # ignores the signals it sends itself: abort() would not end it)
            die_with_parent()
            done.enforced["lifetime"] = "a PID namespace of its own, ended with the worker"
            if made[1]:
                done.enforced["shared memory"] = f"a {SHM} of its own (tmpfs), gone with it"
                _own_proc()
                covered = [_cover(folder, keep) for folder in hidden]  # each, whatever fails
                if hidden and all(covered):
                    done.enforced["forkservers"] = COVERED
            return
        while True:  # reap what the namespace orphans, until the worker ends
            try:
                pid, status = os.wait()
            except ChildProcessError:
                os._exit(1)
            if pid == worker:
                os.write(status_w, struct.pack("=i", status))
                os._exit(0)  # and with it, every process left in the namespace
    os.close(status_w)
    try:
        _wait_as(reaper, status_r)
    finally:  # the outer process never returns: only the worker serves
        os._exit(1)


def _wait_as(reaper: int, status_r: int) -> None:
    """The outer process: wait for the namespace's reaper, then end as the worker ended
    (its exit code, or its signal), for the judge's report; a signal to it ends them all."""
    import signal

    def end(*_: object) -> None:
        os.kill(reaper, signal.SIGKILL)
        os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, end)
    while True:
        try:
            os.waitpid(reaper, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    data = os.read(status_r, 4)
    if len(data) != 4:
        os._exit(1)
    (status,) = struct.unpack("=i", data)
    if os.WIFSIGNALED(status):
        with contextlib.suppress(OSError, ValueError):  # SIGKILL, SIGSTOP: not catchable
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
