"""Running model-written programs (HumanEval, MBPP) only by explicit opt-in, each in a sandboxed subprocess.

Generated code is untrusted. It runs only when the environment variable `HF_ALLOW_CODE_EVAL=1` is set (the opt-in
that `evaluate`'s `code_eval` metric uses; `attnres eval --allow-code-execution` sets it, lm-eval additionally asks for
`--confirm_run_unsafe_code`). Each program then runs in its own `python -I` process (isolated mode: no user site,
no `PYTHON*` variables) in an empty temporary folder, with a minimal environment, no stdin, a wall-clock time limit,
and POSIX resource limits on CPU time, address space, file size, open files and core dumps; the whole process group
is killed on timeout. This bounds accidents (runaway loops, memory blow-ups, stray files); it is not a security
boundary against hostile code, so run untrusted models in a container or VM as well.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

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


def _limits(cpu_seconds: int, memory_bytes: int) -> None:  # runs in the child before exec
    import resource

    os.setsid()
    for limit, value in ((resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_AS, memory_bytes),
                         (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # a limit the platform does not allow lowering to this value
            pass


def run_program(program: str, timeout: float = 10.0, memory_mb: int = 2048) -> ExecutionResult:
    """Run `program` (Python source) in a sandboxed subprocess; it passes when it exits with status 0.

    Args:
        timeout: wall-clock seconds before the process group is killed (CPU time is limited to the same, rounded up).
        memory_mb: address-space limit in MiB.

    Raises:
        CodeExecutionNotAllowed: `HF_ALLOW_CODE_EVAL=1` is not set.
    """
    if not code_execution_allowed():
        raise CodeExecutionNotAllowed(REFUSAL)
    with tempfile.TemporaryDirectory(prefix="attnres-code-") as folder:
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", program], cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": folder, "PYTHONHASHSEED": "0"},
            preexec_fn=lambda: _limits(int(timeout) + 1, memory_mb << 20),  # noqa: PLW1509  (setrlimit only)
        )
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.communicate()
            return ExecutionResult(False, "timed out", f"killed after {timeout:g} s")
    if process.returncode == 0:
        return ExecutionResult(True, "passed")
    last = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {process.returncode}"]
    return ExecutionResult(False, "failed", last[0][:300])


def pass_at_1(references: list[str], predictions: list[list[str]], timeout: float = 10.0) -> float:
    """pass@1 of one sample: `predictions[0][0]` (a complete program) followed by `references[0]` (its tests) must
    run to completion. Greedy decoding, one sample per problem, so pass@1 is the pass rate (Chen et al. 2021, Eq. 1
    with n = k = 1)."""
    program = predictions[0][0] + "\n\n" + references[0] + "\n"
    return float(run_program(program, timeout=timeout).passed)
