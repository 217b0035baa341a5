"""Running model-written programs (HumanEval, MBPP) only by explicit opt-in, each in a sandboxed subprocess.

Generated code is untrusted. It runs only when the environment variable `HF_ALLOW_CODE_EVAL=1` is set (the opt-in
that `evaluate`'s `code_eval` metric uses; `attnres eval --allow-code-execution` sets it, lm-eval additionally asks for
`--confirm_run_unsafe_code`). Each program then runs in its own `python -I` process (isolated mode: no user site,
no `PYTHON*` variables) in an empty temporary folder, with a minimal environment, no stdin, output to files in that
folder, a wall-clock time limit, and POSIX resource limits on CPU time, address space, file size, open files and
core dumps. It runs under a small supervisor process (`_supervisor.py`) that is a Linux child subreaper: every process
the program starts, however it detaches (a new session, a double fork, a replaced environment, an exec), stays the
supervisor's descendant, and all of them are killed and reaped before `run_program` returns. Where the kernel allows
it (root with `CAP_SYS_ADMIN`) the program also runs in its own PID namespace, so that it cannot signal the
supervisor either; without one, a program that kills its own supervisor leaves its detached processes to a weaker
backstop (its process group, and processes still carrying the run's marker variable). A program passes only if its
tests ran to the end: it prints a random token after the tests, so exiting early (`sys.exit(0)`, `os._exit(0)`)
counts as a failure.

This bounds accidents (runaway loops, memory blow-ups, stray processes, floods of output); it is not a security
boundary against hostile code: the program runs as the evaluating user, can read and write that user's files and
open network connections, and can read the evaluator's environment through `/proc` (keep tokens out of it). Run
untrusted models in a container or VM as well.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUPERVISOR = Path(__file__).with_name("_supervisor.py")

OPT_IN_VARIABLE = "HF_ALLOW_CODE_EVAL"
REFUSAL = (
    "HumanEval and MBPP score a model by executing the code it writes, which is untrusted. It runs only by explicit "
    "opt-in: pass --allow-code-execution to `attnres eval` (or set HF_ALLOW_CODE_EVAL=1 and pass "
    "--confirm_run_unsafe_code to lm_eval). Each program then runs in a time- and resource-limited subprocess."
)


class CodeExecutionNotAllowed(PermissionError):
    """Code execution was requested without the explicit opt-in."""


def code_execution_allowed() -> bool:
    return os.environ.get(OPT_IN_VARIABLE) == "1"


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool
    status: str  # "passed", "failed", "timed out"
    detail: str = ""


def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment holds `ATTNRES_SANDBOX=<marker>` (Linux `/proc`)."""
    needle = f"ATTNRES_SANDBOX={marker}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _tail(path: Path, size: int = 4096) -> str:
    with path.open("rb") as handle:
        handle.seek(max(0, path.stat().st_size - size))
        return handle.read().decode("utf-8", "replace")


def run_program(program: str, timeout: float = 10.0, memory_mb: int = 2048,
                pid_namespace: bool = True) -> ExecutionResult:
    """Run `program` (Python source) in a sandboxed subprocess; it passes when it runs to its end and exits with 0.

    Args:
        timeout: wall-clock seconds before the process group is killed (CPU time is limited to the same, rounded up).
        memory_mb: address-space limit in MiB.
        pid_namespace: also run the program in its own PID namespace where the kernel allows it (the subreaper
            alone already kills every descendant; False tests that path).

    Raises:
        CodeExecutionNotAllowed: `HF_ALLOW_CODE_EVAL=1` is not set.
    """
    if not code_execution_allowed():
        raise CodeExecutionNotAllowed(REFUSAL)
    token, marker = secrets.token_hex(16), secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="attnres-code-") as temp:
        folder = Path(temp)
        (folder / "program.py").write_text(f"{program}\n\nimport os as _os\n_os.write(1, {token!r}.encode())\n")
        status_file = folder / ".status"
        command = [sys.executable, "-I", str(SUPERVISOR), str(timeout), str(int(timeout) + 1), str(memory_mb << 20),
                   str(status_file), "auto" if pid_namespace else "subreaper", "--", sys.executable, "-I", "program.py"]
        with (folder / "stdout").open("wb") as out, (folder / "stderr").open("wb") as err:
            process = subprocess.Popen(
                command, cwd=folder, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "HOME": temp, "PYTHONHASHSEED": "0", "ATTNRES_SANDBOX": marker},
            )
            try:
                process.wait(timeout=timeout + 30)  # the supervisor enforces `timeout`; this is a backstop
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            status = status_file.read_text().split() if status_file.is_file() else []
            if status[:1] not in (["finished"], ["timed"]):
                # the supervisor itself was killed (e.g. by the program): kill what can still be found
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                _kill_marked(marker)
        timed_out = status[:2] == ["timed", "out"]
        finished = _tail(folder / "stdout", len(token)).endswith(token)
        last = _tail(folder / "stderr").strip().splitlines()[-1:]
    if timed_out:
        return ExecutionResult(False, "timed out", f"killed after {timeout:g} s")
    if process.returncode == 0 and finished:
        return ExecutionResult(True, "passed")
    detail = last[0][:300] if last else f"exit status {process.returncode}"
    if process.returncode == 0:
        detail = "exited before its tests finished"
    return ExecutionResult(False, "failed", detail)


def pass_at_1(references: list[str], predictions: list[list[str]], timeout: float = 10.0) -> float:
    """pass@1 of one sample: `predictions[0][0]` (a complete program) followed by `references[0]` (its tests) must
    run to completion. Greedy decoding, one sample per problem, so pass@1 is the pass rate (Chen et al. 2021, Eq. 1
    with n = k = 1)."""
    program = predictions[0][0] + "\n\n" + references[0] + "\n"
    return float(run_program(program, timeout=timeout).passed)
