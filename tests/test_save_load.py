"""Checkpoints: native and remote-code loading, Auto classes, dtype, missing routers."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import attnres_hf.modeling
from attnres_hf import AttnResForCausalLM, AttnResModel
from utils import OTHER_PROCESS_ATOL, tiny_model


@pytest.fixture
def saved(tmp_path, input_ids):
    model = tiny_model(attnres_block_size=2, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        logits = model(input_ids).logits
    return tmp_path, model, logits


def test_save_writes_safetensors_modeling_files_and_auto_map(saved):
    folder, _, _ = saved
    files = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "configuration_attnres.py", "modeling_attnres.py"} <= files
    # every module of `attnres_hf.modeling` travels (the relative imports of the two above, followed recursively)
    siblings = {p.name for p in Path(attnres_hf.modeling.__file__).parent.glob("*.py")} - {"__init__.py"}
    assert {"mixing_attnres.py", "attnres_reference.py", "attnres_buffer.py", "attnres_two_phase.py"} <= siblings
    assert siblings <= files, siblings - files
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_attnres.AttnResConfig",
        "AutoModel": "modeling_attnres.AttnResModel",
        "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
    }


def test_native_reload_gives_identical_logits_and_queries(saved, input_ids):
    folder, model, logits = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is AttnResForCausalLM
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, logits, atol=0, rtol=0)
    for name, param in model.named_parameters():
        if name.endswith(".query") and ".0.attn_res" not in name:
            assert param.abs().sum() > 0
            assert torch.equal(loaded.get_parameter(name), param)
    assert type(AutoModel.from_pretrained(folder)) is AttnResModel


REMOTE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.modules["attnres_hf"] = None  # the package must not be importable: only the checkpoint's files are used
    from transformers import AutoModel, AutoModelForCausalLM
    folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert "attnres_hf" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    AutoModel.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        logits = model(ids).logits
    queries = {n: p.tolist() for n, p in model.named_parameters() if n.endswith(".query")}
    print(json.dumps({"logits": logits.tolist(), "queries": queries}))
""")


@pytest.mark.slow
def test_remote_code_reload_in_a_fresh_process_without_the_package(saved, input_ids, tmp_path_factory):
    folder, model, logits = saved
    env_home = tmp_path_factory.mktemp("hf_home")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(folder), json.dumps(input_ids.tolist())],
        capture_output=True, text=True, check=False, cwd=tmp_path_factory.mktemp("cwd"),
        env={"HF_HOME": str(env_home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    torch.testing.assert_close(torch.tensor(remote["logits"]), logits, atol=OTHER_PROCESS_ATOL, rtol=0)
    for name, values in remote["queries"].items():
        assert torch.equal(torch.tensor(values), model.get_parameter(name).detach())


COEXIST_SCRIPT = textwrap.dedent("""
    import importlib, json, sys, torch
    from transformers import AutoModelForCausalLM
    folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(remote).__module__.startswith("transformers_modules")
    import attnres_hf  # registering after remote code was loaded must not raise ...
    importlib.reload(attnres_hf)  # ... nor registering twice
    native = AutoModelForCausalLM.from_pretrained(folder).eval()
    again = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(native).__module__ == "attnres_hf.modeling.modeling_attnres", type(native)
    with torch.no_grad():
        print(json.dumps([m(ids).logits.tolist() for m in (remote, native, again)]))
""")


@pytest.mark.slow
def test_remote_code_and_package_coexist_in_one_process(saved, input_ids, tmp_path_factory):
    folder, _, logits = saved
    result = subprocess.run(
        [sys.executable, "-c", COEXIST_SCRIPT, str(folder), json.dumps(input_ids.tolist())],
        capture_output=True, text=True, check=False, cwd=tmp_path_factory.mktemp("cwd"),
        # the package under test (a checkout's `src` on PYTHONPATH), not another installed copy
        env={"HF_HOME": str(tmp_path_factory.mktemp("hf_home")), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
             **{key: os.environ[key] for key in ("PYTHONPATH",) if key in os.environ}},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for remote_logits in json.loads(result.stdout.strip().splitlines()[-1]):
        torch.testing.assert_close(torch.tensor(remote_logits), logits, atol=OTHER_PROCESS_ATOL, rtol=0)


def test_queries_missing_from_a_checkpoint_load_as_zero(saved):
    folder, _, _ = saved
    weights = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.endswith(".query")}
    assert len(kept) < len(weights)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = AttnResForCausalLM.from_pretrained(folder)
    queries = [p for n, p in loaded.named_parameters() if n.endswith(".query")]
    assert len(queries) == 7 and all(torch.count_nonzero(q) == 0 for q in queries)


def test_new_model_has_zero_queries_and_unit_key_norms():
    model = tiny_model(routers=False)
    for name, param in model.named_parameters():
        if name.endswith(".query"):
            assert torch.count_nonzero(param) == 0
        if "_res.key_norm" in name:
            assert torch.equal(param, torch.ones_like(param))


def test_explicit_dtype_wins_over_the_config_dtype(saved):
    folder, _, _ = saved
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    assert AttnResForCausalLM.from_pretrained(folder, dtype=torch.float16).dtype == torch.float16
    assert AttnResForCausalLM.from_pretrained(folder, dtype="auto").dtype == torch.bfloat16
    assert AutoConfig.from_pretrained(folder).dtype == torch.bfloat16


def test_device_map_auto_loads_and_runs(saved, input_ids):
    folder, _, logits = saved
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, logits, atol=0, rtol=0)
