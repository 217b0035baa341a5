"""Supervisor of one sandboxed program (run by `code_execution.run_program` as `python -I _supervisor.py ...`).

Standard library only. It makes itself a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): every process the
program starts, however it detaches (new session, double fork, replaced environment, exec), stays a descendant of
this process, because an orphan is re-parented to its nearest subreaper instead of init. Where the kernel allows it
(`CAP_SYS_ADMIN`, e.g. root outside a restricted container) the program also runs as process 1 of a new PID
namespace, which the kernel empties when the program exits or is killed, and from which the program cannot signal
this supervisor. After the program exits or its time is up, every remaining descendant is killed and reaped.

Usage: `_supervisor.py TIMEOUT CPU_SECONDS MEMORY_BYTES STATUS_FILE ISOLATION -- COMMAND...` (ISOLATION `auto`: a
PID namespace where possible; `subreaper`: never one). The exit status is the program's;
STATUS_FILE receives `timed out` when the wall-clock limit was hit, and the isolation used (`pid-namespace` or
`subreaper`).
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWPID = 0x20000000


def descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from the `ppid` field of `/proc/<pid>/stat`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(b")") + 2 :].split()[1])  # fields after the command name: state, ppid
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all_descendants() -> None:
    """SIGKILL and reap every descendant, repeating until none is left (a process forking meanwhile is caught on
    the next pass; orphans are re-parented to this subreaper, so `waitpid` sees them all)."""
    while True:
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return  # no child left at all
        if not descendants(os.getpid()):
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
        time.sleep(0.01)


def limit_resources(cpu_seconds: int, memory_bytes: int) -> None:
    import resource

    for limit, value in ((resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_AS, memory_bytes),
                         (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # a limit the platform does not allow lowering to this value
            pass


def main(argv: list[str]) -> int:
    timeout, cpu_seconds, memory_bytes, status_file = float(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    wanted, command = argv[4], argv[argv.index("--") + 1 :]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.stderr.write("sandbox: PR_SET_CHILD_SUBREAPER failed; refusing to run the program\n")
        return 125
    isolation = "pid-namespace" if wanted == "auto" and libc.unshare(CLONE_NEWPID) == 0 else "subreaper"
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            limit_resources(cpu_seconds, memory_bytes)
            os.execv(command[0], command)
        finally:
            os._exit(127)
    deadline = time.monotonic() + timeout
    status, timed_out = None, False
    while status is None:
        # reap orphans as they arrive (they are ours), and note the program's own exit
        try:
            done, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if done == pid:
            status = code
        elif done == 0:
            if time.monotonic() >= deadline:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
            else:
                time.sleep(0.005)
    kill_all_descendants()
    with open(status_file, "w") as handle:
        handle.write(("timed out\n" if timed_out else "finished\n") + isolation + "\n")
    if status is None:
        return 137
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
