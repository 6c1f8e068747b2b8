"""The inside of the code sandbox (see :mod:`rewards.sandbox`): trusted code, run as root and PID 1 of fresh
PID, network, mount, IPC and UTS namespaces by ``unshare``, as ``python -I -S sandbox_harness.py``.

It reads a job (marshal: ``program``, ``cases``, ``uid``, ``limits``) on stdin, builds a throwaway root and
chroots into it, runs the program once per case as ``uid`` under rlimits and a seccomp filter (no kernel
keyrings), compares outputs itself and writes one status per case (marshal) on stdout. It imports only light
built-in modules (it starts once per scored completion), and forks/execs the program itself rather than through
``subprocess``.
"""

import ctypes
import marshal
import math
import os
import resource
import select
import sys
import time

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 8, 32, 4096, 16384
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _MNT_DETACH, _EINVAL, _EPERM = 38, 22, 2, 2, 22, 1
_KEY_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250)), "aarch64": (0xC00000B7, (217, 218, 219))}
"""Per machine: the seccomp audit arch, and the numbers of ``add_key``, ``request_key`` and ``keyctl``."""
_SIGKILL = 9
_NEW_ROOT = "/tmp"  # mount point of the new root's tmpfs (in the private mount namespace only)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("null", "zero", "random", "urandom")
_PROGRAM, _INPUT, _WORKDIR = "/src/prog.py", "/src/input", "/work"
_SCRATCH = {_WORKDIR: "0700", "/tmp": "1777", "/dev/shm": "1777"}
"""The program's only writable dirs (mode): fresh tmpfs mounts every case; the working dir is the program's."""
_ENV = {"PATH": "/usr/bin:/bin", "HOME": _WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
_libc = ctypes.CDLL(None, use_errno=True)


def outputs_match(got: str, expected: str) -> bool:
    """Equal after stripping trailing whitespace from every line and trailing newlines from the whole."""
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.rstrip().splitlines()]

    return norm(got) == norm(expected)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _no_keyrings_filter() -> _SockFprog:
    """A seccomp filter that fails the kernel keyring calls with EPERM (as Docker's default profile does), and any
    call of another ABI (x32, i386) that could reach them under other numbers. Keyrings are kept per uid, not per
    namespace: a key one program stored in its user keyring would be read by the next program of that uid."""
    if os.uname().machine not in _KEY_SYSCALLS:
        raise SystemExit(f"no seccomp syscall table for {os.uname().machine!r}; the sandbox knows "
                         f"{sorted(_KEY_SYSCALLS)}")
    arch, numbers = _KEY_SYSCALLS[os.uname().machine]
    ld, jeq, jge, ret, allow, deny = 0x20, 0x15, 0x35, 0x06, 0x7FFF0000, 0x00050000 | _EPERM
    checks = [(jge, 0x40000000), *((jeq, nr) for nr in numbers)]  # x32 numbers have bit 30 set
    code = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]  # seccomp_data: nr at 0, arch at 4
    code += [(op, len(checks) - i, 0, k) for i, (op, k) in enumerate(checks)]  # a match jumps to the deny
    code += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return _SockFprog(len(code), (_SockFilter * len(code))(*code))


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _check_isolated() -> None:
    """Refuse to run anything unless the namespaces really are new (PID 1, no network interface but lo)."""
    if os.getpid() != 1:
        raise SystemExit(f"harness is not PID 1 of a new PID namespace (pid {os.getpid()})")
    with open("/proc/self/net/dev") as f:
        nics = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    if nics != ["lo"]:
        raise SystemExit(f"harness sees network interfaces {nics}; expected a new network namespace")


def _build_root(python: str, src_mb: int) -> None:
    """Throwaway root: a tmpfs holding read-only binds of the system dirs and the interpreter's prefix, the
    device nodes, a private /proc and a root-only /src; then chroot into it. Nothing in it is writable by the
    program: its writable dirs are mounted per case (:func:`_fresh_scratch`)."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise SystemExit(f"the program interpreter {python!r} is not an executable file")
    _mount("tmpfs", _NEW_ROOT, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    prefix = os.path.dirname(os.path.dirname(python))
    covered = any(prefix == d or prefix.startswith(d + "/") for d in _SYSTEM_DIRS)
    for path in (*_SYSTEM_DIRS, *([] if covered else [prefix])):
        inside = _NEW_ROOT + path
        if os.path.islink(path):
            os.symlink(os.readlink(path), inside)
        elif os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
            _mount(path, inside, None, _MS_BIND | _MS_REC)
            _mount(None, inside, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.makedirs(_NEW_ROOT + "/dev")
    for dev in _DEVICES:
        open(f"{_NEW_ROOT}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{_NEW_ROOT}/dev/{dev}", None, _MS_BIND)
    for path in ("/proc", "/src", *_SCRATCH):
        os.makedirs(_NEW_ROOT + path)
    _mount("proc", _NEW_ROOT + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _mount("tmpfs", _NEW_ROOT + "/src", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={src_mb}m,nr_inodes=16,mode=0755")
    os.chroot(_NEW_ROOT)
    os.chdir("/")


def _fresh_scratch(uid: int, disk_mb: int) -> None:
    """New empty tmpfs mounts for the program's working dir, /tmp and /dev/shm, dropping the last case's
    (a detach frees any tree at once, however deep or large the program made it)."""
    for path, mode in _SCRATCH.items():
        owner = uid if path == _WORKDIR else 0
        if _libc.umount2(path.encode(), _MNT_DETACH) != 0 and ctypes.get_errno() != _EINVAL:  # EINVAL: none yet
            raise OSError(ctypes.get_errno(), f"umount {path}")
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV,
               f"size={disk_mb}m,nr_inodes=4096,mode={mode},uid={owner},gid={owner}")


def _exec_program(python: str, uid: int, limits: dict, stdin: int, stdout: int, seccomp: _SockFprog) -> None:
    """In the forked child: drop to ``uid`` with the limits, then exec the program. Never returns."""
    try:
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        devnull = os.open("/dev/null", os.O_WRONLY)
        os.dup2(devnull, 2)
        os.closerange(3, 1 << 16)
        os.chdir(_WORKDIR)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        cpu = math.ceil(limits["timeout_s"]) + 1
        memory, disk, procs = limits["memory_mb"] << 20, limits["disk_mb"] << 20, limits["max_procs"]
        for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                                (resource.RLIMIT_NPROC, procs, procs), (resource.RLIMIT_FSIZE, disk, disk),
                                (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0),
                                (resource.RLIMIT_MEMLOCK, 0, 0)):
            resource.setrlimit(res, (soft, hard))
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # setuid binaries cannot give root back
            raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")
        if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(seccomp), 0, 0) != 0:
            raise OSError("prctl(PR_SET_SECCOMP) failed")
        os.execve(python, [python, "-I", "-S", _PROGRAM], _ENV)
    finally:
        os._exit(127)


def _run_case(case: dict, uid: int, limits: dict, seccomp: _SockFprog) -> str | tuple[str, str]:
    """Status of one case (see rewards.sandbox.STATUSES), or for a case without an expected output (``None``)
    ``(status, stdout)`` with status ``ok`` for a clean exit; no process of the program survives it."""
    _fresh_scratch(uid, limits["disk_mb"])
    with open(_INPUT, "w", encoding="utf-8", errors="replace") as f:
        f.write(case["input"])
    stdin = os.open(_INPUT, os.O_RDONLY)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _exec_program(limits["python"], uid, limits, stdin, write_end, seccomp)
    os.close(stdin)
    os.close(write_end)
    try:
        out, status = _collect(pid, read_end, limits["timeout_s"], limits["max_output_kb"] << 10)
    finally:
        os.close(read_end)
        _kill_all()
    if case["output"] is None:  # run_program: the caller wants the output itself
        return status or "ok", out.decode(errors="replace")
    if status is not None:
        return status
    return "pass" if outputs_match(out.decode(errors="replace"), case["output"]) else "wrong"


def _collect(pid: int, fd: int, timeout_s: float, cap: int) -> tuple:
    """Read the program's stdout until EOF and exit, the deadline, or ``cap`` bytes: (stdout, failure status
    or None)."""
    deadline = time.monotonic() + timeout_s
    out = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return bytes(out), _exit_status(pid, deadline)
        out += chunk
        if len(out) > cap:
            return bytes(out), "output_limit"
    return bytes(out), "timeout"


def _exit_status(pid: int, deadline: float):
    """None for exit code 0, "error" for another exit or a signal, "timeout" when it outlives the deadline."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return None if os.waitstatus_to_exitcode(status) == 0 else "error"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.0005)


def _kill_all() -> None:
    """SIGKILL every process of the namespace but PID 1 and reap them, until /proc shows none."""
    for _ in range(10_000):
        try:
            os.kill(-1, _SIGKILL)  # from PID 1: every other process of this PID namespace, setsid or not
        except ProcessLookupError:
            pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if all(p == "1" for p in os.listdir("/proc") if p.isdigit()):
            return
        time.sleep(0.001)
    raise SystemExit("could not clear the sandbox's processes")


def main() -> None:
    job = marshal.loads(sys.stdin.buffer.read())
    _check_isolated()
    seccomp = _no_keyrings_filter()
    limits, uid = job["limits"], job["uid"]
    limits["python"] = os.path.realpath(limits["python"])  # resolved outside: the chroot may lack the link
    src_mb = ((len(job["program"]) + max(len(c["input"]) for c in job["cases"])) * 4 >> 20) + 1  # UTF-8: <= 4 B
    _build_root(limits["python"], src_mb)
    with open(_PROGRAM, "w", encoding="utf-8", errors="replace") as f:
        f.write(job["program"])
    statuses = [_run_case(case, uid, limits, seccomp) for case in job["cases"]]
    sys.stdout.buffer.write(marshal.dumps(statuses))


if __name__ == "__main__":
    main()
