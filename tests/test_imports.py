"""What importing the package and starting the `attnres` command import: registration only, no family's modeling code
and no fla until a family is used, and the command's `--help` / `--version` without the heavy optional libraries.

Each check runs in a fresh interpreter (this test process has imported everything already) and reads `sys.modules`,
which is deterministic; how long a start takes is measured in benchmarks, not here.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from attnres_hf.modeling.backbones import BACKBONES

HEAVY = ("fla", "lm_eval", "peft", "bitsandbytes", "datasets", "matplotlib", "trl")
"""Optional libraries no start-up imports (fla: through transformers' Kimi Linear and GLM-5-Next modules)."""

PROBE = textwrap.dedent("""
    import json, sys

    def loaded():
        return {"top": sorted({name.split(".")[0] for name in sys.modules}),
                "family_modeling": sorted(name for name in sys.modules if name.startswith("transformers.models.")
                                          and name.rsplit(".", 1)[-1].startswith("modeling_")
                                          and name != "transformers.models.auto.modeling_auto"),
                "ours": sorted(name for name in sys.modules if name.startswith("attnres_hf"))}
    """)


def run(script: str) -> list[dict]:
    """Run `PROBE + script` in a fresh interpreter; returns the JSON lines it prints."""
    result = subprocess.run([sys.executable, "-c", PROBE + textwrap.dedent(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # two fresh interpreters import torch and transformers
def test_import_registers_without_any_family_code_then_a_family_loads_only_its_own():
    """`import attnres_hf` registers the Auto classes and imports no family's modeling module, no Kimi K3 module and
    no fla; building a Llama-backed model then imports transformers' Llama module and no other family's."""
    (imported, used) = run("""
        import attnres_hf
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        registered = (type(AutoConfig.for_model("attnres")) is attnres_hf.AttnResConfig
                      and MODEL_FOR_CAUSAL_LM_MAPPING[attnres_hf.AttnResConfig] is attnres_hf.AttnResForCausalLM)
        print(json.dumps({**loaded(), "registered": registered}))
        config = attnres_hf.AttnResConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        AutoModelForCausalLM.from_config(config)
        print(json.dumps(loaded()))
    """)
    assert imported["registered"]
    assert imported["family_modeling"] == []
    assert not set(HEAVY) & set(imported["top"])
    assert "attnres_hf.modeling.backbones_k3" not in imported["ours"]
    assert "attnres_hf.conversion" not in imported["ours"]
    assert used["family_modeling"] == ["transformers.models.llama.modeling_llama"]
    assert "fla" not in used["top"]


@pytest.mark.slow  # a fresh interpreter imports torch and transformers
def test_command_help_and_version_import_no_optional_library_nor_family_code():
    """`attnres --help`, `--version` and the `--help` of every sub-command whose options are its own (`train` and
    `lm-eval` print the help of TrainingArguments and lm-eval) import no fla, lm-eval, PEFT, bitsandbytes, datasets or
    matplotlib, no family's modeling code and not the conversion package."""
    helps = [["--help"], ["--version"], *([name, "--help"] for name in
                                          ("convert", "export", "eval", "routing", "info", "serve", "demo"))]
    lines = run(f"""
        import contextlib, io
        from attnres_hf.cli import main
        for argv in {helps!r}:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    code = main(argv)
                except SystemExit as exit:
                    code = exit.code
            print(json.dumps({{**loaded(), "argv": argv, "code": code, "printed": bool(out.getvalue())}}))
    """)
    assert [line["argv"] for line in lines] == helps
    for line in lines:
        assert line["code"] == 0 and line["printed"], line["argv"]
        assert not set(HEAVY) & set(line["top"]), (line["argv"], set(HEAVY) & set(line["top"]))
        assert line["family_modeling"] == [], line["argv"]
        assert "attnres_hf.conversion" not in line["ours"], line["argv"]


def test_the_table_lists_every_family_without_resolving_it():
    """Iterating `BACKBONES` and reading a record as declared import nothing of the family; reading the adapter gives
    the family's own classes (references resolved)."""
    resolved = set(BACKBONES.resolved())
    assert len(list(BACKBONES)) == len(BACKBONES) and "llama" in BACKBONES and "kimi_k3" in BACKBONES
    assert set(BACKBONES.resolved()) == resolved  # iterating and `in` resolve nothing
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM

    declared, adapter = BACKBONES.declared("llama"), BACKBONES["llama"]
    assert declared.config_class is LlamaConfig
    assert adapter.causal_lm is LlamaForCausalLM and adapter.decoder_layer is LlamaDecoderLayer
    assert BACKBONES["llama"] is adapter and "llama" in BACKBONES.resolved()


CONFIG_CODE = {"configuration_attnres", "depth_mixing", "mixing_base", "lazy_records", "backbones", "backbones_base",
               "backbones_moe", "configuration_kimi_k3"}
"""The checkpoint files a configuration imports: the config, the method and family records and their bases; no
method's module (`mixing_*`, `attnres_*`: the reads, their kernels and fla's) and no `modeling_attnres`."""


@pytest.mark.slow  # a fresh interpreter imports torch and transformers
def test_a_configuration_imports_no_modeling_code(tmp_path):
    """`AutoConfig.from_pretrained(folder, trust_remote_code=True)` without the package (what a hub user's config
    read runs), for AttnRes, Delta AttnRes and mHC, imports only the configuration's own files (`CONFIG_CODE`) of the
    checkpoint, no family's modeling code, no fla; validation of every method's fields still runs (a field of another
    method is refused by the remote-code class). Also over a Kimi K3 backbone, whose modules subclass Kimi Linear's:
    its config class alone (`configuration_kimi_k3.py`), not `backbones_k3.py` nor transformers' Kimi Linear module."""
    from attnres_hf import AttnResConfig

    methods = ["attnres", "delta_attnres", "mhc"]
    for method in methods:
        AttnResConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, depth_mixing=method).save_pretrained(tmp_path / method)
    k3 = dict(model_type="kimi_k3", vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, pad_token_id=0, layer_types=["linear_attention", "full_attention"],
              hidden_act="situ")
    AttnResConfig(backbone=k3).save_pretrained(tmp_path / "kimi_k3")
    folders = [*methods, "kimi_k3"]
    lines = run(f"""
        sys.modules["attnres_hf"] = None  # only the checkpoints' own files
        from transformers import AutoConfig
        for folder in {folders!r}:
            config = AutoConfig.from_pretrained({str(tmp_path)!r} + "/" + folder, trust_remote_code=True)
            try:
                type(config)(depth_mixing=config.depth_mixing, denseformer_period=2)
                refused = None
            except ValueError as error:
                refused = str(error)
            files = [getattr(module, "__file__", None) or "" for name, module in list(sys.modules.items())
                     if name.startswith("transformers_modules.")]
            checkpoint = sorted({{file.rsplit("/", 1)[-1][:-3] for file in files if file.endswith(".py")}} - {{"__init__"}})
            print(json.dumps({{**loaded(), "checkpoint": checkpoint, "method": config.depth_mixing, "refused": refused,
                              "backbone": config.backbone.model_type}}))
    """)
    assert [(line["method"], line["backbone"]) for line in lines] == [*((m, "llama") for m in methods),
                                                                      ("attnres", "kimi_k3")]
    for line in lines:
        assert set(line["checkpoint"]) <= CONFIG_CODE and "configuration_attnres" in line["checkpoint"], line
        assert line["family_modeling"] == [] and "fla" not in line["top"]
        assert line["refused"] is not None and "only apply to depth_mixing='denseformer'" in line["refused"]
