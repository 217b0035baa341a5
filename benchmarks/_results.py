"""Results fragments: `docs/results/*.md` is where each measured number lives, written by the benchmark that measured
it (`--results PATH`) and included by the docs pages (`--8<-- "docs/results/NAME.md"`), never retyped.

A fragment is self-contained Markdown without a top-level heading: a provenance paragraph generated from the run
itself (the command as given, the UTC date, the wall time, the machine, the torch and transformers versions, the
git commit of the checkout, the 1-minute load average at start and end), then the tables and verdict lines the
benchmark printed (the same text: one formatting function per benchmark). Running the command again replaces the
file; it is written to a temporary file first and renamed, so a stopped run never leaves half a file.

    from _results import Run               # a benchmark, at the start of main()
    measured = Run(__file__, argv)
    ...
    print(text)
    if args.results:
        measured.write(args.results, text, device=args.device)
"""

import argparse
import datetime
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str | None:
    """The CPU's model name (`/proc/cpuinfo`, else `lscpu`'s 'Model name'), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return None


def memory_gib() -> float | None:
    """Total RAM in GiB (`/proc/meminfo`), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def git_commit(root: Path | None = None) -> str | None:
    """The short commit of the checkout at `root` (default: this one), with ' + local changes' when tracked files
    differ from it; None without git or outside a checkout."""
    root = ROOT if root is None else root
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" + local changes" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def machine(device: str = "cpu") -> str:
    """`Intel(R) Xeon(R) Processor, 2 cores (torch threads: 2), 23.5 GiB RAM[, GPU NAME, CUDA 13.0]`."""
    import torch

    parts = [cpu_model() or "unknown CPU",
             f"{os.cpu_count()} cores (torch threads: {torch.get_num_threads()})"]
    if (ram := memory_gib()) is not None:
        parts.append(f"{ram:.1f} GiB RAM")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        parts.append(f"{torch.cuda.get_device_name(torch.device(device))}, CUDA {torch.version.cuda}")
    return ", ".join(parts)


def versions() -> str:
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def results_path(value: str) -> Path:
    """`--results PATH` checked when the arguments are parsed, not after an hour of measuring: not empty, not a
    folder, under a folder that exists (or can be made) and is writable. Returns the absolute path.

    Raises:
        argparse.ArgumentTypeError: the path cannot take the fragment (argparse turns it into a usage error).
    """
    if not value:
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(value).expanduser().absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a folder: give the fragment's file name (e.g. {value}/NAME.md)")
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value}: {ancestor} is not writable")
    return path


def _from_root(argv: list[str]) -> list[str]:
    """`argv` with the `--results` path as seen from the checkout's root (where the recorded command runs), so the
    recorded command rewrites the same file from there; a path outside the checkout stays absolute."""
    def from_root(value: str) -> str:
        path = Path(os.path.abspath(Path(value).expanduser()))  # `..` resolved, links kept
        return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)

    out = []
    for index, arg in enumerate(argv):
        if index and argv[index - 1] == "--results" and arg:
            arg = from_root(arg)
        elif arg.startswith("--results=") and len(arg) > len("--results="):
            arg = "--results=" + from_root(arg[len("--results="):])
        out.append(arg)
    return out


def command_line(script: str, argv: list[str]) -> str:
    """The command as it runs from the checkout's root: `python benchmarks/SCRIPT ARGS` (`torchrun
    --nproc-per-node N ...` under torchrun), the `--results` path relative to the root."""
    launcher = "python"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])}"
    return f"{launcher} {shlex.join([f'benchmarks/{Path(script).name}', *_from_root(argv)])}"


def body_digest(text: str) -> str:
    """The first 12 hex digits of the SHA-256 of a fragment's body (what follows the provenance paragraph, stripped):
    the provenance states it, so a hand edit of a measured number shows (`tests/test_docs.py` recomputes it)."""
    return hashlib.sha256(text.strip().encode()).hexdigest()[:12]


def format_seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def format_load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


class Run:
    """One benchmark run: what its provenance needs from the start (time, load, commit); `write` adds the rest.
    Picklable (a spawned process can write the fragment)."""

    def __init__(self, script: str, argv: list[str] | None = None):
        self.command = command_line(script, list(sys.argv[1:] if argv is None else argv))
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.clock = time.perf_counter()
        self.load_start = load_average()
        self.commit = git_commit()

    def provenance(self, device: str = "cpu", notes: str = "") -> str:
        """The fragment's first paragraph."""
        wall = time.perf_counter() - self.clock
        commit = f"commit {self.commit}" if self.commit else "no git commit (not a checkout)"
        return (f"Measured by `{self.command}` on {self.started:%Y-%m-%d %H:%M} UTC (wall time "
                f"{format_seconds(wall)}, Python's start-up and imports not counted), on {machine(device)}; {versions()}; {commit}; 1-minute load average "
                f"{format_load(self.load_start)} at the start, {format_load(load_average())} at the end "
                f"({os.cpu_count()} cores; the run's own processes count in it). {notes + ' ' if notes else ''}"
                "Running the command again replaces this file.")

    def write(self, path: str | os.PathLike, text: str, device: str = "cpu", notes: str = "") -> Path:
        """Write the fragment: the provenance paragraph, a blank line, `text` (what the benchmark printed)."""
        return write_fragment(path, self.provenance(device, notes), text)


def write_fragment(path: str | os.PathLike, provenance: str, text: str) -> Path:
    """`provenance` (ending with the body's digest, `body_digest`), a blank line and `text` to `path`, atomically (a
    temporary file in the same folder, renamed); creates the folder; replaces an earlier file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f"{provenance.strip()} Body digest {body_digest(text)}.\n\n{text.strip()}\n"
    return _write_atomically(path, body)


def _write_atomically(path: Path, text: str) -> Path:
    """`text` to `path` through a temporary file in the same folder, renamed (a stopped run leaves no half file)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temporary, 0o644)  # mkstemp's 0600 is for secrets, not for docs
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def run_cases(doc: str, script: str, argv: list[str] | None, cases, measure, table) -> int:
    """`main()` of a benchmark that measures each of its `cases` in a temporary folder (`measure(*case, root, seed)`,
    the seed its position) and prints `table(rows)`; `--results PATH` also writes it with how it was measured."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--results", metavar="PATH", type=results_path,
                        help="also write the table, with how it was measured, to PATH (a Markdown fragment)")
    args = parser.parse_args(argv)
    measured = Run(script, sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as root:
        rows = [measure(*case, Path(root), seed) for seed, case in enumerate(cases)]
    text = table(rows)
    print(text)
    if args.results:
        measured.write(args.results, text)
    return 0


README = ROOT / "README.md"


def readme_block(name: str) -> tuple[str, str] | None:
    """The README's generated block `name`: `(opening marker, closing marker)` when the README has both, else None."""
    opening, closing = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    text = README.read_text(encoding="utf-8") if README.is_file() else ""
    return (opening, closing) if opening in text and closing in text.split(opening, 1)[1] else None


def write_readme_block(name: str, text: str) -> Path:
    """Replace what stands between the README's markers `<!-- results:NAME -->` and `<!-- /results:NAME -->` with
    `text` (a summary a benchmark wrote, e.g. its verdicts, pointing at its fragment), atomically.

    Raises:
        ValueError: the README has no such block.
    """
    markers = readme_block(name)
    if markers is None:
        raise ValueError(f"README.md has no block <!-- results:{name} --> ... <!-- /results:{name} -->")
    opening, closing = markers
    before, rest = README.read_text(encoding="utf-8").split(opening, 1)
    after = rest.split(closing, 1)[1]
    return _write_atomically(README, f"{before}{opening}\n{text.strip()}\n{closing}{after}")
