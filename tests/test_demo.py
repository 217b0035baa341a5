"""`attnres demo`'s steps and summary, run end to end on a tiny Llama checkpoint standing in for SmolLM2."""

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf import demo
from attnres_hf.cli import main
from utils import TINY, counting_text, word_tokenizer


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    """A tiny Llama folder with a chat template as the demo's source, and counting text as its texts."""
    torch.manual_seed(0)
    folder = tmp_path / "source"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
    tokenizer.save_pretrained(folder)
    monkeypatch.setattr(demo, "smollm2_hf_folder", lambda: folder)
    monkeypatch.setattr(demo, "demo_texts", lambda: demo.DemoTexts(
        held_out=counting_text(40, seed=1), train=counting_text(200), description="counting text"))
    monkeypatch.setattr(demo, "CHAT_PROMPT", "w5 w6 w7")
    return folder


def test_demo_runs_its_steps_in_order_and_writes_the_summary(tiny_source, tmp_path, capsys):
    out = tmp_path / "demo"
    results = demo.run_demo(out, ppl_tokens=200, window=32, chat_tokens=4, train_steps=2, train_seq_len=32,
                            eval_questions=0)
    printed = capsys.readouterr().out
    progress = [line for line in printed.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{n}/8" for n in range(1, 9)]
    assert "2 steps x 4 x 32 tokens" in progress[4] and progress[-1].startswith("[8/8] Chat")
    assert progress[5].startswith("[6/8] Control: the RMSNorm weights alone")
    assert results["verification"]["max_abs_logit_delta"] < 1e-4 and results["verification"]["greedy_match"]
    assert set(results["perplexity"]) == {"source", "converted", "router_trained", "norms_control", "window", "text"}
    # the control trains the 2 x 3 + 1 RMSNorm weights of hidden size 32, never a router
    assert results["norms_control"]["steps"] == 2 and results["norms_control"]["trainable_parameters"] == 7 * 32
    assert results["perplexity"]["norms_control"]["perplexity"] != results["perplexity"]["converted"]["perplexity"]
    assert results["perplexity"]["converted"]["perplexity"] == pytest.approx(
        results["perplexity"]["source"]["perplexity"], rel=1e-4)
    assert results["router_training"]["steps"] == 2 and results["evaluation"] is None
    assert set(results["chat"]["answers"]) == {"converted", "router_trained"}
    assert json.loads((out / "demo.json").read_text()) == json.loads(json.dumps(results))
    summary = (out / "summary.md").read_text()
    for label in ("max |delta logits| vs source", "held-out perplexity, source", "router-trained",
                  "control: RMSNorm weights only", "wall time"):
        assert label in summary and label in printed
    assert f"tokens of {results['perplexity']['text']})" in summary  # the README: the summary names the text source
    assert (out / "routing_average.png").is_file() and not (out / "train_text.txt").exists()
    assert (out / "routing_explorer.html").is_file() and "routing_tokens.png, routing_explorer.html" in printed
    assert 'id="explorer-data"' in (out / "routing_explorer.html").read_text()


def test_demo_without_training_skips_its_steps_and_replaces_only_an_earlier_demo(tiny_source, tmp_path, capsys,
                                                                                monkeypatch):
    out = tmp_path / "demo"
    for _ in range(2):  # the second run replaces the first
        results = demo.run_demo(out, ppl_tokens=100, window=32, chat_tokens=2, train_steps=0, eval_questions=0)
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert progress[-1].startswith("[5/5] Chat") and results["router_training"] is None
    assert "router-trained" not in (out / "summary.md").read_text() and results["norms_control"] is None
    def interrupted(state):
        """Interrupted ..."""
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "plain_mean_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(out, train_steps=0, eval_questions=0)
    assert json.loads((out / "demo.json").read_text()) == {"complete": False}
    monkeypatch.undo()
    monkeypatch.setattr(demo, "smollm2_hf_folder", lambda: tiny_source)
    monkeypatch.setattr(demo, "demo_texts", lambda: demo.DemoTexts(counting_text(40, seed=1), counting_text(200), "c"))
    monkeypatch.setattr(demo, "CHAT_PROMPT", "w5 w6 w7")
    demo.run_demo(out, ppl_tokens=100, window=32, chat_tokens=2, train_steps=0, eval_questions=0)  # replaces it
    assert "complete" not in json.loads((out / "demo.json").read_text())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="is not an earlier demo output"):
        demo.run_demo(tmp_path / "mine")
    assert main(["demo", "--output-dir", str(tmp_path / "mine")]) == 2
    assert "attnres demo: error:" in capsys.readouterr().err and (tmp_path / "mine" / "notes.txt").is_file()


def test_summary_renderer_reports_a_failed_check_loudly():
    results = {
        "model_dir": "m", "attnres_block_size": 8, "num_attnres_blocks": 8, "num_sublayers": 60,
        "verification": {"max_abs_logit_delta": 0.5, "num_probe_tokens": 86, "greedy_new_tokens": 16,
                         "greedy_match": False},
        "plain_mean_verification": {"max_abs_logit_delta": 4e-2, "argmax_agreement": 0.99},
        "perplexity": {"source": {"perplexity": 10.0, "tokens": 100}, "converted": {"perplexity": 10.5},
                       "text": "LAMBADA"},
        "router_training": None, "wall_time_s": 3.0,
        "evaluation": {"rows": [{"benchmark": "mmlu", "title": "MMLU", "metric": "acc,none", "baseline": 0.3,
                                 "model": 0.25}],
                       "comparison": {"mmlu": {"identical": False, "same_score": 90, "samples": 100,
                                               "max_abs_loglikelihood_delta": 0.1}}},
        "chat": {"answers": {"converted": "line one\nline two"}},
    }
    text, markdown = demo.render_summary(results, "src", eval_table="| table |\n")
    assert re.search(r"16-token greedy continuation +DIFFERENT", text)
    assert "8 blocks of 8 sub-layers over 60, the last partial" in markdown
    assert "30.0 -> 25.0; per-sample scores DIFFERENT on 90/100" in text
    assert "WARNING: the per-sample scores differ" in text and "## lm-eval at conversion time" in markdown
    assert "> line one\n> line two" in markdown


def test_the_summary_prints_paths_without_the_home_folder(tmp_path, monkeypatch):
    """The summary is shared and pasted: a path under the working folder is printed relative to it, one under the
    home folder (the cache's default) as `~/...`, any other as it is."""
    home, work = tmp_path / "home", tmp_path / "work"
    (work / "outputs").mkdir(parents=True)
    (home / ".cache").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert demo.shown_path(home / ".cache" / "attnres-hf" / "smollm2" / "hf-v2") == "~/.cache/attnres-hf/smollm2/hf-v2"
    assert demo.shown_path(work / "outputs" / "demo") == "outputs/demo"
    assert demo.shown_path("outputs/demo") == "outputs/demo"
    assert demo.shown_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    results = {
        "model_dir": str(work / "outputs" / "demo" / "m"), "attnres_block_size": 8, "num_attnres_blocks": 8,
        "num_sublayers": 60,
        "verification": {"max_abs_logit_delta": 1e-4, "num_probe_tokens": 86, "greedy_new_tokens": 32,
                         "greedy_match": True},
        "plain_mean_verification": {"max_abs_logit_delta": 4e-2, "argmax_agreement": 1.0},
        "perplexity": {"source": {"perplexity": 10.0, "tokens": 100}, "converted": {"perplexity": 10.0},
                       "text": "LAMBADA"},
        "router_training": None, "evaluation": None, "wall_time_s": 3.0, "chat": {"answers": {}},
    }
    text, markdown = demo.render_summary(results, home / ".cache" / "attnres-hf" / "smollm2" / "hf-v2")
    assert str(home) not in text and str(work) not in markdown
    assert "~/.cache/attnres-hf/smollm2/hf-v2" in text and "outputs/demo/m (Block AttnRes" in text


@pytest.mark.parametrize("kwargs, error, message", [
    ({"attnres_block_size": 3}, ValueError, "attnres_block_size must be 1"),
    ({"ppl_tokens": "4096"}, TypeError, "ppl_tokens must be an integer"),
    ({"window": 1}, ValueError, "window must be at least 2"),
    ({"eval_questions": -1}, ValueError, "eval_questions must be at least 0"),
    ({"output_dir": 5}, TypeError, "output_dir must be a folder path"),
], ids=["block-size-3", "ppl-tokens-text", "window-1", "eval-questions-negative", "output-dir-number"])
def test_demo_settings_are_checked_before_anything_loads(kwargs, error, message, tmp_path, monkeypatch):
    def refuse():
        raise AssertionError("the source was fetched")

    monkeypatch.setattr(demo, "smollm2_hf_folder", refuse)
    with pytest.raises(error, match=message):
        demo.run_demo(**{"output_dir": tmp_path / "demo"} | kwargs)
    assert not (tmp_path / "demo").exists()
