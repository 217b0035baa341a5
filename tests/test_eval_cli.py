"""`attnres lm-eval` and `attnres eval perplexity`: opt-ins, folders and settings checked before a model loads."""

import pytest

from attnres_hf.cli import main
from utils import tiny_model, word_tokenizer


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model or lm-eval's command line starts."""
    import lm_eval.__main__
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", refuse)
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)


@pytest.mark.parametrize("tasks, flags, env, missing", [
    ("offline_humaneval", [], None, "pass --confirm_run_unsafe_code (and set HF_ALLOW_CODE_EVAL=1)"),
    ("offline_humaneval", ["--confirm_run_unsafe_code"], None, "set HF_ALLOW_CODE_EVAL=1 in the environment"),
    ("offline_mmlu,offline_mbpp", [], "1", "pass --confirm_run_unsafe_code (and set HF_ALLOW_CODE_EVAL=1)"),
    ("humaneval", ["--confirm_run_unsafe_code"], "0", "set HF_ALLOW_CODE_EVAL=1 in the environment"),
], ids=["no-opt-in", "flag-only", "variable-only", "variable-0"])
def test_lm_eval_refuses_code_tasks_without_both_opt_ins_before_loading(tasks, flags, env, missing, tmp_path,
                                                                       no_loading, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv("HF_ALLOW_CODE_EVAL", env)
    tiny_model().save_pretrained(tmp_path / "m")
    capsys.readouterr()
    assert main(["lm-eval", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'm'}", "--tasks", tasks,
                 *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres lm-eval: error: refusing to run ") and missing in err
    assert ("MBPP" if "mbpp" in tasks else "HumanEval") in err and len(err.splitlines()) == 1


def test_lm_eval_refuses_a_missing_model_folder(tmp_path, no_loading, capsys):
    assert main(["lm-eval", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'none'},dtype=float32",
                 "--tasks=offline_mmlu"]) == 2
    assert f"model folder (--model_args pretrained=) not found: {tmp_path / 'none'}" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--window", "1"], "--window must be at least 2 tokens"),
    (["--window", "8", "--stride", "8"], "--stride must be below --window (8)"),
    (["--data", "MISSING"], "does not exist"),
], ids=["window-1", "stride-window", "missing-data"])
def test_perplexity_cli_checks_before_loading(flags, message, tmp_path, no_loading, capsys):
    tiny_model().save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text("w5 w6 w7")
    capsys.readouterr()
    flags = [f.replace("MISSING", str(tmp_path / "missing.txt")) for f in flags]
    assert main(["eval", "perplexity", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres eval perplexity: error: ") and message in err
    assert main(["eval", "perplexity", str(tmp_path / "none"), "--data", str(tmp_path / "t.txt")]) == 2
    assert "is not a model folder" in capsys.readouterr().err
    for flag in ("--window", "--stride", "--max-tokens"):
        with pytest.raises(SystemExit):
            main(["eval", "perplexity", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), flag, "0"])
        assert "must be at least 1, got 0" in capsys.readouterr().err
