"""`attnres routing` (map, compare, dynamics) and the routing tools' inputs: chat template, one BOS, checks made
before any model loads."""

import json
import re

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from attnres_hf.analysis import compare_pairs, encode_text, run_dynamics
from attnres_hf.cli import main
from utils import TINY, tiny_model, word_tokenizer

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}w90 {{ m['content'] }} w91 {% endfor %}"
                 "{% if add_generation_prompt %}w92{% endif %}")


def bos_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """The tests' word tokenizer, adding a BOS as Llama's does, with a chat template that writes its own BOS."""
    from tokenizers import processors

    tokenizer = word_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                               special_tokens=[("<s>", 1)])
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.mark.parametrize("text, expected", [
    ("w5 w6", [1, 5, 6]),
    ("<s> w5 w6", [1, 5, 6]),  # a prompt that brings its BOS gets no second one
    ("<s> w90 w5 w91 w92", [1, 90, 5, 91, 92]),  # a prompt rendered with the chat template
], ids=["plain", "own-bos", "rendered-chat"])
def test_encode_text_gives_one_bos(text, expected):
    assert encode_text(bos_tokenizer(), text).tolist() == expected


def test_encode_text_applies_the_chat_template_once():
    tokenizer = bos_tokenizer()
    assert encode_text(tokenizer, "w5 w6", chat=True).tolist() == [1, 90, 5, 6, 91, 92]
    assert encode_text(tokenizer, "w5 w6", chat=True, max_tokens=3).tolist() == [1, 90, 5]
    assert encode_text(word_tokenizer(), "w5 w6").tolist() == [5, 6]  # a tokenizer without BOS stays without


@pytest.mark.parametrize("kwargs, error, message", [
    ({"text": ""}, ValueError, "the input is empty"),
    ({"text": 5}, TypeError, "text must be a string"),
    ({"text": "w5", "max_tokens": 0}, ValueError, "max_tokens must be a positive integer"),
    ({"text": "w5", "chat": True, "tokenizer": word_tokenizer()}, ValueError, "has no chat template; drop --chat"),
], ids=["empty", "not-text", "max-tokens", "no-template"])
def test_encode_text_refuses_bad_input(kwargs, error, message):
    kwargs = {"tokenizer": bos_tokenizer()} | kwargs
    with pytest.raises(error, match=message):
        encode_text(**kwargs)


@pytest.fixture
def routing_model(tmp_path):
    model = tiny_model(attnres_block_size=2)
    model.save_pretrained(tmp_path / "m")
    bos_tokenizer().save_pretrained(tmp_path / "m")
    return model, tmp_path / "m"


def test_routing_map_with_chat_reads_the_templated_prompt_with_one_bos(routing_model, tmp_path):
    model, folder = routing_model
    assert main(["routing", str(folder), "--text", "w5 w6 w7", "--chat", "--output-dir", str(tmp_path / "chat")]) == 0
    saved = np.load(tmp_path / "chat" / "routing.npz")
    assert saved["tokens"].tolist() == ["<s>", "w90", "w5", "w6", "w7", "w91", "w92"]
    with torch.no_grad():
        expected = model(torch.tensor([[1, 90, 5, 6, 7, 91, 92]]), output_depth_weights=True).depth_weights[1][0]
    assert np.array_equal(saved["weights"][1][:, :2], expected.double().numpy())
    rendered = "<s> w90 w5 w6 w7 w91 w92"  # the same prompt rendered beforehand: the same tokens, not two BOS
    assert main(["routing", str(folder), "--text", rendered, "--output-dir", str(tmp_path / "rendered")]) == 0
    assert np.load(tmp_path / "rendered" / "routing.npz")["tokens"].tolist() == saved["tokens"].tolist()


def test_routing_compare_with_chat(routing_model, tmp_path, capsys):
    _, folder = routing_model
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"a": "w5 w10 w11 w12", "b": "w50 w10 w11 w12"}) + "\n")
    assert main(["routing", "compare", str(folder), "--pairs", str(pairs), "--chat", "--bootstrap", "10",
                 "--output-dir", str(tmp_path / "c")]) == 0
    assert "aligned tokens after the difference: [5]" in capsys.readouterr().out  # w10 w11 w12 w91 w92


@pytest.mark.parametrize("argv, message", [
    (["--text", "w5", "--span", "3"], "--span takes START:END"),
    (["--text", "w5", "--span", "a:b"], "--span takes START:END"),
    (["--text", "w5 w6", "--span", "2:9"], "need 0 <= START < END <= 3 (the input has 3 tokens)"),
    (["--text", "w5 w6", "--token", "3"], "--token 3: the input has 3 tokens"),
    (["--text", ""], "the input is empty"),
    (["--data", "MISSING"], "--data: no file"),
    (["--text", "w5", "--chat", "--tokenizer-less"], None),
    (["--text", "w5", "--html", "EXISTING"], "already exists; pass --force (force=True) to replace it"),
    (["--text", "w5", "--html", "FOLDER"], "is a folder; give the page's file path"),
], ids=["span-one-number", "span-words", "span-out-of-range", "token-out-of-range", "empty", "missing-data",
        "unknown-flag", "html-exists", "html-folder"])
def test_routing_map_checks_its_input_before_loading_the_model(argv, message, routing_model, tmp_path, capsys,
                                                               monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    _, folder = routing_model
    (tmp_path / "existing.html").write_text("mine")
    places = {"MISSING": tmp_path / "missing.txt", "EXISTING": tmp_path / "existing.html", "FOLDER": tmp_path}
    argv = [str(places.get(a, a)) for a in argv]
    if message is None:
        with pytest.raises(SystemExit):
            main(["routing", str(folder), *argv])
        assert "unrecognized arguments: --tokenizer-less" in capsys.readouterr().err
        return
    assert main(["routing", str(folder), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres routing map: error: ") and message in err and len(err.splitlines()) == 1


def explorer_data(path) -> dict:
    """The data a routing explorer page holds (its JSON script element)."""
    (data,) = re.findall(r'<script type="application/json" id="explorer-data">(.*?)</script>', path.read_text(),
                         re.DOTALL)
    return json.loads(data)


@pytest.mark.slow
def test_routing_map_and_compare_write_the_explorer_page(routing_model, tmp_path, capsys):
    _, folder = routing_model
    page = tmp_path / "pages" / "map.html"
    argv = ["routing", str(folder), "--text", "w5 w6 w7", "--output-dir", str(tmp_path / "o"), "--html", str(page)]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"summary.json and {page}")
    saved, data = np.load(tmp_path / "o" / "routing.npz"), explorer_data(page)
    assert [i["tokens"] for i in data["inputs"]] == [saved["tokens"].tolist()] == [["<s>", "w5", "w6", "w7"]]
    assert data["rows"] == saved["routers"].tolist() and data["title"] == "m: depth routing"
    page.write_text("mine")
    assert main(argv) == 2 and "already exists; pass --force" in capsys.readouterr().err
    assert page.read_text() == "mine"
    assert main([*argv, "--force"]) == 0 and explorer_data(page)["inputs"][0]["tokens"][-1] == "w7"

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"a": "w5 w10 w11", "b": "w50 w10 w11"}) + "\n"
                     + json.dumps({"a": "w6 w12", "b": "w7 w12", "name": "second"}) + "\n")
    assert main(["routing", "compare", str(folder), "--pairs", str(pairs), "--bootstrap", "10", "--output-dir",
                 str(tmp_path / "c"), "--html", str(tmp_path / "pair.html"), "--html-pair", "1"]) == 0
    assert "the explorer of pair 1 to" in capsys.readouterr().out
    data = explorer_data(tmp_path / "pair.html")
    assert [(i["label"], i["tokens"]) for i in data["inputs"]] == [("a", ["<s>", "w6", "w12"]),
                                                                   ("b", ["<s>", "w7", "w12"])]
    assert data["title"] == "m: depth routing, pair 1 (second), b against a"


@pytest.mark.parametrize("argv, message", [
    (["--html", "PAGE", "--html-pair", "1"], "--html-pair 1: --pairs has 1 pairs (indices 0 to 0)"),
    (["--html", "PAGE", "--html-pair", "-1"], "--html-pair -1: --pairs has 1 pairs"),
    (["--html-pair", "0"], "--html-pair chooses the pair of the --html page; give --html PATH too"),
    (["--html", "EXISTING"], "already exists; pass --force"),
], ids=["pair-out-of-range", "pair-negative", "pair-without-html", "html-exists"])
def test_routing_compare_checks_its_page_before_loading_the_model(argv, message, routing_model, tmp_path, capsys,
                                                                  monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    _, folder = routing_model
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"a": "w5 w6", "b": "w7 w6"}) + "\n")
    (tmp_path / "existing.html").write_text("mine")
    places = {"PAGE": tmp_path / "page.html", "EXISTING": tmp_path / "existing.html"}
    argv = [str(places.get(a, a)) for a in argv]
    assert main(["routing", "compare", str(folder), "--pairs", str(tmp_path / "pairs.jsonl"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres routing compare: error: ") and message in err
    assert not (tmp_path / "page.html").exists() and (tmp_path / "existing.html").read_text() == "mine"


def test_routing_refuses_folders_without_routers_before_loading(tmp_path, capsys):
    LlamaConfig(**TINY).save_pretrained(tmp_path / "llama")
    tiny_model(depth_mixing="residual").save_pretrained(tmp_path / "residual")
    for folder, what in (("llama", "model_type 'llama', depth_mixing None"),
                         ("residual", "model_type 'attnres', depth_mixing 'residual'")):
        for command in (["routing"], ["routing", "compare"]):
            argv = [*command, str(tmp_path / folder), "--text" if len(command) == 1 else "--pairs", "example"]
            assert main(argv) == 2
            assert f"has no depth routers ({what}" in capsys.readouterr().err
    assert main(["routing", str(tmp_path / "none"), "--text", "w5"]) == 2
    assert "is not a model folder (no config.json there)" in capsys.readouterr().err
    for flag in ("--bootstrap", "--max-tokens"):
        with pytest.raises(SystemExit):
            main(["routing", "compare" if flag == "--bootstrap" else "map", str(tmp_path / "llama"), flag, "0"])
        assert "must be at least 1, got 0" in capsys.readouterr().err


def test_routing_names_a_missing_tokenizer(tmp_path, capsys):
    """A model folder without a tokenizer (e.g. converted from a source that had none) is refused naming that, not
    with transformers' message about sentencepiece and tiktoken."""
    tiny_model().save_pretrained(tmp_path / "model")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"a": "w5 w6", "b": "w5 w7"}) + "\n")
    for argv in (["routing", str(tmp_path / "model"), "--text", "w5 w6"],
                 ["routing", "compare", str(tmp_path / "model"), "--pairs", str(tmp_path / "pairs.jsonl")]):
        assert main(argv) == 2
        assert "has no tokenizer (none of tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, error, message", [
    ({"pairs": "pairs.jsonl"}, TypeError, "pairs must be a list of"),
    ({"pairs": [{"a": "w5"}]}, TypeError, "pairs must be a list of"),
    ({"pairs": []}, ValueError, "pairs is empty"),
    ({"bootstrap": 0}, ValueError, "bootstrap must be at least 1"),
    ({"bootstrap": 2.5}, TypeError, "bootstrap must be an integer"),
    ({"model": tiny_model(depth_mixing="residual")}, ValueError, "need a model with depth routers"),
], ids=["path-not-pairs", "missing-b", "no-pairs", "bootstrap-0", "bootstrap-float", "no-routers"])
def test_compare_pairs_refuses_bad_arguments(kwargs, error, message):
    call = {"model": tiny_model(), "tokenizer": bos_tokenizer(), "pairs": [{"a": "w5 w6", "b": "w7 w6"}]} | kwargs
    with pytest.raises(error, match=message):
        compare_pairs(**call)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"data": 5}, TypeError, "data must be a path or a list of paths"),
    ({"data": []}, ValueError, "data needs at least one path"),
    ({"tokenizer": None}, TypeError, "tokenizer must be a transformers tokenizer"),
    ({"steps": 0}, ValueError, "steps must be at least 1"),
    ({"hidden_size": "32"}, TypeError, "hidden_size must be an integer"),
    ({"learning_rate": 0}, ValueError, "learning_rate must be a positive number"),
    ({"output_dir": None}, TypeError, "output_dir must be a folder path"),
], ids=["data-number", "data-empty", "no-tokenizer", "steps-0", "hidden-size-text", "lr-0", "no-output-dir"])
def test_run_dynamics_refuses_bad_arguments(kwargs, error, message, tmp_path):
    call = {"data": [tmp_path / "t.txt"], "tokenizer": word_tokenizer(), "output_dir": tmp_path / "o"} | kwargs
    with pytest.raises(error, match=message):
        run_dynamics(**call)
    assert not (tmp_path / "o").exists()


def test_dynamics_cli_checks_its_data_first(tmp_path, capsys):
    assert main(["routing", "dynamics", "--data", str(tmp_path / "missing.txt"), "--tokenizer", str(tmp_path)]) == 2
    assert "--data: no file or folder" in capsys.readouterr().err
