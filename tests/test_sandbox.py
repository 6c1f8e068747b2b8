"""The ``code`` reward and its sandbox: scoring, program extraction, and hostile programs that must score 0
without doing harm (checked on the host: no process left, no file written, no connection made, caller alive).

These run real sandboxes (namespaces + chroot), so they need root, like the CI; elsewhere they skip and
:func:`test_non_root_fails_loudly` shows what the sandbox does instead.
"""

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rewards.code import code_reward, extract_program
from rewards.functions import load_reward_function
from rewards.sandbox import (
    UID_BASE,
    UID_SLOTS,
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
    """Host pids of the processes running as any sandbox uid."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue  # exited while we looked
        if UID_BASE <= uid < UID_BASE + UID_SLOTS:
            pids.append(int(status.parent.name))
    return pids


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
        (result,), errors = worker.score([("", SUM, {"tests": SUM_TESTS})])
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
    results, errors = worker.score([("", p, {"tests": tests}) for p in programs])
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert errors == 0 and worker.stats()["errors"] == 0
    assert time.monotonic() - start < 30
    assert sandbox_processes() == []
    (again,), _ = worker.score([("", SUM, {"tests": tests})])
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
