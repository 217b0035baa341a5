"""`attnres convert`: GGUF and HF sources, the written folder, and bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import importlib
import re

from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from attnres_hf.cli import main
from attnres_hf.conversion import (GGUF_PRE_TOKENIZERS, check_against_gguf, check_torch_file, load_gguf_tokenizer,
                                   load_source_config, retrofit)
from utils import TINY
from gguf_fixtures import byte_level, llama_cpp_split, write_gguf
from test_save_load import REMOTE_SCRIPT

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
# the GGUF kinds: what transformers' GGUF config mapping leaves out is each source's point
GGUF_SOURCES = {
    "llama-attn-mlp-bias": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "llama-head-dim-16": (LlamaConfig, LlamaForCausalLM, dict(head_dim=16)),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "qwen2-qkv-bias": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3-head-dim-16": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
}


def _randomize(model, fp16_exact=False):
    with torch.no_grad():  # random biases and norms, so that a dropped one shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
            if fp16_exact:  # so that an F16 file holds exactly these weights
                param.copy_(param.half().float())
    return model


def tiny_source(family, tie=False, fp16_exact=False):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    return _randomize(model_class(config_class(**TINY, tie_word_embeddings=tie)).eval(), fp16_exact)


def gguf_source(name, tie=False, fp16_exact=False):
    config_class, model_class, extra = GGUF_SOURCES[name]
    torch.manual_seed(0)
    config = config_class(**TINY, **extra, tie_word_embeddings=tie)
    if name == "mistral":
        config.sliding_window = None  # llama.cpp's Llama layout stores no window
    return _randomize(model_class(config).eval(), fp16_exact)


def logits(model, seed=1):
    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def run_cli(*args):
    return main(["convert", *map(str, args)])


def _report(folder):
    return json.loads((folder / "conversion_report.json").read_text())


@pytest.mark.parametrize("file_type", ["F32", "F16"])
@pytest.mark.parametrize("name", list(GGUF_SOURCES))
def test_gguf_file_converts_to_the_hf_originals_logits(name, file_type, tmp_path):
    """Every tensor of the file reaches the model: biases (q/k permuted like the weights), head_dim != hidden/heads
    (transformers' mapping reads neither), tied and untied heads; the report checks the file's own tensors."""
    source = gguf_source(name, tie=name.startswith("qwen"), fp16_exact=file_type == "F16")
    gguf_path = write_gguf(source, tmp_path / f"tiny-{name}.gguf", file_type)
    assert run_cli(gguf_path, tmp_path / "out", "--block-size", "2") == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.attnres_block_size == 2
    assert getattr(converted.config, "head_dim", 8) == getattr(source.config, "head_dim", 8)  # Qwen2Config has none
    assert (logits(converted) - logits(source)).abs().max().item() <= 1e-5
    verification = _report(tmp_path / "out")["verification"]
    assert verification["greedy_match"] and verification["max_abs_logit_delta"] <= 1e-5
    held = len(source.state_dict()) - source.config.tie_word_embeddings
    # by default a sample: every weight outside the layers, and each layer weight in the first and last layer
    per_layer, layers = sum(k.startswith("model.layers.0.") for k in source.state_dict()), source.config.num_hidden_layers
    sampled = held - per_layer * (layers - 2)
    assert (verification["gguf_tensors_checked"], verification["gguf_tensors"]) == (sampled, held)
    assert verification["gguf_max_abs_delta"] == 0.0
    assert (f"| GGUF tensors equal to the file's (dequantised) | {sampled} of {held} (a sample: each tensor kind in "
            "the first and last block), max abs delta 0 |") in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("name", ["llama-attn-mlp-bias", "qwen3-head-dim-16"])
def test_q8_0_gguf_holds_the_files_dequantised_tensors(name, tmp_path):
    """A quantised file converts to its own dequantised weights (not to the fp32 original, which it no longer holds)."""
    import gguf

    source = gguf_source(name)
    gguf_path = write_gguf(source, tmp_path / "q8.gguf", "Q8_0")
    model = retrofit(gguf_path, attnres_block_size=2)
    reader = gguf.GGUFReader(gguf_path)
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}
    state = model.state_dict()
    norm = next(t for t in reader.tensors if t.name == "blk.1.attn_norm.weight")  # 1-D tensors stay F32
    torch.testing.assert_close(state["model.layers.1.input_layernorm.weight"], torch.tensor(norm.data), atol=0, rtol=0)
    down = next(t for t in reader.tensors if t.name == "blk.2.ffn_down.weight")  # no q/k permutation to undo here
    expected = torch.tensor(gguf.dequantize(down.data, down.tensor_type))
    torch.testing.assert_close(state["model.layers.2.mlp.down_proj.weight"], expected, atol=0, rtol=0)
    assert check_against_gguf(model, gguf_path, source_config=source.config)["gguf_max_abs_delta"] == 0.0
    assert (logits(model) - logits(source)).abs().max().item() < 0.05  # the 8-bit rounding, not a dropped tensor


def test_gguf_head_dim_comes_from_the_key_tensor_without_key_length(tmp_path):
    source = gguf_source("qwen3-head-dim-16")
    model = retrofit(write_gguf(source, tmp_path / "q3.gguf", key_length=False))
    assert model.config.head_dim == 16
    assert (logits(model) - logits(source)).abs().max().item() <= 1e-5


EXTRA_TENSORS = {  # tensor added to a Llama-layout file -> what the one-line error says
    "unknown-name": ("blk.1.attn_gizmo.weight", "has tensors the conversion would drop (no llama parameter"),
    "moe-router": ("blk.0.ffn_gate_inp.weight", "has tensors the conversion would drop (no llama parameter"),
    "rope-freqs": ("rope_freqs.weight", "has tensors the conversion would drop (rope frequency factors"),
    "q-bias-alone": ("blk.2.attn_q.bias", "holds no tensor for the llama model's model.layers.0.self_attn.k_proj.bias"),
}


@pytest.mark.parametrize("kind", list(EXTRA_TENSORS))
def test_a_gguf_tensor_the_model_has_no_place_for_stops_the_conversion(kind, tmp_path, capsys, monkeypatch):
    tensor, says = EXTRA_TENSORS[kind]
    gguf_path = write_gguf(gguf_source("mistral"), tmp_path / "extra.gguf", extra_tensors={tensor: np.ones(32, np.float32)})
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights were loaded"))
    error = _bad_input_error(capsys, gguf_path, tmp_path / "out")
    assert "extra.gguf" in error and says in error and (tensor in error or kind == "q-bias-alone"), error
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=re.escape(says)):
        retrofit(gguf_path)


def test_verification_compares_the_weights_with_the_files_tensors(tmp_path, monkeypatch):
    """A loader that drops or alters a tensor is caught against the file itself, whatever the logits say."""
    source = gguf_source("llama-attn-mlp-bias")
    gguf_path = write_gguf(source, tmp_path / "tiny.gguf")
    model, config = retrofit(gguf_path), load_source_config(gguf_path)
    assert check_against_gguf(model, gguf_path, config) == {"gguf_tensors_checked": 51, "gguf_tensors": 51,
                                                            "gguf_max_abs_delta": 0.0}  # 16 a layer
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.bias[3] += 1e-3
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias differs from tensor "
                                         r"blk\.1\.attn_k\.bias"):
        check_against_gguf(model, gguf_path, config)

    # a source loaded without its biases (what transformers' GGUF config mapping alone gives) is refused
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module, "gguf_config_fields", lambda *a: {})
    # (the key table of a bias-less Llama, derived from its adapter, has no place for the file's biases)
    dropped = r"tiny\.gguf has tensors the conversion would drop \(no llama parameter holds them\): blk\.0\.attn_q\.bias"
    with pytest.raises(ValueError, match=dropped):
        retrofit(gguf_path)
    # and were that check skipped, transformers' silent drop is caught against the file after loading
    monkeypatch.setattr(retrofit_module, "check_gguf_coverage", lambda *a: None)
    with pytest.raises(ValueError, match=dropped):
        retrofit(gguf_path)


def test_the_sampled_gguf_check_reads_each_tensor_kind_in_the_first_and_last_block(tmp_path):
    """The default weight check (`sample=True`, `attnres convert` without --verify-all) compares every tensor outside
    the blocks and each kind of block tensor in the first and last block: a wrong value there is caught, one in a
    middle block only by the complete check."""
    import gguf

    from attnres_hf.conversion import sampled_gguf_tensors

    source = gguf_source("llama-attn-mlp-bias")
    gguf_path = write_gguf(source, tmp_path / "tiny.gguf")
    model, config = retrofit(gguf_path), load_source_config(gguf_path)
    names = [tensor.name for tensor in gguf.GGUFReader(gguf_path).tensors]
    kinds, last = {name.split(".", 2)[2] for name in names if name.startswith("blk.")}, config.num_hidden_layers - 1
    assert last == 2 and len(kinds) == 16
    assert set(sampled_gguf_tensors(names)) == ({name for name in names if not name.startswith("blk.")}
                                                | {f"blk.{block}.{kind}" for block in (0, last) for kind in kinds})
    assert check_against_gguf(model, gguf_path, config, sample=True) == {
        "gguf_tensors_checked": 3 + 2 * 16, "gguf_tensors": 51, "gguf_max_abs_delta": 0.0}
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    assert check_against_gguf(model, gguf_path, config, sample=True)["gguf_max_abs_delta"] == 0.0
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight differs from tensor blk\.1\."):
        check_against_gguf(model, gguf_path, config)
    for layer, module in ((0, "self_attn.k_proj.bias"), (last, "self_attn.q_proj.weight"), (None, "model.norm.weight")):
        target = model.get_parameter(module if layer is None else f"model.layers.{layer}.{module}")
        with torch.no_grad():
            target.view(-1)[1] += 1e-3
        with pytest.raises(ValueError, match="differs from tensor"):
            check_against_gguf(model, gguf_path, config, sample=True)
        with torch.no_grad():
            target.view(-1)[1] -= 1e-3


def test_convert_says_what_the_gguf_check_compared_and_verify_all_compares_every_weight(tmp_path, capsys):
    source = gguf_source("llama-head-dim-16")
    gguf_path = write_gguf(source, tmp_path / "tiny.gguf")
    held = len(source.state_dict())
    assert run_cli(gguf_path, tmp_path / "sampled") == 0
    out = capsys.readouterr().out
    assert f"weights equal to the GGUF file's tensors: {3 + 2 * 9} of {held} (sampled: each tensor kind" in out
    assert run_cli(gguf_path, tmp_path / "all", "--verify-all") == 0
    assert f"weights equal to the GGUF file's tensors: {held} of {held}, max |delta| 0" in capsys.readouterr().out
    verification = _report(tmp_path / "all")["verification"]
    assert (verification["gguf_tensors_checked"], verification["gguf_tensors"]) == (held, held)
    assert f"| {held} of {held}, max abs delta 0 |" in (tmp_path / "all" / "README.md").read_text()


@pytest.mark.parametrize("argv, says", [
    (["--blok-size", "4", "SRC", "OUT"], "unrecognized arguments: --blok-size OUT (--blok-size: did you mean --block-size?)"),
    (["SRC", "OUT", "--blok-size=4"], "(--blok-size: did you mean --block-size?)"),
    (["SRC", "OUT", "--verify_all"], "(--verify_all: did you mean --verify-all?)"),
    (["SRC", "OUT", "--ful", "--forse"], "(--ful: did you mean --full?; --forse: did you mean --force?)"),
])
def test_a_misspelt_option_is_named_with_the_nearest_one_before_anything_loads(argv, says, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli(*argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and err.strip().splitlines()[-1].startswith("attnres convert: error")
    assert not list(tmp_path.iterdir())


def test_a_number_for_source_says_it_is_an_options_value(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli("4", "OUT") == 2
    assert capsys.readouterr().err == ("attnres convert: error: SOURCE 4 does not exist: a number there is the value "
                                       "of a misspelt or missing option (--block-size 4?)\n")


def test_convert_help_tells_what_block_size_takes(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "sub-layers per block: 1 (Full AttnRes, as --full) or an even number" in help_text
    assert "--verify-all" in help_text and "(even;" not in help_text


@pytest.mark.slow
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
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["source"]["name"] == str(tmp_path / "source") and f"`{tmp_path / 'source'}`" in card

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


def test_dtype_auto_is_the_source_checkpoints_dtype_as_transformers_reads_it(tmp_path):
    """dtype="auto" keeps transformers' meaning: the dtype in the checkpoint's config, else of its first floating
    weight (a GGUF file: what transformers' GGUF loader gives); the default stays float32."""
    from attnres_hf.conversion import convert

    source = tiny_source("llama")
    source.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    source.to(torch.float16).save_pretrained(tmp_path / "fp16")
    config = json.loads((tmp_path / "fp16" / "config.json").read_text())
    (tmp_path / "fp16" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "dtype"}))
    for folder, dtype in ((tmp_path / "bf16", torch.bfloat16), (tmp_path / "fp16", torch.float16)):
        assert AutoModelForCausalLM.from_pretrained(folder, dtype="auto").dtype == dtype  # transformers' reading
        assert retrofit(folder, dtype="auto").dtype == dtype
        assert retrofit(folder).dtype == torch.float32
    assert run_cli(tmp_path / "bf16", tmp_path / "out", "--dtype", "auto") == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").dtype == torch.bfloat16
    assert _report(tmp_path / "out")["dtype"] == "bfloat16"
    convert(tiny_source("llama").half(), tmp_path / "memory", dtype="auto")  # an in-memory source: its own dtype
    assert _report(tmp_path / "memory")["dtype"] == "float16"
    write_gguf(tiny_source("llama", fp16_exact=True), tmp_path / "f16.gguf", "F16")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="f16.gguf", dtype="auto").dtype
    assert retrofit(tmp_path / "f16.gguf", dtype="auto").dtype == expected


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
    sources_module = importlib.import_module("attnres_hf.conversion.sources")  # where a folder's weights load
    monkeypatch.setattr(sources_module, "load_source", lambda *a, **k: pytest.fail("weights were loaded"))
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


# --- the tokenizer a GGUF file declares (tokenizer.ggml.pre) ---

SPLIT_TEXTS = ["x  5", "In 2024, 12345 apples cost $3.50!", "٣٤٥ and ²³ and Ⅻ", "a\n\n  b   c\t\n", "don't  I'LL go"]


def tiny_vocab_gguf(path, pre):
    """A tiny Llama whose GGUF carries a byte-level BPE vocabulary (256 bytes + 3 merges) declaring `pre`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["ĠĠ", "12", "Ġ5"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": len(tokens), "bos_token_id": 0,
                                            "eos_token_id": 1, "pad_token_id": None})).eval()
    return write_gguf(model, path, vocab=(tokens, ["Ġ Ġ", "1 2", "Ġ 5"], pre))


# pieces derived by hand from each family's pre-tokenizer (digits one by one, in threes, or with GPT-2's runs)
HAND_SPLITS = {
    ("smollm", "x  5"): ["x", "ĠĠ", "5"],
    ("smollm", "1234 ٣٤"): ["1", "2", "3", "4", "Ġ", "Ù£", "Ù¤"],
    ("llama-bpe", "12345 apples"): ["123", "45", "Ġapples"],
    ("qwen2", "x  5"): ["x", "Ġ", "Ġ", "5"],
    ("gpt-2", "x  5"): ["x", "Ġ", "Ġ5"],
}


@pytest.mark.parametrize("pre", sorted(GGUF_PRE_TOKENIZERS))
def test_gguf_tokenizer_splits_text_as_its_declared_pre_tokenizer(pre, tmp_path):
    tokenizer = load_gguf_tokenizer(tiny_vocab_gguf(tmp_path / "v.gguf", pre))
    split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    for text in SPLIT_TEXTS + [t for (p, t) in HAND_SPLITS if p == pre]:
        expected = [byte_level(piece) for piece in llama_cpp_split(text, GGUF_PRE_TOKENIZERS[pre])]
        assert [piece for piece, _ in split(text)] == expected, text
    for (p, text), pieces in HAND_SPLITS.items():
        if p == pre:
            assert [piece for piece, _ in split(text)] == pieces, text


def test_smollm_gguf_tokenizer_ids_and_converted_folder(tmp_path):
    """The issue's example on a tiny vocabulary: "x  5" is x, two spaces, 5 (not x, space, " 5"); the converted
    folder ships that tokenizer."""
    gguf_path = tiny_vocab_gguf(tmp_path / "v.gguf", "smollm")
    tokenizer = load_gguf_tokenizer(gguf_path)
    vocab = tokenizer.get_vocab()
    assert tokenizer("x  5", add_special_tokens=False).input_ids == [vocab["x"], vocab["ĠĠ"], vocab["5"]]
    assert tokenizer("12", add_special_tokens=False).input_ids == [vocab["1"], vocab["2"]]  # no "12" merge across digits
    assert run_cli(gguf_path, tmp_path / "out") == 0
    shipped = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in SPLIT_TEXTS:
        assert shipped(text).input_ids == tokenizer(text).input_ids, text


def test_unknown_gguf_pre_tokenizer_is_refused(tmp_path, capsys, monkeypatch):
    gguf_path = tiny_vocab_gguf(tmp_path / "v.gguf", "jais-special")
    with pytest.raises(ValueError, match="declares pre-tokenizer 'jais-special', which attnres-hf does not know"):
        load_gguf_tokenizer(gguf_path)
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights were loaded"))
    assert "'jais-special'" in _bad_input_error(capsys, gguf_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


CONVERT_BAD_ARGUMENTS = {  # convert(source folder, out, **kwargs) -> (error type, what the message says)
    "output-dir-int": (dict(output_dir=5), TypeError, "output_dir must be a non-empty path"),
    "block-size-str": (dict(attnres_block_size="2"), TypeError, "attnres_block_size must be an int"),
    "block-size-odd": (dict(attnres_block_size=5), ValueError, "attnres_block_size must be 1 (Full AttnRes)"),
    "block-size-negative": (dict(attnres_block_size=-2), ValueError, "attnres_block_size must be 1 (Full AttnRes)"),
    "force-str": (dict(force="yes"), TypeError, "force must be True or False"),
    "empty-probe": (dict(probe_text="  "), ValueError, "probe_text must be a non-empty string"),
    "shard-size": (dict(max_shard_size="lots"), ValueError, "max_shard_size must be a size such as '5GB'"),
    "dtype": (dict(dtype="float99"), ValueError, "dtype must be 'auto' or a floating point torch dtype"),
    "dtype-int": (dict(dtype="int8"), ValueError, "dtype must be 'auto' or a floating point torch dtype"),
    "dtype-case": (dict(dtype="Auto"), ValueError, "dtype must be 'auto' or a floating point torch dtype"),
    "misspelled-override": (dict(attnres_rescale_outptu=False), ValueError, "did you mean 'attnres_rescale_output'"),
    "gguf-file-type": (dict(gguf_file=3), TypeError, "gguf_file must be a file name"),
    "tokenizer-type": (dict(tokenizer="gpt2"), TypeError, "tokenizer must be a transformers tokenizer"),
}


@pytest.mark.parametrize("kind", list(CONVERT_BAD_ARGUMENTS))
def test_convert_checks_its_arguments_before_loading(kind, tmp_path, monkeypatch):
    kwargs, error, says = CONVERT_BAD_ARGUMENTS[kind]
    tiny_source("llama").save_pretrained(tmp_path / "source")
    convert_module = importlib.import_module("attnres_hf.conversion.convert")
    sources_module = importlib.import_module("attnres_hf.conversion.sources")  # where a folder's weights load
    monkeypatch.setattr(sources_module, "load_source", lambda *a, **k: pytest.fail("weights were loaded"))
    kwargs = {"output_dir": tmp_path / "out", **kwargs}
    with pytest.raises(error, match=re.escape(says)):
        convert_module.convert(tmp_path / "source", **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_cli_refuses_bad_files_in_one_line(tmp_path, capsys):
    assert "does not exist" in _bad_input_error(capsys, tmp_path / "nowhere", tmp_path / "out")
    assert "GGUF file not found" in _bad_input_error(capsys, tmp_path / "nowhere.gguf", tmp_path / "out")
    tiny_source("llama").save_pretrained(tmp_path / "source")
    data = (tmp_path / "source" / "model.safetensors").read_bytes()
    (tmp_path / "source" / "model.safetensors").write_bytes(data[:-100])
    assert "truncated or corrupt safetensors" in _bad_input_error(capsys, tmp_path / "source", tmp_path / "out")
    (tmp_path / "source" / "config.json").write_text("")
    assert "config.json is not valid JSON" in _bad_input_error(capsys, tmp_path / "source", tmp_path / "out")
    (tmp_path / "file.txt").write_text("hello")
    assert "neither a model folder nor a .gguf file" in _bad_input_error(capsys, tmp_path / "file.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_byte_level_gguf_naming_no_pre_tokenizer_warns_and_splits_as_llama_cpp(tmp_path):
    from attnres_hf.conversion import gguf_pre_tokenizer

    with pytest.warns(UserWarning, match="names no tokenizer.ggml.pre"):
        missing = gguf_pre_tokenizer(None)
    pieces = [piece for piece, _ in missing.pre_tokenize_str("x 12345!")]
    assert pieces == [byte_level(p) for p in llama_cpp_split("x 12345!", GGUF_PRE_TOKENIZERS["default"])]
    assert pieces == ["x", "Ġ", "123", "45", "!"]  # llama.cpp's fallback: punctuation runs, then digits in threes


# --- PyTorch .bin sources (pytorch_model.bin, or shards with pytorch_model.bin.index.json) ---

def bin_source(folder, sharded=False, legacy=False, protocol=2):
    """A tiny Llama folder whose weights are `torch.save` files (what older Hub repos hold) written with pickle
    `protocol`; returns the model."""
    model = tiny_source("llama")
    model.config.save_pretrained(folder)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = {"_use_new_zipfile_serialization": False} if legacy else {}
    kwargs["pickle_protocol"] = protocol
    if not sharded:
        torch.save(state, folder / "pytorch_model.bin", **kwargs)
        return model
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, folder / file, **kwargs)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model


def _tensor_record_start(path):
    """Offset of the first byte of the largest tensor record of a `torch.save` zip archive."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = path.read_bytes()
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26: record.header_offset + 30])
    return record.header_offset + 30 + name_length + extra_length, record.filename


def test_a_sharded_pytorch_bin_source_converts_exactly(tmp_path):
    source = bin_source(tmp_path / "source", sharded=True)
    assert run_cli(tmp_path / "source", tmp_path / "out", "--dtype", "float32") == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(loaded), logits(source), atol=1e-5, rtol=0)


@pytest.mark.parametrize("sharded, legacy", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["single", "sharded", "legacy-pickle", "legacy-pickle-sharded"])
def test_intact_pytorch_bin_sources_pass_the_checks(sharded, legacy, tmp_path):
    bin_source(tmp_path / "source", sharded, legacy)
    assert load_source_config(tmp_path / "source").model_type == "llama"


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_pytorch_bin_sources_saved_with_pickle_protocol_3_pass_the_checks(legacy, sharded, tmp_path):
    """`torch.save(..., pickle_protocol=3)` files load with `weights_only=True` as protocol 2's do (the legacy
    format's magic number follows the protocol header, whichever protocol); protocol 4+ files torch itself refuses,
    with its reason."""
    bin_source(tmp_path / "source", sharded, legacy, protocol=3)
    assert load_source_config(tmp_path / "source").model_type == "llama"
    check_torch_file(next((tmp_path / "source").glob("*.bin")))
    refused = tmp_path / "protocol-4.bin"
    torch.save({"weight": torch.ones(2)}, refused, pickle_protocol=4, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ValueError, match=r"refuses it \(Unsupported operand 149\)"):
        check_torch_file(refused)


def _damage(folder, damage):
    """Damage the folder's .bin weights; return the file the error must name and what it must say."""
    shard = folder / "pytorch_model-00002-of-00002.bin"
    target = shard if shard.exists() else folder / "pytorch_model.bin"
    data = target.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
        return target, ("is a truncated or corrupt PyTorch checkpoint (its zip directory is missing: the file is cut "
                        "off)")
    if damage == "flipped-tensor-bytes":  # torch.load reads such a file without complaint, with a wrong weight
        start, record = _tensor_record_start(target)
        flipped = bytearray(data)
        flipped[start + 7] ^= 0x40
        target.write_bytes(bytes(flipped))
        return target, f"is a corrupt PyTorch checkpoint: its record {record} fails its CRC-32 check"
    if damage == "garbage":
        target.write_bytes(np.random.default_rng(0).bytes(len(data)))
        return target, "is not a PyTorch checkpoint: neither a torch.save zip archive nor a legacy torch pickle"
    if damage == "missing-shard":
        target.unlink()
        return folder / "pytorch_model.bin.index.json", f"lists {target.name}, which is missing from {folder}"
    if damage == "legacy-truncated":
        torch.save(torch.load(target, weights_only=True), target, _use_new_zipfile_serialization=False)
        target.write_bytes(target.read_bytes()[:-200])
        return target, "is a truncated or corrupt PyTorch checkpoint (legacy format, which has no checksums)"
    if damage == "pickled-code":  # transformers would refuse it (weights_only) only once loading started
        torch.save({"weight": subprocess.Popen}, target)
        return target, "holds more than tensors: torch.load(weights_only=True)"
    raise AssertionError(damage)


@pytest.mark.parametrize("damage, sharded", [
    (damage, sharded) for damage in ("truncated", "flipped-tensor-bytes", "garbage", "legacy-truncated", "pickled-code")
    for sharded in (False, True)] + [("missing-shard", True)])
def test_a_damaged_pytorch_bin_source_is_refused_before_loading(damage, sharded, tmp_path, capsys, monkeypatch):
    bin_source(tmp_path / "source", sharded)
    named, says = _damage(tmp_path / "source", damage)
    sources_module = importlib.import_module("attnres_hf.conversion.sources")  # where a folder's weights load
    monkeypatch.setattr(sources_module, "load_source", lambda *a, **k: pytest.fail("weights were loaded"))
    error = _bad_input_error(capsys, tmp_path / "source", tmp_path / "out")
    assert f"{named} {says}" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # no output (or staging) folder


@pytest.mark.parametrize("stream", [False, True])
def test_a_conversion_for_gpu_kernels_is_verified_on_the_cpu_in_torch(stream, tmp_path):
    """`attnres_implementation="fla"` (the output is for fla's fused kernel on a GPU): the CPU check computes the same
    arithmetic in torch and the written config names the kernel (in memory it raised "needs CUDA tensors")."""
    from attnres_hf.conversion import convert

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path / "src")
    check = convert(tmp_path / "src", tmp_path / "out", stream=stream, attnres_implementation="fla")["verification"]
    assert check["greedy_match"] and check["max_abs_logit_delta"] <= 1e-5, check
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attnres_implementation"] == "fla"
