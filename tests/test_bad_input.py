"""Bad input found by trying to break the library: each gets a clear error, nothing silent."""


import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf.analysis import record_routing
from attnres_hf.cli import main
from attnres_hf.training import packed_lm_dataset
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
