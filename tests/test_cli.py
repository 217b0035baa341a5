"""The `attnres` command tree: sub-commands, default sub-commands, usage errors and the one error handler."""

import contextlib
import subprocess
import sys

import pytest

from attnres_hf.cli import build_parser, info, main
from utils import tiny_config


def test_every_command_family_is_registered_and_documented(capsys):
    commands = build_parser().commands.choices
    assert {"convert", "train", "eval", "lm-eval", "routing", "info", "demo"} <= set(commands)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(f"    {name} " in out for name in commands)


@pytest.mark.parametrize("argv, prog", [
    (["routing", "--help"], "attnres routing"),
    (["routing", "compare", "--help"], "attnres routing compare"),
    (["eval", "--help"], "attnres eval"),
    (["eval", "perplexity", "--help"], "attnres eval perplexity"),
    (["convert", "--help"], "attnres convert"),
], ids=["routing", "routing-compare", "eval", "eval-perplexity", "convert"])
def test_help_of_nested_commands(argv, prog, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_train_help_lists_the_trainer_options(capsys):
    for argv in (["train"], ["train", "--help"], ["train", "model", "-h"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "--per_device_train_batch_size" in out and "--lora_target_modules" in out


@pytest.mark.parametrize("argv, message", [
    (["convert", "a", "b", "--bogus"], "attnres convert: error: unrecognized arguments: --bogus"),
    (["routing", "m", "--text", "x", "--bogus", "1"], "attnres routing map: error: unrecognized arguments: --bogus 1"),
    (["eval", "tasks", "extra"], "attnres eval tasks: error: unrecognized arguments: extra"),
    (["routing"], "attnres routing: error: the following arguments are required: COMMAND"),
    (["routing", "m"], "attnres routing map: error: one of the arguments --text --data is required"),
    (["nope"], "attnres: error: argument COMMAND: invalid choice: 'nope'"),
], ids=["convert-extra", "routing-extra", "eval-tasks-extra", "routing-bare", "routing-no-text", "unknown"])
def test_usage_errors_name_the_command_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_default_sub_commands_take_the_family_arguments(tmp_path, capsys):
    for argv in (["routing", str(tmp_path / "none"), "--text", "w3"],
                 ["routing", "map", str(tmp_path / "none"), "--text", "w3"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("attnres routing map: error: ")


@pytest.mark.parametrize("error", [FileNotFoundError("no such file x"), ValueError("bad value, use y"),
                                   KeyError("no key z"), PermissionError("not allowed; pass --w")],
                         ids=["missing", "value", "key", "permission"])
def test_expected_errors_are_one_line_and_exit_2(error, tmp_path, capsys, monkeypatch):
    def fail(args):
        raise error

    monkeypatch.setattr(info, "run_info", fail)
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"attnres info: error: {error.args[0]}\n"


def test_a_closed_pipe_ends_quietly(tmp_path, monkeypatch):
    def closed(args):
        raise BrokenPipeError

    monkeypatch.setattr(info, "run_info", closed)
    assert main(["info", str(tmp_path)]) == 0


@pytest.mark.slow
def test_python_dash_m_runs_the_command(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-m", "attnres_hf.cli", "info", str(tmp_path)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0 and "depth_mixing        attnres" in result.stdout
    assert "backbone            llama (LlamaConfig)" in result.stdout
    # the command imports PEFT, hence bitsandbytes, whose optional Hub kernel is not there: no warning about it (it
    # was printed on AVX-512 BF16 CPUs only)
    assert "kernels-community" not in result.stderr, result.stderr
    result = subprocess.run(f"{sys.executable} -m attnres_hf.cli info {tmp_path} | head -1", shell=True,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.stdout == "model_type          attnres\n" and "Traceback" not in result.stderr


@pytest.mark.parametrize("content", ["not json", "[1, 2]"])
def test_info_names_a_file_that_is_not_a_json_config(tmp_path, capsys, content):
    """`attnres info FILE` on a file that is not a JSON object says so, not a bare JSON decoder message."""
    path = tmp_path / "notes.txt"
    path.write_text(content)
    assert main(["info", str(path)]) == 2
    assert "is not a JSON config" in capsys.readouterr().err


@pytest.mark.parametrize("argv,abbreviation", [
    (["train", "MODEL", "--data", "x.txt", "--output-dir", "out", "--learning", "1e-3"], "--learning"),
    (["train", "MODEL", "--data", "x.txt", "--output-dir", "out", "--max_st", "5"], "--max_st"),
    (["convert", "SRC", "OUT", "--forc"], "--forc"),
    (["convert", "SRC", "OUT", "--block", "4"], "--block"),
    (["eval", "MODEL", "--task", "arc"], "--task"),
])
def test_a_prefix_of_an_option_is_refused_not_taken_for_it(argv, abbreviation, tmp_path, monkeypatch, capsys):
    """argparse's prefix matching would read `--learning 1e-3` as `--learning_rate` while the train command's own
    defaults (it fills the method's learning rate when none is given) did not see it: every parser refuses
    abbreviations, before anything loads."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) if argv[0] != "train" else contextlib.nullcontext():
        assert main(argv) == 2
    assert abbreviation in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "OUT").exists()
