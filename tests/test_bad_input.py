"""Bad input found by trying to break the library: each gets a clear error, nothing silent."""


import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf.analysis import record_routing
from attnres_hf.cli import main
from attnres_hf.training import METHODS, packed_lm_dataset
from utils import TINY, tiny_model, word_tokenizer


def test_record_routing_takes_one_non_empty_sequence():
    model = tiny_model()
    with pytest.raises(ValueError, match="takes one sequence"):
        record_routing(model, torch.randint(3, 99, (2, 5)))
    with pytest.raises(ValueError, match="input is empty"):
        record_routing(model, torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ('{"text": "w3 w4"\n', "is not valid JSON lines"),
    ('{"text": null}\n', "is not a string"),
    ('{"text": 5}\n', "is not a string"),
    ('{"body": "w3"}\n', "has no 'text' column"),
], ids=["empty", "malformed", "null", "number", "no-text-field"])
def test_bad_jsonl_training_data(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        packed_lm_dataset([tmp_path / "d.jsonl"], word_tokenizer())


def test_bad_sequence_length(tmp_path):
    (tmp_path / "d.txt").write_text("w3 w4 w5")
    with pytest.raises(ValueError, match="seq_len must be at least 2"):
        packed_lm_dataset([tmp_path / "d.txt"], word_tokenizer(), seq_len=0)


def test_convert_refuses_truncated_weights_the_current_folder_and_the_source(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path / "src")
    weights = tmp_path / "src" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err and not (tmp_path / "out").exists()
    weights.write_bytes(data)
    monkeypatch.chdir(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), ".", "--force"]) == 2
    assert main(["convert", str(tmp_path / "src"), str(tmp_path), "--force"]) == 2
    assert capsys.readouterr().err.count("contains the current folder or the source") == 2
    assert weights.read_bytes() == data


def test_info_refuses_non_attnres_folders(tmp_path, capsys):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 2
    assert "is not an AttnRes checkpoint (model_type 'llama')" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_routing_cli_rejects_empty_text(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")
    assert main(["routing", str(tmp_path / "m"), "--text", ""]) == 2
    assert "input is empty" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, error, message", [
    ({"method": "lroa"}, ValueError, "method must be one of " + ", ".join(METHODS)),
    ({"seq_len": "64"}, TypeError, "seq_len must be an integer"),
    ({"seq_len": 1}, ValueError, "seq_len must be at least 2 tokens"),
    ({"eval_fraction": 1.0}, ValueError, "eval_fraction must be between 0 and 1"),
    ({"data": 5}, TypeError, "data must be a path or a list of paths"),
    ({"data": []}, ValueError, "data needs at least one path"),
    ({"model": None}, TypeError, "model must be a model folder path"),
    ({"lora_r": 0}, ValueError, r"lora_r \(the adapter rank\) must be at least 1"),
    ({"lora_r": 2.5}, TypeError, r"lora_r \(the adapter rank\) must be an integer"),
    ({"lora_dropout": 1.0}, ValueError, r"lora_dropout must be a probability in \[0, 1\)"),
    ({"lora_alpha": -1}, ValueError, "lora_alpha must be a positive number"),
    ({"lora_target_modules": 5}, TypeError, "lora_target_modules must be a list of module names"),
    ({"lora_target_modules": []}, ValueError, "lora_target_modules must name at least one module"),
    ({"lora_target_modules": ["q_proj", ""]}, ValueError, "no name may be empty"),
    ({"lora_target_modules": "  "}, ValueError, "no name may be empty"),
    ({"entropy_batches": -1}, ValueError, "entropy_batches must be at least 0"),
    ({"resume": "yes"}, TypeError, "resume must be bool"),
], ids=lambda value: str(value) if not isinstance(value, dict) else "-".join(f"{k}={v!r}" for k, v in value.items()))
def test_training_arguments_are_checked_at_construction(overrides, error, message):
    from attnres_hf.training import AttnResArguments

    with pytest.raises(error, match=message):
        AttnResArguments(**{"model": "m", "data": ["d.txt"], **overrides})


def test_training_arguments_take_one_path_or_paths():
    from pathlib import Path

    from attnres_hf.training import AttnResArguments

    assert AttnResArguments(model=Path("m"), data="d.txt").data == ["d.txt"]
    assert AttnResArguments(model="m", data=(Path("a.txt"), "b.jsonl")).data == ["a.txt", "b.jsonl"]


def test_train_checks_its_arguments_before_loading_a_model(tiny_model_dir, tmp_path, monkeypatch):
    import transformers
    from transformers import TrainingArguments

    from attnres_hf.training import AttnResArguments, train

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    LlamaConfig(**TINY).save_pretrained(tmp_path / "llama")
    word_tokenizer().save_pretrained(tmp_path / "llama")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
    data = [str(tiny_model_dir / "train.txt")]
    cases = [
        (("model", args), TypeError, "args must be AttnResArguments"),
        ((AttnResArguments(model=str(tiny_model_dir / "model"), data=data), {"output_dir": "x"}), TypeError,
         "training_args must be transformers.TrainingArguments"),
        ((AttnResArguments(model=str(tmp_path / "nope"), data=data), args), FileNotFoundError, "model folder"),
        ((AttnResArguments(model=str(tiny_model_dir / "model"), data=[str(tmp_path / "no.txt")]), args),
         FileNotFoundError, "data file not found"),
        ((AttnResArguments(model=str(tmp_path / "llama"), data=data), args), ValueError,
         r"method 'routers' needs depth routers: .* \(model_type 'llama'"),
        ((AttnResArguments(model=str(tiny_model_dir / "model"), data=data, method="lora",
                           lora_target_modules=["q_projection"]), args), ValueError, "not found in this model"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            train(*call)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--method", "routers", "--seq-len", "1"], "seq_len must be at least 2"),
    (["--lora_r", "0"], "lora_r (the adapter rank) must be at least 1"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1 (attnres train --help"),
    (["--data", "nope.txt"], "data file not found: nope.txt"),
], ids=["seq-len", "lora-r", "unknown-flag", "missing-data"])
def test_train_cli_refuses_bad_arguments_in_one_line(flags, message, tiny_model_dir, capsys):
    argv = ["train", str(tiny_model_dir / "model"), "--data", str(tiny_model_dir / "train.txt"), "--output-dir",
            str(tiny_model_dir / "out"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres train: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tiny_model_dir / "out").exists()


def test_merge_lora_checks_its_folders_before_loading(tiny_model_dir, tmp_path):
    from attnres_hf.training import merge_lora

    with pytest.raises(TypeError, match="base_model must be a model folder or a PreTrainedModel"):
        merge_lora(5, tmp_path)
    with pytest.raises(TypeError, match="adapter_dir must be a folder path"):
        merge_lora(tiny_model_dir / "model", None)
    with pytest.raises(FileNotFoundError, match="holds no LoRA adapter"):
        merge_lora(tiny_model_dir / "model", tmp_path / "nothing")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="is not a model folder"):
        merge_lora(tmp_path / "no-model", tmp_path / "adapter")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"files": 5}, TypeError, "files must be a path or a list of paths"),
    ({"files": []}, ValueError, "files needs at least one path"),
    ({"seq_len": "64"}, TypeError, "seq_len must be an integer"),
    ({"eval_fraction": 0}, ValueError, "eval_fraction must be between 0 and 1"),
    ({"text_field": 1}, TypeError, "text_field must be a column name"),
    ({"tokenizer": None}, TypeError, "tokenizer must be a transformers tokenizer"),
], ids=["files-number", "files-empty", "seq-len-text", "eval-fraction-0", "text-field-number", "no-tokenizer"])
def test_packed_dataset_arguments(kwargs, error, message, tmp_path):
    (tmp_path / "d.txt").write_text("w3 w4 w5")
    with pytest.raises(error, match=message):
        packed_lm_dataset(**{"files": tmp_path / "d.txt", "tokenizer": word_tokenizer()} | kwargs)


def test_read_texts_and_load_pairs_arguments(tmp_path):
    from attnres_hf.analysis import load_pairs
    from attnres_hf.training.data import read_texts

    (tmp_path / "d.txt").write_text("w3 w4")
    assert read_texts(tmp_path / "d.txt") == ["w3 w4"]  # one path is a list of one
    with pytest.raises(TypeError, match="files must be a path or a list of paths"):
        read_texts(None)
    with pytest.raises(TypeError, match="path must be a .jsonl file path"):
        load_pairs(5)
    with pytest.raises(FileNotFoundError, match="no such pairs file"):
        load_pairs(tmp_path / "missing.jsonl")


def test_analysis_helpers_name_their_argument_types():
    from attnres_hf.analysis import DepthDynamicsCallback, aligned_suffix, block_layout, layer_magnitudes
    from attnres_hf.modeling import AttnResConfig

    with pytest.raises(TypeError, match="config must be an AttnResConfig"):
        block_layout(LlamaConfig(**TINY))
    assert block_layout(AttnResConfig(**TINY, attnres_block_size=4))[-1] == ["2.attn", "2.mlp"]
    with pytest.raises(TypeError, match="two lists of token ids"):
        aligned_suffix(torch.tensor([1, 2]), [1, 2])
    for bad, error in ((torch.rand(2, 3), TypeError), ([[1, 2]], TypeError), (torch.tensor([1, 2]), ValueError)):
        with pytest.raises(error, match="input_ids must be"):
            layer_magnitudes(tiny_model(), bad)
        with pytest.raises(error, match="input_ids must be"):
            DepthDynamicsCallback(bad)
    with pytest.raises(ValueError, match="every must be at least 1 steps"):
        DepthDynamicsCallback(torch.tensor([[1, 2]]), every=0)
