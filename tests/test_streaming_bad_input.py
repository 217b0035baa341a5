"""Bad input for a streamed conversion, beyond the cases of tests/test_streaming.py (a shard missing, cut 100 bytes
short, a tensor in two shards, an in-process failure while writing): a shard cut in the middle, an index
that names a tensor no shard holds or lists a tensor twice, a disk that fills while a shard is written (a real write
refused by the kernel), and `attnres convert --stream` stopped by SIGINT or SIGTERM while it writes.
Each ends in one line naming the file, tensor or signal, with no output or staging folder left and the source's files
unchanged."""

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf.cli import main
from attnres_hf.conversion import convert
from utils import TINY


def write_source(folder: Path) -> None:
    """A tiny bf16 Llama checkpoint in several shards, as the Hub's are."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")


def fingerprint(folder: Path) -> dict[str, str]:
    """Each file's SHA-256: the source is left as it was, byte for byte."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def refused(tmp_path: Path, capsys) -> str:
    """`convert(stream=True)` and `attnres convert --stream` both refuse: the error's one line (the CLI prints the
    same line), nothing written."""
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        convert(tmp_path / "src", tmp_path / "out", stream=True)
    message = str(error.value)
    assert "\n" not in message, message
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--stream"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert printed[-1] == f"attnres convert: error: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging folder
    return message


def test_a_shard_cut_in_the_middle_names_it(tmp_path, capsys):
    """A download stopped half-way through a shard (its header whole, its tensors not): one line naming the shard."""
    write_source(tmp_path / "src")
    shard = shards(tmp_path / "src")[1]
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    before = fingerprint(tmp_path / "src")
    assert shard.name in refused(tmp_path, capsys)
    assert fingerprint(tmp_path / "src") == before


def test_an_index_naming_a_tensor_its_shard_lacks(tmp_path, capsys):
    """The index lists a weight in a shard that does not hold it, and no shard does (a re-shard that lost it): one line
    naming the weight; an index entry for a tensor the model does not use, held by no shard, is a warning naming it
    (transformers reads only the index's list of shards), and the conversion is complete and checked."""
    write_source(tmp_path / "src")
    index_file = tmp_path / "src" / "model.safetensors.index.json"
    lost = "model.layers.1.mlp.down_proj.weight"
    shard = tmp_path / "src" / json.loads(index_file.read_text())["weight_map"][lost]
    tensors = load_file(shard)
    del tensors[lost]
    save_file(tensors, shard, metadata={"format": "pt"})
    before = fingerprint(tmp_path / "src")
    with pytest.warns(UserWarning, match=f"listed by the index but in no shard: {lost}"):
        assert lost in refused(tmp_path, capsys)
    assert fingerprint(tmp_path / "src") == before

    write_source(tmp_path / "extra")
    index_file = tmp_path / "extra" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shards(tmp_path / "extra")[0].name
    index_file.write_text(json.dumps(index))
    with pytest.warns(UserWarning, match=r"listed by the index but in no shard: model\.layers\.9\.mlp\.up_proj\.weight"):
        report = convert(tmp_path / "extra", tmp_path / "extra-out", stream=True)
    assert report["conversion"]["mode"] == "streamed" and report["verification"]["greedy_match"]


def test_an_index_listing_a_tensor_twice_names_it(tmp_path, capsys):
    """An index whose `weight_map` lists one tensor twice, in two shards (a hand-merged index: JSON readers keep one
    of the two silently): one line naming the index, the tensor and both shards."""
    write_source(tmp_path / "src")
    index_file = tmp_path / "src" / "model.safetensors.index.json"
    first, second = (path.name for path in shards(tmp_path / "src")[:2])
    text = index_file.read_text()
    name = "model.norm.weight"
    index_file.write_text(text.replace('"weight_map": {', f'"weight_map": {{\n    "{name}": "{first}",\n    "{name}": '
                                                          f'"{second}",', 1))
    before = fingerprint(tmp_path / "src")
    message = refused(tmp_path, capsys)
    assert index_file.name in message and name in message and first in message and second in message, message
    assert fingerprint(tmp_path / "src") == before


def test_a_disk_that_fills_while_writing_leaves_nothing(tmp_path, capsys):
    """A real write refused by the kernel part-way through the weights (this process's files capped at 64 KiB by
    `RLIMIT_FSIZE` while the command runs, SIGXFSZ ignored: the output's one shard is three times that, every other
    file it writes smaller; the same `OSError` a full disk raises from `write`): exit code 2, one line naming the
    error and the output folder, no output or staging folder, the source unchanged."""
    resource = pytest.importorskip("resource")  # (POSIX)
    write_source(tmp_path / "src")
    before = fingerprint(tmp_path / "src")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, hard))
    try:
        code = main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--stream", "--dtype", "float32"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == f"attnres convert: error: [Errno 27] File too large: writing {tmp_path / 'out'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert fingerprint(tmp_path / "src") == before


@pytest.mark.parametrize("signum, code, line", [(signal.SIGINT, 130, "attnres convert: interrupted (SIGINT)"),
                                                (signal.SIGTERM, 143, "attnres convert: stopped (SIGTERM)")])
def test_a_conversion_stopped_by_a_signal_mid_write_leaves_nothing(tmp_path, monkeypatch, capsys, signum, code, line):
    """Ctrl-C (SIGINT) or a scheduler's stop (SIGTERM) delivered to `attnres convert --stream` while it writes a shard
    (sent by the process to itself at the second tensor, with Python's own SIGINT handler, as in a terminal: a
    background job inherits SIGINT ignored): exit code 130 or 143 with one line saying so, no traceback, no output or
    staging folder, the source unchanged, and the SIGTERM handler the previous one again afterwards."""
    from attnres_hf.conversion import streaming

    write_source(tmp_path / "src")
    before = fingerprint(tmp_path / "src")
    real, calls = streaming._chunks, []

    def stopped(plan, name, chunk_bytes):
        calls.append(name)
        if len(calls) == 2:
            assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]  # mid-write: staging exists
            os.kill(os.getpid(), signum)
        yield from real(plan, name, chunk_bytes)

    monkeypatch.setattr(streaming, "_chunks", stopped)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            returned = main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--stream"])
        except SystemExit as exit_:
            returned = exit_.code
        assert signal.getsignal(signal.SIGTERM) == handlers[1]
    finally:
        signal.signal(signal.SIGINT, handlers[0])
    err = capsys.readouterr().err
    assert returned == code and err.strip().splitlines()[-1] == line and "Traceback" not in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert fingerprint(tmp_path / "src") == before
