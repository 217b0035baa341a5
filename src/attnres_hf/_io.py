"""Writing folders so that a reader never sees a half-written one."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(target: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; when the block succeeds, rename it to `target`.

    On any exception (KeyboardInterrupt included) the temporary folder is deleted and `target` is untouched.
    An existing `target` is swapped out only if `replace` is true, otherwise `FileExistsError` is raised.

    Raises:
        OSError: a write refused with no file named (a full disk's `ENOSPC`, a file-size limit's `EFBIG`, which a
            file object's `write` raises without its name) is raised again naming `target`: "[Errno 28] No space left
            on device: writing TARGET"; other errors as they are.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield staging
        for path in staging.rglob("*"):  # some writers (safetensors) create private files; publish them as usual
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if target.exists():
            if not replace:
                raise FileExistsError(f"{target} already exists; pass --force to replace it")
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            target.rename(retired / "old")
            staging.rename(target)
            shutil.rmtree(retired)
        else:
            staging.rename(target)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        if error.filename is None and error.errno is not None and error.strerror:
            raise type(error)(error.errno, f"{error.strerror}: writing {target}") from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
