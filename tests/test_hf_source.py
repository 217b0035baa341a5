"""An HF folder's tensors must cover the model its config builds, before any model loads; config keys its family's
config class does not use are reported (`attnres_hf.conversion.hf_source`)."""

import importlib
import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf.cli import main
from attnres_hf.conversion import convert, load_source_config, retrofit
from utils import TINY


def llama_folder(folder, tie=False, **save):
    """A tiny Llama (3 layers) saved as transformers saves it; returns the source model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()
    model.save_pretrained(folder, **save)
    return model


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def _edit_tensors(folder, edit):
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _sharded(folder, edit_index):
    """Re-save the folder's weights as three shards with an index, then let `edit_index` change the index."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    files = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    for file, keys in files.items():
        save_file({k: state[k] for k in keys}, folder / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in files.items() for k in keys}
    edit_index(weight_map)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _bin_without_layer_2(folder):
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if ".layers.2." not in k}
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")


DAMAGE = {
    # kind: (damage, the phrases the error must contain)
    "config-says-more-layers": (lambda f: _edit_config(f, num_hidden_layers=5), [
        "no tensor for every weight of layer(s) 3, 4 (config.json: num_hidden_layers 5; the files hold 3 layers, "
        "0-2)"]),
    "config-says-fewer-layers": (lambda f: _edit_config(f, num_hidden_layers=2), [
        "tensors with no weight in the model: model.layers.2."]),
    "missing-tensor": (lambda f: _edit_tensors(f, lambda s: s.pop("model.layers.1.post_attention_layernorm.weight")), [
        "no tensor for model.layers.1.post_attention_layernorm.weight"]),
    "missing-head": (lambda f: _edit_tensors(f, lambda s: s.pop("lm_head.weight")), ["no tensor for lm_head.weight"]),
    "extra-tensor": (lambda f: _edit_tensors(f, lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.ones(3)})),
                     ["tensors with no weight in the model: model.layers.0.mlp.extra.weight"]),
    "wrong-shape-tensor": (lambda f: _edit_tensors(f, lambda s: s.update(
        {"model.layers.2.mlp.up_proj.weight": torch.ones(48, 32)})),
        ["shapes differ: model.layers.2.mlp.up_proj.weight (48, 32) in the files, (64, 32) in the model"]),
    "config-other-width": (lambda f: _edit_config(f, intermediate_size=48), [
        "shapes differ: model.layers.0.mlp.down_proj.weight (32, 64) in the files, (32, 48) in the model", "+3 more"]),
    "bin-without-a-layer": (_bin_without_layer_2, ["no tensor for every weight of layer(s) 2 (config.json: "
                                                   "num_hidden_layers 3; the files hold 2 layers, 0-1)"]),
}


STALE_INDEX = {
    # kind: (edit of the index's weight map, the phrase the warning must contain)
    "lists-a-tensor-no-shard-holds": (lambda m: m.update(
        {"model.layers.3.mlp.up_proj.weight": "model-00001-of-00003.safetensors"}),
        "listed by the index but in no shard: model.layers.3.mlp.up_proj.weight (model-00001-of-00003.safetensors)"),
    "omits-a-tensor": (lambda m: m.pop("model.norm.weight"), "in a shard but not in the index: model.norm.weight"),
    "names-the-wrong-shard": (lambda m: m.update({"model.embed_tokens.weight": "model-00003-of-00003.safetensors"}),
                              "in another shard than the index says: model.embed_tokens.weight (index: "
                              "model-00003-of-00003.safetensors, held by model-0000"),
}


@pytest.mark.parametrize("kind", list(STALE_INDEX))
def test_a_stale_index_is_warned_about_and_converts_as_transformers_loads_it(kind, tmp_path):
    """transformers reads a sharded checkpoint's index for its list of shards only and loads every tensor of each,
    so an index that misplaces, omits or invents a tensor loads exactly: warned about, not refused."""
    edit, phrase = STALE_INDEX[kind]
    folder = tmp_path / "source"
    source = llama_folder(folder)
    _sharded(folder, edit)
    with pytest.warns(UserWarning, match="disagree with model.safetensors.index.json") as caught:
        model = retrofit(folder, depth_mixing="residual")
    assert any(phrase in str(warning.message) for warning in caught)
    ids = torch.randint(3, 99, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # every weight loaded: the residual retrofit's logits are the source's (to float noise)
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture
def no_weight_loads(monkeypatch):
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights were loaded"))


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_folder_whose_tensors_do_not_cover_its_model_is_refused_naming_them(kind, tmp_path, no_weight_loads):
    damage, phrases = DAMAGE[kind]
    folder = tmp_path / "source"
    llama_folder(folder)
    damage(folder)
    with pytest.raises(ValueError) as caught:
        retrofit(folder)
    for phrase in phrases:
        assert phrase in str(caught.value), str(caught.value)
    assert str(caught.value).startswith(str(folder)) and "\n" not in str(caught.value)


def test_the_cli_refuses_it_in_one_line_and_writes_nothing(tmp_path, capsys):
    llama_folder(tmp_path / "source")
    _edit_config(tmp_path / "source", num_hidden_layers=5)
    capsys.readouterr()  # the save's progress bars
    assert main(["convert", str(tmp_path / "source"), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("attnres convert: error: ") and "every weight of layer(s) 3, 4" in error
    assert "\n" not in error and not (tmp_path / "out").exists()


@pytest.mark.parametrize("save", [{}, {"max_shard_size": "20KB"}], ids=["one-file", "sharded"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_intact_folders_pass_and_convert(tie, save, tmp_path):
    llama_folder(tmp_path / "source", tie=tie, **save)
    assert (tmp_path / "source" / "model.safetensors.index.json").is_file() == bool(save)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config key is reported for a folder transformers wrote itself
        report = convert(tmp_path / "source", tmp_path / "out")
    assert report["source"]["unused_config_keys"] == [] and report["verification"]["greedy_match"]


def test_one_weight_of_a_tied_pair_is_enough_and_neither_is_refused(tmp_path, no_weight_loads):
    llama_folder(tmp_path / "source", tie=True)
    state = load_file(tmp_path / "source" / "model.safetensors")
    assert "lm_head.weight" not in state  # transformers saves the embedding only
    _edit_tensors(tmp_path / "source", lambda s: s.update({"lm_head.weight": s.pop("model.embed_tokens.weight")}))
    load_source_config(tmp_path / "source")  # transformers ties the embedding to the head it finds
    _edit_tensors(tmp_path / "source", lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"no tensor for lm_head\.weight, model\.embed_tokens\.weight$"):
        load_source_config(tmp_path / "source")


def _every_family():
    from test_backbones import FAMILIES as DENSE
    from test_backbones import source_model as dense_model
    from test_backbones_moe import FAMILIES as MOE
    from test_backbones_moe import source_model as moe_model

    return {**{family: dense_model for family in DENSE}, **{family: moe_model for family in MOE}}


@pytest.mark.parametrize("family", sorted(_every_family()))
def test_every_family_folder_passes_and_a_missing_layer_is_refused(family, tmp_path, no_weight_loads):
    """transformers' own folders of each family (MoE experts saved one tensor each and fused into `gate_up_proj` on
    loading, by transformers' weight conversions) pass; without their last layer's tensors they are refused."""
    model = _every_family()[family](family)
    model.save_pretrained(tmp_path / "source")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_source_config(tmp_path / "source").model_type == family
    last = model.config.num_hidden_layers - 1
    _edit_tensors(tmp_path / "source", lambda s: [s.pop(k) for k in list(s) if f".layers.{last}." in k])
    with pytest.raises(ValueError, match=re.escape(f"no tensor for every weight of layer(s) {last} (config.json")):
        load_source_config(tmp_path / "source")


def test_moe_experts_must_all_be_there(tmp_path, no_weight_loads):
    """An expert tensor missing from a fused weight, and a whole expert missing, are refused naming the weight."""
    from test_backbones_moe import source_model

    source_model("qwen3_moe").save_pretrained(tmp_path / "source")
    state = load_file(tmp_path / "source" / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in state  # stored one expert at a time
    _edit_tensors(tmp_path / "source", lambda s: s.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"cannot be combined: model\.layers\.1\.mlp\.experts\.gate_up_proj \("):
        load_source_config(tmp_path / "source")
    _edit_tensors(tmp_path / "source", lambda s: [s.pop(k) for k in list(s) if ".layers.1.mlp.experts.3." in k])
    with pytest.raises(ValueError, match=r"shapes differ: model\.layers\.1\.mlp\.experts\.down_proj \(3, 32, 16\) in "
                                         r"the files, \(4, 32, 16\) in the model"):
        load_source_config(tmp_path / "source")


UNUSED = {
    # kind: (config.json changes, keys reported)
    "misspelt-field": ({"num_hiden_layers": 30}, ["num_hiden_layers (num_hidden_layers?)"]),
    "other-tools-keys": ({"is_llama_config": True, "transformers.js_config": {"kv_cache_dtype": "float16"}},
                         ["is_llama_config", "transformers.js_config"]),
    "legacy-key-overridden": ({"rope_theta": 5000.0}, ["rope_theta"]),  # beside rope_parameters, which wins
    "dtype-twice": ({"torch_dtype": "bfloat16"}, ["torch_dtype"]),  # `dtype` is in the file too and wins
}


@pytest.mark.parametrize("kind", list(UNUSED))
def test_config_keys_the_family_does_not_use_are_reported(kind, tmp_path):
    changes, reported = UNUSED[kind]
    llama_folder(tmp_path / "source")
    _edit_config(tmp_path / "source", **changes)
    with pytest.warns(UserWarning, match="has keys that LlamaConfig and its model do not use") as caught:
        report = convert(tmp_path / "source", tmp_path / "out")
    assert report["source"]["unused_config_keys"] == reported
    assert all(key in str(caught[0].message) for key in reported)
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text())["source"]["unused_config_keys"] == \
        reported


def test_legacy_keys_transformers_reads_are_not_reported(tmp_path):
    """A folder of an older transformers (`rope_theta` without `rope_parameters`, `torch_dtype` without `dtype`) is
    read by transformers; those keys change the config, so they are used."""
    llama_folder(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"] * 2
    config["torch_dtype"] = config.pop("dtype")
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning)
        loaded = load_source_config(tmp_path / "source")
    assert loaded.rope_parameters["rope_theta"] == config["rope_theta"]
