"""The ``code`` reward and its sandbox: scoring, program extraction, and hostile programs that must score 0
without doing harm (checked on the host: no process left, no file written, no connection made, caller alive),
then escape attempts that must all fail: reading the expected outputs or host files, reaching PID 1, setuid
binaries, link tricks, keyrings, uid-slot exhaustion, multithreaded CPU burn.

These run real sandboxes (namespaces + chroot), so they need root, like the CI; elsewhere they skip and
:func:`test_non_root_fails_loudly` shows what the sandbox does instead.
"""

import contextlib
import fcntl
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from stat import S_ISGID, S_ISUID

import psutil
import pytest

from rewards import sandbox
from rewards.code import code_reward, extract_program
from rewards.functions import load_reward_function
from rewards.sandbox import (
    UID_BASE,
    UID_SLOTS,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    check_sandbox,
    outputs_match,
    run_tests,
)
from rewards.worker import RewardWorker

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (as in CI)")

SUM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
SUM_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4", "output": "6"},
             {"input": "", "output": "0"}, {"input": "5 5 5\n", "output": "15"}]


def program(source: str) -> str:
    return textwrap.dedent(source).lstrip()


def score(completion: str, tests=SUM_TESTS, **params) -> float:
    return code_reward("", completion, {"tests": tests}, **params)


def sandbox_processes() -> list[int]:
    """Host pids of the processes running as any sandbox uid, but those of the other pytest-xdist workers (the
    config checks of their tests score samples with the code reward too): this process's sandboxes, and any
    orphaned process of theirs, are all counted."""
    others = {p.pid for p in psutil.Process().parent().children()} - {os.getpid()}
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue  # exited while we looked
        if UID_BASE <= uid < UID_BASE + UID_SLOTS and not _descends_from(int(status.parent.name), others):
            pids.append(int(status.parent.name))
    return pids


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(p.pid in ancestors for p in psutil.Process(pid).parents())
    return False


def children_of_this_process() -> list[int]:
    me = str(os.getpid())
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if ppid == me:
            out.append(int(stat.parent.name))
    return out


def test_correct_program_scores_one_and_half_right_scores_half():
    assert score(SUM) == 1.0
    half = "import sys\nn = sum(int(x) for x in sys.stdin.read().split())\nprint(n if n < 5 else n + 1)\n"
    assert score(half) == 0.5


def test_comparison_strips_trailing_whitespace_and_newlines_only():
    assert outputs_match("3  \n4\t\n\n\n", "3\n4")
    assert not outputs_match(" 3", "3")
    assert not outputs_match("3\n\n4", "3\n4")
    assert score("print('a  ')\nprint('b')\nprint()\n", [{"input": "", "output": "a\nb"}]) == 1.0


def test_program_is_last_python_block_else_whole_completion():
    wrong = "```python\nprint(-1)\n```"
    right = f"```python\n{SUM}```"
    completion = f"First try:\n{wrong}\nBetter:\n{right}\nDone. ```text\nnot code\n```"
    assert extract_program(completion) == SUM
    assert score(completion) == 1.0
    assert score(f"Better:\n{right}\nand the earlier:\n{wrong}") == 0.0  # the last block counts
    assert extract_program(SUM) == SUM and score(SUM) == 1.0  # no fence: the whole completion
    assert extract_program(f"```py\n{SUM}```") == SUM


def test_syntax_error_and_crash_score_zero():
    assert score("print(sum(int(x) for x in input().split())") == 0.0
    assert score("import sys\nprint(3)\nsys.exit(1)\n", [{"input": "", "output": "3"}]) == 0.0


def test_fork_bomb_scores_zero_and_leaves_no_process():
    before = set(children_of_this_process())
    bomb = program("""
        import os
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()  # out of the parent's process group too
            except OSError:
                pass
    """)
    assert score(bomb, SUM_TESTS[:1], timeout_s=1) == 0.0
    assert sandbox_processes() == []
    assert set(children_of_this_process()) <= before


def test_infinite_loop_returns_within_the_timeout_budget():
    start = time.monotonic()
    assert run_tests("while True:\n    pass\n", SUM_TESTS[:2], SandboxLimits(timeout_s=1)) == ["timeout"] * 2
    assert time.monotonic() - start < 2 * 1 + 4  # two cases of 1 s plus start-up, on a busy 2-core machine
    assert sandbox_processes() == []


def test_socket_even_to_loopback_fails_and_the_server_sees_nothing():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'x')\n" \
              "print(3)\n"
    try:
        assert score(program, [{"input": "", "output": "3"}]) == 0.0
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_writes_outside_the_sandbox_do_not_happen():
    name = f"fleetrl-sandbox-test-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, Path("/dev/shm") / name, Path("/var/tmp") / name, REPO / name]
    writes = "".join(f"open({str(t)!r}, 'w').write('x')\n" for t in targets)
    try:
        assert score(writes + "print('pwned')\n", [{"input": "", "output": "pwned"}]) == 0.0
        # /tmp and /dev/shm are the sandbox's own throwaway tmpfs: the writes succeed there, and vanish with it
        assert score(writes.split("\n")[0] + "\nprint('pwned')\n", [{"input": "", "output": "pwned"}]) == 1.0
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_huge_output_is_capped_and_fast():
    start = time.monotonic()
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    assert run_tests(program, [{"input": "", "output": "x"}], SandboxLimits(max_output_kb=1024)) == ["output_limit"]
    assert time.monotonic() - start < 5
    assert sandbox_processes() == []


def test_memory_and_process_limits_apply():
    assert score("x = bytearray(1 << 30)\nprint(3)\n", [{"input": "", "output": "3"}], memory_mb=128) == 0.0
    spawn = program("""
        import os, time
        n = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.close(1)
                time.sleep(60)
            n += 1
        print(n)
    """)
    # the program is one of its max_procs processes: 7 forks succeed, the 8th fails; the sleepers are cleared
    assert run_tests(spawn, [{"input": "", "output": "7"}], SandboxLimits(max_procs=8)) == ["pass"]
    assert sandbox_processes() == []


def test_a_program_cannot_spoil_the_next_case():
    """Each case gets fresh writable dirs, whatever the last one left there (a deep tree, a full disk)."""
    spoiler = program("""
        import os
        print(os.listdir("."), os.listdir("/tmp"), os.listdir("/dev/shm"))
        open("/dev/shm/f", "w").write("x")
        try:
            open("/tmp/fill", "wb").write(b"x" * (100 << 20))
        except OSError:
            pass
        for _ in range(2000):
            os.mkdir("d")
            os.chdir("d")
    """)
    assert run_tests(spoiler, [{"input": "", "output": "[] [] []"}] * 3, SandboxLimits(disk_mb=16)) == ["pass"] * 3


@pytest.mark.parametrize("target", ["os.getppid()", "1", "-1", "PYTEST_PID", "VICTIM_PID"])
def test_kills_do_not_reach_the_caller(target):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        expr = target.replace("PYTEST_PID", str(os.getpid())).replace("VICTIM_PID", str(victim.pid))
        program = f"import os\nos.kill({expr}, 9)\nprint(3)\n"
        assert score(program, [{"input": "", "output": "3"}]) == 0.0
        time.sleep(0.1)
        assert victim.poll() is None  # a process of the caller's, reachable by pid outside, survived
        worker = RewardWorker(specs=[("code", 1.0, {})], timeout_s=30, strict=False)
        (result,), errors, *_ = worker.score([("", SUM, {"tests": SUM_TESTS})])
        assert errors == 0 and result.reward == 1.0
    finally:
        victim.kill()
        victim.wait()


def test_reward_worker_scores_a_batch_of_good_and_hostile_programs():
    worker = RewardWorker(specs=[("code", 1.0, {})], timeout_s=30, strict=False)
    tests = SUM_TESTS[:3]
    hostile = ["import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
               "while True:\n    pass\n",
               "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
               "import os\nos.kill(os.getppid(), 9)\n",
               "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n"]
    programs = [SUM, hostile[0], f"```python\n{SUM}```", *hostile[1:], SUM]
    fds = len(os.listdir("/proc/self/fd"))
    start = time.monotonic()
    results, errors, *_ = worker.score([("", p, {"tests": tests}) for p in programs])
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert errors == 0 and worker.stats()["errors"] == 0
    assert time.monotonic() - start < 30
    assert sandbox_processes() == []
    (again,), *_ = worker.score([("", SUM, {"tests": tests})])
    assert again.reward == 1.0
    assert len(os.listdir("/proc/self/fd")) == fds  # no pipe or lock file leaked into the caller


def test_code_is_a_builtin_and_bad_input_is_named():
    assert load_reward_function("code") is code_reward
    with pytest.raises(ValueError, match=r"metadata\['tests'\]"):
        code_reward("", SUM, {})
    with pytest.raises(ValueError, match="test case 1"):
        code_reward("", SUM, {"tests": [SUM_TESTS[0], {"input": "1"}]})
    with pytest.raises(ValueError, match="unknown params.*'timeout'"):
        code_reward("", SUM, {"tests": SUM_TESTS}, timeout=3)
    with pytest.raises(ValueError, match="memory_mb=0"):
        code_reward("", SUM, {"tests": SUM_TESTS}, memory_mb=0)


def test_worker_start_fails_loudly_when_the_sandbox_cannot_run():
    check_sandbox()  # this host can
    with pytest.raises(SandboxUnavailable, match="cannot be created"):
        RewardWorker(specs=[("code", 1.0, {"python": "/nonexistent/bin/python3"})], timeout_s=30, strict=False)
    with pytest.raises(ValueError, match="max_procs=0"):
        RewardWorker(specs=[("code", 1.0, {"max_procs": 0})], timeout_s=30, strict=False)


@pytest.mark.skipif(not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs setpriv and a system python3")
def test_non_root_fails_loudly():
    """Without root the sandbox refuses (it never runs the program unsandboxed)."""
    code = ("import sys, types\n"  # the package's __init__ needs the venv, which uid 65534 cannot read
            "sys.modules['rewards'] = types.ModuleType('rewards'); sys.modules['rewards'].__path__ = ['rewards']\n"
            "from rewards import sandbox\n"
            "try:\n    sandbox.check_sandbox('/usr/bin/python3')\n"
            "except sandbox.SandboxUnavailable as e:\n    print('UNAVAILABLE', e)\n")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                          "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("UNAVAILABLE the code sandbox needs root, running as uid 65534"), out.stderr


def test_without_cap_sys_admin_fails_loudly():
    """Root without CAP_SYS_ADMIN (a default Docker container) cannot create namespaces: the worker refuses."""
    code = "from rewards.worker import RewardWorker\nRewardWorker([('code', 1.0, {})], timeout_s=30, strict=False)\n"
    out = subprocess.run(["setpriv", "--bounding-set=-sys_admin", sys.executable, "-c", code], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "SandboxUnavailable: the code sandbox cannot be created here" in out.stderr
    assert "Operation not permitted" in out.stderr and "CAP_SYS_ADMIN" in out.stderr


# Escapes: a hostile program tries to leave the sandbox or to read what it must not; each attempt must fail.

SECRET = "fleetrl-expected-output-5f0c1d7e9a2b4c6e8f1a3b5c7d9e0f2a"
"""The expected output that :data:`HUNT` looks for. It is in this file, in a dataset file, in the caller's (so the
harness's) environment and in the harness's memory; a program that finds it prints it, and then passes."""

HUNT = program(r"""
    import ctypes, os, re, sys
    SECRET = re.compile(rb"fleetrl-expected-output-[0-9a-f]{32}")
    PUBLIC = {"/proc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", sys.base_prefix}

    def read(path):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe behind /proc/*/fd must not block
            try:
                return os.read(fd, 1 << 20)
            finally:
                os.close(fd)
        except OSError:
            return b""

    def memory(pid):
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
                for span, perms, *_ in map(str.split, maps):
                    lo, hi = (int(a, 16) for a in span.split("-"))
                    for at in range(lo, hi, 1 << 24) if perms[0] == "r" else ():
                        try:
                            mem.seek(at)
                            yield mem.read(min(1 << 24, hi - at))
                        except (OSError, ValueError, OverflowError):
                            pass
        except OSError:
            pass

    def visible_files():  # every file of the tree, the read-only system dirs aside
        for root, dirs, names in os.walk("/"):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in PUBLIC]
            yield from (read(os.path.join(root, name)) for name in names)

    def proc():  # every process of the namespace, this one included
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            yield from (read(f"/proc/{pid}/{what}") for what in ("environ", "cmdline"))
            try:
                yield from (read(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                pass
            yield from memory(pid)

    attack, *paths = sys.stdin.read().split()
    if attack == "escape":  # the classic chroot escape, as root of a new user namespace if it can
        ctypes.CDLL(None).unshare(0x10000000 | 0x20000)  # CLONE_NEWUSER | CLONE_NEWNS
        try:
            os.mkdir("jail")
            os.chroot("jail")
            for _ in range(64):
                os.chdir("..")
            os.chroot(".")
        except OSError:
            pass
    blobs = {"files": map(read, paths), "escape": map(read, paths), "walk": visible_files(), "proc": proc()}[attack]
    print(next((m.group().decode() for blob in blobs if (m := SECRET.search(blob))), "nothing found"))
""")


def test_program_cannot_read_the_expected_outputs(tmp_path, monkeypatch):
    """The expected output is in the repository, a dataset file, the harness's environment and memory: a program
    that reads any of them prints it and passes; every hunt must come back empty-handed ("wrong")."""
    dataset = tmp_path / "tests.jsonl"
    dataset.write_text(json.dumps({"input": "", "output": SECRET}) + "\n")
    monkeypatch.setenv("FLEETRL_EXPECTED", SECRET)
    paths = " ".join([str(Path(__file__).resolve()), str(dataset), os.path.relpath(__file__),  # the caller's cwd
                      str(REPO / "tests" / "test_sandbox.py"), f"/proc/1/root{Path(__file__).resolve()}"])
    attacks = [f"files {paths}", f"escape {paths}", "walk", "proc"]
    statuses = run_tests(HUNT, [{"input": a, "output": SECRET} for a in attacks], SandboxLimits(timeout_s=5))
    assert dict(zip([a.split()[0] for a in attacks], statuses)) == dict.fromkeys(["files", "escape", "walk", "proc"],
                                                                                  "wrong")
    # the hunts do find the secret where the program may read it: its own input (/src/input, its memory, its fd 0)
    reachable = [f"files /src/input {SECRET}", f"walk {SECRET}", f"proc {SECRET}"]
    assert run_tests(HUNT, [{"input": a, "output": SECRET} for a in reachable]) == ["pass"] * 3


def test_host_and_repository_files_are_not_visible(tmp_path):
    """Neither the repository, the caller's cwd and tmp dirs, root's home nor /etc/shadow can be listed or read."""
    dataset = tmp_path / "tests.jsonl"
    dataset.write_text("{}\n")
    home = [p for p in Path.home().iterdir() if not Path(sys.base_prefix).is_relative_to(p)]  # not the interpreter
    paths = [REPO, REPO / "rewards" / "sandbox.py", Path(__file__).resolve(), Path.cwd(), tmp_path, dataset,
             "/etc/shadow", *home]
    probe = program("""
        import os, sys
        seen = []
        for path in sys.stdin.read().split():
            try:
                os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
                seen.append(path)
            except OSError:
                pass
        print(seen)
    """)
    assert run_tests(probe, [{"input": "\n".join(map(str, paths)), "output": "[]"}]) == ["pass"]


PID_1_ATTACKS = ["signals", "mem", "environ", "maps", "auxv", "fd", "fd/0", "fd/1", "root", "cwd", "ptrace",
                 "process_vm_readv"]


def test_pid_1_cannot_be_read_traced_or_signalled():
    """PID 1 is the harness (root, holding every expected output): the program, another uid, gets EPERM/EACCES for
    every way in, and signals do not stop it (the cases after "signals" still run)."""
    attack_pid_1 = program(r"""
        import ctypes, os, signal, sys
        libc = ctypes.CDLL(None, use_errno=True)
        attack = sys.stdin.read()
        try:
            if attack == "signals":
                sent = []
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGSTOP, 9):
                    try:
                        os.kill(1, sig)
                        sent.append(sig)
                    except PermissionError:
                        pass
                if not sent:
                    raise PermissionError
            elif attack == "ptrace":
                if libc.ptrace(16, 1, 0, 0) != 0:  # PTRACE_ATTACH
                    raise OSError(ctypes.get_errno(), "ptrace")
            elif attack == "process_vm_readv":
                buf = ctypes.create_string_buffer(8)
                local, remote = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8), (ctypes.c_void_p * 2)(0x400000, 8)
                if libc.process_vm_readv(1, local, 1, remote, 1, 0) < 0:
                    raise OSError(ctypes.get_errno(), "process_vm_readv")
            elif attack in ("fd", "root", "cwd"):
                os.listdir(f"/proc/1/{attack}")
            else:
                fd = os.open(f"/proc/1/{attack}", os.O_RDONLY | os.O_NONBLOCK)
                try:
                    os.read(fd, 64)
                except BlockingIOError:
                    pass
            print("allowed")
        except PermissionError:
            print("denied")
    """)
    statuses = run_tests(attack_pid_1, [{"input": a, "output": "denied"} for a in PID_1_ATTACKS])
    assert dict(zip(PID_1_ATTACKS, statuses)) == dict.fromkeys(PID_1_ATTACKS, "pass")


def test_setuid_binaries_do_not_give_root():
    """The system dirs are mounted nosuid and the program runs with no_new_privs: exec'ing any setuid/setgid file
    (su, mount, passwd, ...) leaves its ids as they were. The dynamic loader shows the ids the kernel gave the
    exec'd binary (LD_SHOW_AUXV), and stays silent for a privileged exec (AT_SECURE)."""
    host = sorted(str(p) for d in ("/usr/bin", "/usr/sbin") for p in Path(d).iterdir()
                  if p.is_file() and not p.is_symlink() and p.stat().st_mode & (S_ISUID | S_ISGID))
    escalate = program(r"""
        import os, stat, subprocess, sys
        def setid_files():
            for top in ("/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/libexec", "/usr/local", "/etc"):
                for root, dirs, names in os.walk(top):
                    if root.count("/") - top.count("/") >= 2:
                        dirs.clear()
                    for path in (os.path.join(root, name) for name in names):
                        mode = os.lstat(path).st_mode
                        if stat.S_ISREG(mode) and mode & (stat.S_ISUID | stat.S_ISGID):
                            yield os.path.realpath(path)
        found, escalated = set(setid_files()), []
        for path in sorted(found):
            try:
                out = subprocess.run([path, "--version"], env={"LD_SHOW_AUXV": "1"}, stdin=subprocess.DEVNULL,
                                     capture_output=True, timeout=0.5).stdout
            except subprocess.TimeoutExpired as e:  # unix_chkpwd stalls when misused; the loader spoke already
                out = e.stdout or b""
            except PermissionError:
                continue  # not executable by others (dbus-daemon-launch-helper)
            aux = dict(line.split(":", 1) for line in out.decode().splitlines() if line.startswith("AT_"))
            ids = [aux.get(k, "?").strip() for k in ("AT_UID", "AT_EUID", "AT_GID", "AT_EGID", "AT_SECURE")]
            if ids != [str(os.getuid())] * 2 + [str(os.getgid())] * 2 + ["0"]:
                escalated.append((path, ids if aux else "secure exec: the loader kept quiet"))
        with open("/proc/self/status") as f:
            print(next(line for line in f if line.startswith("NoNewPrivs:")).strip())
        print("not found:", sorted(set(sys.stdin.read().split()) - found))
        print("escalated:", escalated, os.geteuid() == os.getuid())
        with open("/proc/self/mountinfo") as f:  # dirs mounted without nosuid (the /dev nodes are files)
            print("suid mounts:", [m[4] for m in map(str.split, f) if os.path.isdir(m[4]) and "nosuid" not in m[5]])
    """)
    expected = "NoNewPrivs:\t1\nnot found: []\nescalated: [] True\nsuid mounts: []"
    assert run_tests(escalate, [{"input": "\n".join(host), "output": expected}], SandboxLimits(timeout_s=10)) == [
        "pass"]


def test_links_reach_no_host_or_read_only_file_and_die_with_the_case():
    """Symlinks to host paths resolve inside the chroot, hard links cannot cross into the program's tmpfs mounts,
    nothing read-only can be written through either, and a link planted in one case is gone in the next."""
    host = [str(REPO / "rewards" / "sandbox.py"), str(Path(__file__).resolve()), "/etc/shadow"]
    links = program(r"""
        import os, sys
        step, *host = sys.stdin.read().split()
        leaks, tag = [], os.urandom(4).hex()
        for planted in ("/work/planted", "/tmp/planted", "/dev/shm/planted"):
            if os.path.lexists(planted):
                leaks.append(f"{planted} survived")
            else:
                os.symlink("/src/prog.py", planted)  # for the next case to find
        read_only = ["/src/prog.py", "/src/input", "/etc/passwd", sys.executable, "/proc/self/fd/0",
                     "/proc/1/root/src/prog.py"]
        for i, target in enumerate(host + read_only):
            link = f"/tmp/s{tag}{i}"
            os.symlink(target, link)
            try:
                open(link, "rb").close()
                if target in host:
                    leaks.append(f"read {target}")
            except OSError:
                pass
            try:
                with open(link, "ab") as f:
                    f.write(b"#")
                leaks.append(f"wrote {target}")
            except OSError:
                pass
            try:
                os.link(target, f"/work/h{tag}{i}")
                leaks.append(f"hard-linked {target}")
            except OSError:
                pass
        print(leaks)
    """)
    cases = [{"input": f"{step} {' '.join(host)}", "output": "[]"} for step in ("plant", "check", "check")]
    assert run_tests(links, cases) == ["pass"] * 3


@pytest.fixture
def private_uid_slots(tmp_path, monkeypatch):
    """``use(n)``: ``n`` uid slots of this test alone (lock files in tmp_path, uids apart from the real range), so
    that sandboxes of other processes on the host neither take them nor share their uids. Returns the first uid."""
    def use(n: int) -> int:
        monkeypatch.setattr(sandbox, "SLOT_DIR", str(tmp_path / "slots"))
        monkeypatch.setattr(sandbox, "UID_BASE", UID_BASE + 100)
        monkeypatch.setattr(sandbox, "UID_SLOTS", n)
        return UID_BASE + 100

    return use


def test_busy_uid_slots_raise_and_run_nothing(private_uid_slots, tmp_path):
    base = private_uid_slots(2)
    held = []
    for slot in range(2):  # as two other workers' sandboxes would
        os.makedirs(sandbox.SLOT_DIR, exist_ok=True)
        held.append(os.open(f"{sandbox.SLOT_DIR}/{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600))
        fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    marker = tmp_path / "ran-unsandboxed"
    probe = program(f"""
        import os
        try:
            open({str(marker)!r}, "w").close()  # only outside a sandbox can this succeed
        except OSError:
            pass
        print(os.getuid())
    """)
    cases = [{"input": "", "output": str(base + i)} for i in range(2)]
    try:
        children = children_of_this_process()
        with pytest.raises(SandboxError, match="all 2 sandbox uids are busy"):
            run_tests(probe, cases)
        assert not marker.exists() and children_of_this_process() == children
        os.close(held.pop())  # slot 1 frees up: the next sandbox gets exactly its uid
        assert run_tests(probe, cases) == ["wrong", "pass"]
        assert not marker.exists()
    finally:
        for fd in held:
            os.close(fd)


def test_concurrent_sandboxes_never_share_a_uid(private_uid_slots):
    base = private_uid_slots(3)
    probe = "import os, time\ntime.sleep(0.3)\nprint(os.getuid())\n"  # each sandbox lives ~1 s: all overlap
    cases = [{"input": "", "output": str(base + i)} for i in range(3)]  # the one that passes names the uid
    start = threading.Barrier(4)

    def call(_):
        start.wait()
        try:
            return run_tests(probe, cases)
        except SandboxError as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, range(4)))
    uids = sorted(base + r.index("pass") for r in results if isinstance(r, list) and r.count("pass") == 1)
    assert uids == [base, base + 1, base + 2]  # three sandboxes at once, three uids
    assert [str(r) for r in results if isinstance(r, SandboxError)] == [
        "all 3 sandbox uids are busy; lower the number of concurrent reward calls"]


def test_busy_threads_are_stopped_in_time_and_the_cpu_limit_covers_them():
    """Several threads spinning in parallel (hashing releases the GIL), SIGXCPU ignored: the case ends at its
    wall-clock limit (or the CPU limit's SIGKILL), nothing survives, and the CPU-time limit, which the kernel counts
    over all threads of the process, is in force while they run, so the sandbox burns at most that much CPU however
    many cores the threads get (with 2 cores the wall clock stops them first)."""
    spin = program("""
        import hashlib, os, resource, signal, sys, threading
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        def burn():
            block = bytes(1 << 20)
            while True:
                hashlib.sha256(block).digest()
        for _ in range(6):
            threading.Thread(target=burn, daemon=True).start()
        if sys.stdin.read() == "limit":
            print(threading.active_count(), resource.getrlimit(resource.RLIMIT_CPU), flush=True)
            os._exit(0)
        threading.Event().wait()
    """)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    statuses = run_tests(spin, [{"input": "limit", "output": "7 (2, 3)"}, {"input": "spin", "output": ""}],
                         SandboxLimits(timeout_s=1, memory_mb=1024))  # room for the threads' malloc arenas
    elapsed = time.monotonic() - start
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    assert statuses[0] == "pass" and statuses[1] in ("timeout", "error")
    assert elapsed < 1 + 4  # one case of 1 s plus start-up, on a busy 2-core machine
    assert cpu < 3 + 1.5  # the hard CPU limit (3 s) plus the harness's and the interpreters' start-up
    assert sandbox_processes() == []


def test_kernel_keyrings_carry_nothing_to_the_next_case_or_sandbox(private_uid_slots):
    """Keyrings belong to a uid, not to a namespace: a key a program stores in its user, user-session or persistent
    keyring would be readable by the next program of that uid (the next case, a later completion's sandbox)."""
    base = private_uid_slots(1)  # every sandbox of this test gets the same uid
    keys = program(r"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
        persistent = libc.syscall(KEYCTL, 22, -1, -2)  # KEYCTL_GET_PERSISTENT, linked to the process keyring
        found = []
        for ring in (-4, -5, persistent):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING, persistent
            if libc.syscall(KEYCTL, 10, ring, b"user", b"fleetrl-note", 0) > 0:  # KEYCTL_SEARCH
                found.append(ring)
            libc.syscall(ADD_KEY, b"user", b"fleetrl-note", b"from an earlier case", 20, ring)
        print(os.getuid(), found)
    """)
    cases = [{"input": "", "output": f"{base} []"}] * 2
    assert run_tests(keys, cases) == ["pass"] * 2
    assert run_tests(keys, cases) == ["pass"] * 2
