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


def _lm_eval_config(tmp_path, **fields):
    import json

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(fields))  # YAML is a superset of JSON
    return str(path)


# lm-eval's own ways of naming tasks: -t, space- or comma-separated, =, the `run` subcommand, a --config YAML file
CODE_TASK_FORMS = {
    "short-flag": ["-t", "offline_humaneval"],
    "space-separated": ["--tasks", "offline_mmlu", "offline_humaneval"],
    "equals": ["--tasks=offline_mbpp"],
    "run-subcommand": ["run", "--tasks", "offline_mmlu,offline_mbpp"],
    "config-list": ["--config", "CONFIG", {"tasks": ["offline_mmlu", "offline_humaneval"]}],
    "config-string": ["--config", "CONFIG", {"tasks": "offline_mmlu,offline_mbpp"}],
}


@pytest.mark.parametrize("form", list(CODE_TASK_FORMS))
def test_lm_eval_finds_code_tasks_in_every_form_lm_eval_takes(form, tmp_path, no_loading, capsys):
    tiny_model().save_pretrained(tmp_path / "m")
    argv = [a for a in CODE_TASK_FORMS[form] if not isinstance(a, dict)]
    fields = next((a for a in CODE_TASK_FORMS[form] if isinstance(a, dict)), {})
    argv = [_lm_eval_config(tmp_path, **fields) if a == "CONFIG" else a for a in argv]
    capsys.readouterr()
    assert main(["lm-eval", *argv, "--model", "hf", "--model_args", f"pretrained={tmp_path / 'm'}"]) == 2
    assert "refusing to run " in capsys.readouterr().err


MODEL_ARGS_FORMS = {  # lm-eval's forms of --model_args, each naming pretrained=PATH
    "commas": ["--model_args", "dtype=float32,pretrained=PATH"],
    "short-flag": ["-a", "pretrained=PATH"],
    "separate-words": ["--model_args", "dtype=float32", "pretrained=PATH"],
    "json": ["--model_args", '{"pretrained": "PATH", "dtype": "float32"}'],
    "repeated": ["--model_args", "dtype=float32", "--model_args", "pretrained=PATH"],
    "config-dict": ["--config", "CONFIG", {"model_args": {"pretrained": "PATH", "dtype": "float32"}}],
    "config-string": ["--config", "CONFIG", {"model_args": "pretrained=PATH,dtype=float32"}],
}


def _model_args_argv(form, tmp_path, path):
    items = MODEL_ARGS_FORMS[form]
    fields = next((a for a in items if isinstance(a, dict)), {})
    fields = {k: ({n: str(path) if v == "PATH" else v for n, v in v.items()} if isinstance(v, dict) else
                  v.replace("PATH", str(path))) for k, v in fields.items()}
    return [_lm_eval_config(tmp_path, **fields) if a == "CONFIG" else a.replace("PATH", str(path))
            for a in items if not isinstance(a, dict)]


@pytest.mark.parametrize("form", list(MODEL_ARGS_FORMS))
def test_lm_eval_model_folder_is_checked_in_every_form_lm_eval_takes(form, tmp_path, no_loading, capsys):
    argv = _model_args_argv(form, tmp_path, tmp_path / "none")
    assert main(["lm-eval", "--model", "hf", *argv, "--tasks", "offline_mmlu"]) == 2
    assert f"model folder (--model_args pretrained=) not found: {tmp_path / 'none'}" in capsys.readouterr().err


@pytest.mark.parametrize("form", list(MODEL_ARGS_FORMS))
def test_lm_eval_gets_the_causal_backend_and_keeps_every_model_argument(form, tmp_path, monkeypatch):
    """lm-eval's HFLM does not know the `attnres` model type: the backend is added to the model arguments as lm-eval
    reads them, whatever their form (a ",backend=causal" glued onto JSON broke it)."""
    import sys

    import lm_eval.__main__

    from attnres_hf.eval.checks import lm_eval_run_settings

    tiny_model().save_pretrained(tmp_path / "m")
    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv[1:])))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert main(["lm-eval", "--model", "hf", *_model_args_argv(form, tmp_path, tmp_path / "m"),
                 "--tasks", "offline_mmlu"]) == 0
    settings = lm_eval_run_settings(seen[0])
    assert settings["model_args"] == {"pretrained": str(tmp_path / "m"), "backend": "causal",
                                      **({"dtype": "float32"} if "dtype" in str(MODEL_ARGS_FORMS[form]) else {})}
    assert settings["tasks"] == ["offline_mmlu"] and "--include_path" in seen[0]
