"""The README's example is run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1
    code = blocks[0]
    assert len(code.strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    assert (tmp_path / "tiny-attnres" / "model.safetensors").exists()


def test_readme_names_the_two_setup_commands():
    text = README.read_text()
    assert "make test" in text and "make demo" in text


def test_cli_info_describes_the_block_layout(tmp_path, capsys):
    from attnres_hf.cli import main
    from utils import tiny_config

    tiny_config(attnres_block_size=4).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Block AttnRes, 2 blocks, the last of 2" in out
    assert "block   1: 0.attn 0.mlp 1.attn 1.mlp" in out and "block   2: 2.attn 2.mlp" in out
    assert main(["info", str(tmp_path / "missing")]) == 2
