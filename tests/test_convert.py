"""`attnres convert`: GGUF and HF sources, the written folder, and bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM

import importlib
from attnres_hf.cli import main
from utils import TINY
from gguf_fixtures import write_gguf
from test_save_load import REMOTE_SCRIPT

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_source(family, tie=False, fp16_exact=False):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**TINY, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            if fp16_exact:  # so that an F16 file holds exactly these weights
                param.copy_(param.half().float())
    return model


def logits(model, seed=1):
    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def run_cli(*args):
    return main(["convert", *map(str, args)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["F32", "F16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_file_converts_to_the_hf_originals_logits(family, dtype, tmp_path):
    """Catches the q/k permutation and dropped-bias faults of GGUF conversions."""
    source = tiny_source(family, fp16_exact=dtype == np.float16)
    gguf_path = write_gguf(source, tmp_path / f"tiny-{family}.gguf", dtype)
    assert run_cli(gguf_path, tmp_path / "out", "--block-size", "2") == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.attnres_block_size == 2
    assert (logits(converted) - logits(source)).abs().max().item() <= 1e-5
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["verification"]["greedy_match"] and report["verification"]["max_abs_logit_delta"] <= 1e-5


def test_hf_folder_converts_to_a_complete_folder_that_loads_and_round_trips(tmp_path):
    source = tiny_source("qwen2", tie=True)
    source.save_pretrained(tmp_path / "source")
    assert run_cli(tmp_path / "source", tmp_path / "out", "--full", "--dtype", "float32") == 0
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md", "conversion_report.json",
            "modeling_attnres.py", "configuration_attnres.py"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging folder left
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "Full Attention Residuals" in card and "arXiv:2603.15031" in card
    assert "max abs logit delta vs source" in card

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.attnres_block_size == 1 and loaded.config.tie_word_embeddings
    torch.testing.assert_close(logits(loaded), logits(source), atol=1e-5, rtol=0)
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    torch.testing.assert_close(logits(again), logits(loaded), atol=0, rtol=0)

    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(out), json.dumps(ids.tolist())],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1])["logits"])
    torch.testing.assert_close(remote, logits(source), atol=1e-5, rtol=0)


def test_bfloat16_output_and_residual_baseline(tmp_path):
    source = tiny_source("llama")
    source.save_pretrained(tmp_path / "source")
    assert run_cli(tmp_path / "source", tmp_path / "bf16", "--dtype", "bfloat16") == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16
    assert run_cli(tmp_path / "source", tmp_path / "res", "--depth-mixing", "residual") == 0
    residual = AutoModelForCausalLM.from_pretrained(tmp_path / "res").eval()
    assert residual.config.depth_mixing == "residual"
    torch.testing.assert_close(logits(residual), logits(source), atol=1e-5, rtol=0)


def _bad_input_error(capsys, *args):
    assert run_cli(*args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnres convert: error:")]
    assert len(lines) == 1
    return lines[0]


def test_unsupported_model_type_is_refused(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    error = _bad_input_error(capsys, tmp_path / "gpt2", tmp_path / "out")
    assert "unsupported model_type 'gpt2'" in error
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_is_refused(tmp_path, capsys):
    gguf_path = write_gguf(tiny_source("llama"), tmp_path / "tiny.gguf")
    data = gguf_path.read_bytes()
    for cut, name in ((len(data) // 2, "half.gguf"), (100, "header.gguf")):
        (tmp_path / name).write_bytes(data[:cut])
        error = _bad_input_error(capsys, tmp_path / name, tmp_path / "out")
        assert "truncated" in error and name in error
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    assert "is not a GGUF file" in _bad_input_error(capsys, tmp_path / "not.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_invalid_block_size_is_refused_before_loading_weights(tmp_path, capsys, monkeypatch):
    tiny_source("llama").save_pretrained(tmp_path / "source")
    convert_module = importlib.import_module("attnres_hf.conversion.convert")
    monkeypatch.setattr(convert_module, "load_source", lambda *a, **k: pytest.fail("weights were loaded"))
    error = _bad_input_error(capsys, tmp_path / "source", tmp_path / "out", "--block-size", "3")
    assert "attnres_block_size must be 1 (Full AttnRes) or a positive even number" in error
    assert not (tmp_path / "out").exists()


def test_written_files_are_readable_by_others(tmp_path):
    import os
    import stat

    tiny_source("llama").save_pretrained(tmp_path / "source")
    umask = os.umask(0o022)
    try:
        assert run_cli(tmp_path / "source", tmp_path / "out") == 0
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "out", *(tmp_path / "out").iterdir()]}
    assert modes["out"] == 0o755 and modes["model.safetensors"] == 0o644, modes


def test_folder_without_weights_is_refused(tmp_path, capsys):
    tiny_source("llama").config.save_pretrained(tmp_path / "empty")
    assert "has no model weights" in _bad_input_error(capsys, tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_kept_unless_forced(tmp_path, capsys):
    tiny_source("llama").save_pretrained(tmp_path / "source")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    assert "already exists; pass --force" in _bad_input_error(capsys, tmp_path / "source", tmp_path / "out")
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"
    assert run_cli(tmp_path / "source", tmp_path / "out", "--force") == 0
    assert not (tmp_path / "out" / "precious.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]


def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    tiny_source("llama").save_pretrained(tmp_path / "source")

    def interrupted(report):
        raise KeyboardInterrupt

    convert_module = importlib.import_module("attnres_hf.conversion.convert")
    monkeypatch.setattr(convert_module, "model_card", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_module.convert(tmp_path / "source", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
