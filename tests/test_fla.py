"""flash-linear-attention interop: fla `TransformerForCausalLM` checkpoints (fla 0.6.0, in the `fla` extra) convert
into AttnRes models that compute fla's logits, and go back to fla bit for bit (`attnres convert`, `attnres export
--to fla`), with every fla option that has no exact counterpart refused by name before anything loads.

fla's model runs here on CPU tensors with its CUDA-only kernels replaced for the duration of a check by fla's own
reference functions and torch (`attnres_hf.conversion.fla_cpu.fla_reference_kernels`: `fused_attnres` ->
`naive_attnres`,
the Triton rotary -> `rotary_embedding_ref`, the Triton RMSNorm -> `rms_norm_ref`, Triton SwiGLU -> torch, flash-attn
-> torch SDPA with flash-attn's mask). Everything else is fla's code as installed.

Tolerances (measured, fp32, logits of size ~0.5; docs/results/fla_interop.md): fla's model and the converted one
differ by at most ~3e-6 of the logits' scale on these tiny models (different kernels for the same function), so 1e-4
of the scale (`EXACT_TOLERANCE`) leaves more than an order of margin and still catches a wrong tensor or option
(zeroed routers move the logits by more than 1e-2 of their scale: `test_the_trained_routers_matter`).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fla")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from attnres_hf import AttnResForCausalLM  # noqa: E402
from attnres_hf.cli import main  # noqa: E402
from attnres_hf.conversion import EXPORT_FORMATS, FLA_KEY_MAP, convert, export  # noqa: E402
from attnres_hf.conversion.fla_cpu import fla_reference_kernels  # noqa: E402
from attnres_hf.conversion.fla_source import EXACT_TOLERANCE  # noqa: E402
from utils import randomize_routers, tiny_model  # noqa: E402

IDS = torch.randint(3, 99, (2, 17), generator=torch.Generator().manual_seed(1))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fla_interop import fla_model  # noqa: E402  (a tiny fla model with trained-like routers; the benchmark's own)


def save_fla(tmp_path, name="fla", **kwargs):
    folder = tmp_path / name
    fla_model(**kwargs).save_pretrained(folder)
    return folder


def fla_logits(folder, ids=IDS, dtype=torch.float32):
    with fla_reference_kernels():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        with torch.no_grad():
            return model(ids).logits.float()


def our_logits(folder, ids=IDS, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# (decoder layers, attnres_block_size): Full (1), blocks that divide the 2L sub-layers, partial last blocks
# (3 layers = 6 sub-layers in blocks of 4; 5 layers = 10 in blocks of 4 and of 6), one block over everything
PAIRS = [(3, 1), (2, 1), (3, 2), (4, 4), (3, 4), pytest.param(5, 4, marks=pytest.mark.slow),
         pytest.param(5, 6, marks=pytest.mark.slow), (2, 8)]


@pytest.mark.parametrize("layers, block_size", PAIRS)
def test_fla_attnres_checkpoint_converts_with_its_trained_routers(tmp_path, layers, block_size, capsys):
    folder = save_fla(tmp_path, layers=layers, block_size=block_size, seed=layers + block_size)
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    check = report["verification"]
    assert check["exact"] and check["relative_max_abs_logit_delta"] <= EXACT_TOLERANCE
    assert check["greedy_match"] and check["compared_with"]["kernels_replaced"]
    assert report["source"]["format"] == "fla" and report["source"]["imported_routers"]
    assert report["config"]["attnres_block_size"] == block_size
    assert report["config"]["attnres_rescale_output"] is False
    assert relative(our_logits(tmp_path / "out"), fla_logits(folder)) <= EXACT_TOLERANCE
    out = capsys.readouterr().out
    assert "max |delta logits| vs fla TransformerForCausalLM" in out and "exact: True" in out


def test_the_trained_routers_matter(tmp_path):
    """The check can fail: the same checkpoint with its routers zeroed is far from fla's model."""
    folder = save_fla(tmp_path, layers=3, block_size=2)
    convert(folder, tmp_path / "out")
    model = AttnResForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".query") and not name.startswith("model.layers.0.attn_res"):
                param.zero_()
        assert relative(model(IDS).logits, fla_logits(folder)) > 100 * EXACT_TOLERANCE


@pytest.mark.parametrize("block_size", [2, None])
def test_bf16_is_as_close_to_fp32_as_fla_own_bf16(tmp_path, block_size):
    """fla bf16 against fla fp32 sets the yardstick; the converted bf16 model must be no farther from fla fp32.
    Measured over 4 seeds on 4 x 32 tokens, mean |delta| over mean |logits|: fla's own 0.008-0.013, ours 0.75-1.18
    times fla's (max |delta| ratios range 0.5-1.65: one rounding outlier decides them, so the mean is compared);
    both mix depth in fp32 and differ by bf16 rounding only."""
    folder = save_fla(tmp_path, layers=4, block_size=block_size)
    convert(folder, tmp_path / "out")  # a plain one retrofits (rescaled by default, as the source's sum)
    ids = torch.randint(3, 99, (4, 32), generator=torch.Generator().manual_seed(1))
    reference = fla_logits(folder, ids)

    def error(logits):
        return ((logits - reference).abs().mean() / reference.abs().mean()).item()

    fla_bf16 = error(fla_logits(folder, ids, dtype=torch.bfloat16))
    ours_bf16 = error(our_logits(tmp_path / "out", ids, dtype=torch.bfloat16))
    assert ours_bf16 <= 1.5 * fla_bf16, (ours_bf16, fla_bf16)


@pytest.mark.parametrize("fields, backbone", [
    ({}, "llama"),
    ({"qkv_bias": True}, "qwen2"),
    ({"qk_norm": True, "norm_eps": 1e-5}, "qwen3"),
    ({"window_size": 5}, "mistral"),
])
def test_fla_options_with_a_transformers_family(tmp_path, fields, backbone):
    folder = save_fla(tmp_path, layers=3, block_size=2, **fields)
    report = convert(folder, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["backbone"]["model_type"] == backbone
    assert report["verification"]["exact"]
    ids = torch.randint(3, 99, (1, 12), generator=torch.Generator().manual_seed(2))  # past the window of 5
    assert relative(our_logits(tmp_path / "out", ids), fla_logits(folder, ids)) <= EXACT_TOLERANCE


def test_a_plain_fla_transformer_is_retrofitted(tmp_path):
    """Without `attnres_block_size` an fla transformer is a residual model: converted like any source (zero routers,
    any block size), the same logits."""
    folder = save_fla(tmp_path, layers=4, block_size=None)
    report = convert(folder, tmp_path / "out", attnres_block_size=4)
    assert report["verification"]["exact"] and not report["source"]["imported_routers"]
    assert report["config"]["attnres_block_size"] == 4
    assert relative(our_logits(tmp_path / "out"), fla_logits(folder)) <= EXACT_TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_round_trip_fla_attnres_fla_is_bit_for_bit(tmp_path, dtype):
    model = fla_model(layers=3, block_size=4, seed=5).to(getattr(torch, dtype))
    model.save_pretrained(tmp_path / "fla")
    convert(tmp_path / "fla", tmp_path / "ours", dtype="auto")
    assert main(["export", "--to", "fla", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    before = load_file(tmp_path / "fla" / "model.safetensors")
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert "model.layers.0.attn_res_proj.weight" in after  # the inert layer-0 pair survives
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    original = json.loads((tmp_path / "fla" / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "transformers_version"} == \
        {k: v for k, v in original.items() if k != "transformers_version"}


@pytest.mark.parametrize("overrides", [
    dict(attnres_block_size=2), dict(attnres_block_size=1), dict(depth_mixing="residual"),
])
def test_native_attnres_models_export_to_fla(tmp_path, overrides):
    model = tiny_model(attnres_rescale_output=False, **overrides)
    randomize_routers(model, seed=3)
    model.save_pretrained(tmp_path / "ours")
    report = export(tmp_path / "ours", tmp_path / "fla")
    assert report["verification"]["exact"]
    with fla_reference_kernels():
        fla = AutoModelForCausalLM.from_pretrained(tmp_path / "fla").eval()
        assert type(fla).__name__ == "TransformerForCausalLM"
        with torch.no_grad():
            assert relative(model(IDS).logits, fla(IDS).logits) <= EXACT_TOLERANCE


def test_layer0_pair_is_inert_and_kept(tmp_path, capsys):
    folder = save_fla(tmp_path, layers=3, block_size=2)
    convert(folder, tmp_path / "out")
    model = AttnResForCausalLM.from_pretrained(tmp_path / "out").eval()
    stored = load_file(folder / "model.safetensors")["model.layers.0.attn_res_proj.weight"]
    assert torch.equal(model.model.layers[0].attn_res.query, stored.reshape(-1))
    before = model(IDS).logits
    with torch.no_grad():
        model.model.layers[0].attn_res.query.mul_(-7)
        model.model.layers[0].attn_res.key_norm.weight.add_(3)
    assert torch.equal(model(IDS).logits, before)
    assert main(["info", str(tmp_path / "out")]) == 0
    assert "inert               layer 0's attn_res" in capsys.readouterr().out


def test_loading_a_converted_fla_folder_warns_of_no_missing_keys(tmp_path, caplog):
    convert(save_fla(tmp_path, layers=2, block_size=1), tmp_path / "out")
    from transformers.utils import logging

    logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    finally:
        logging.disable_propagation()
    assert not [r for r in caplog.records if "missing" in r.getMessage().lower() or "newly" in r.getMessage()]


def test_key_map_covers_every_fla_tensor_once():
    """Every tensor of fla's transformer (with each option that adds tensors) has exactly one attnres-hf name."""
    from attnres_hf.conversion.fla_layout import to_attnres_name, to_fla_name

    names = set()
    for fields in ({}, {"qkv_bias": True}, {"qk_norm": True, "norm_eps": 1e-5}):
        names |= set(fla_model(layers=2, block_size=2, **fields).state_dict())
    ours = {to_attnres_name(name) for name in names}
    assert None not in ours and len(ours) == len(names)
    assert all(to_fla_name(to_attnres_name(name)) == name for name in names)
    assert len({fla for fla, _ in FLA_KEY_MAP}) == len(FLA_KEY_MAP) and "fla" in EXPORT_FORMATS


# ---------------------------------------------------------------------------------------------------------------
# Refusals: one line each from the CLI (exit 2), before any model loads, nothing written
# ---------------------------------------------------------------------------------------------------------------

def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fla_folder(tmp_path_factory):
    return save_fla(tmp_path_factory.mktemp("fla"), layers=3, block_size=2)


def _refused(tmp_path, capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnres ") and match in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("changes, match", [
    ({"hidden_act": "powlu"}, "hidden_act 'powlu'"),
    ({"qk_norm": True}, "qk_norm with norm_eps 1e-06"),
    ({"qkv_bias": True, "qk_norm": True, "norm_eps": 1e-5}, "qkv_bias and qk_norm together"),
    ({"qkv_bias": True, "window_size": 8}, "qkv_bias and window_size together"),
    ({"window_size": 0}, "window_size 0"),
    ({"attnres_block_size": 3}, "attnres_block_size 3"),
    ({"attnres_block_size": 0}, "attnres_block_size 0"),
    ({"attnres_block_size": -2}, "attnres_block_size -2"),
    ({"rope_theta": None}, "rope_theta None"),
    ({"num_kv_heads": 3}, "num_kv_heads 3"),
    ({"use_mtp": True}, "fields unknown to attnres-hf's fla 0.6 map"),
])
def test_fla_options_without_a_counterpart_are_refused(tmp_path, capsys, fla_folder, changes, match):
    folder = tmp_path / "src"
    shutil.copytree(fla_folder, folder)
    _edit_config(folder, **changes)
    _refused(tmp_path, capsys, ["convert", str(folder), str(tmp_path / "out")], match)


def _edit_tensors(fla_folder, folder, drop=(), add=None, reshape=None):
    shutil.copytree(fla_folder, folder)
    state = load_file(folder / "model.safetensors")
    for name in drop:
        del state[name]
    state |= add or {}
    for name, shape in (reshape or {}).items():
        state[name] = torch.zeros(shape)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, match", [
    (dict(drop=["model.layers.2.attn_res_proj.weight", "model.layers.2.mlp_res_norm.weight"]),
     "AttnRes tensors missing"),
    (dict(drop=["model.res_proj.weight"]), "model.final_res.query"),
    (dict(drop=["model.layers.1.attn.k_proj.weight"]), "no tensor for model.layers.1.self_attn.k_proj.weight"),
    (dict(add={"model.layers.0.attn.rotary.inv_freq": torch.zeros(4)}), "tensors with no place in the model"),
    (dict(add={"model.layers.3.attn_res_proj.weight": torch.zeros(1, 32)}), "model.layers.3.attn_res_proj.weight"),
    (dict(reshape={"model.layers.0.mlp.up_proj.weight": (48, 32)}), "model.layers.0.mlp.up_proj.weight (48, 32)"),
    (dict(reshape={"model.layers.1.mlp_res_proj.weight": (2, 32)}), "model.layers.1.mlp_res_proj.weight (2, 32)"),
])
def test_fla_tensors_that_do_not_fit_are_refused(tmp_path, capsys, fla_folder, edit, match):
    _edit_tensors(fla_folder, tmp_path / "src", **edit)
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "src"), str(tmp_path / "out")], match)


@pytest.mark.parametrize("argv, match", [
    (["--block-size", "4"], "attnres_block_size=4 (the checkpoint's is 2)"),
    (["--full"], "attnres_block_size=1 (the checkpoint's is 2)"),
    (["--depth-mixing", "dca"], "depth_mixing='dca'"),
])
def test_options_that_would_change_an_imported_model_are_refused(tmp_path, capsys, fla_folder, argv, match):
    _refused(tmp_path, capsys, ["convert", str(fla_folder), str(tmp_path / "out"), *argv], match)


def test_truncated_fla_weights_and_existing_outputs_are_refused(tmp_path, capsys, fla_folder):
    shutil.copytree(fla_folder, tmp_path / "src")
    data = (tmp_path / "src" / "model.safetensors").read_bytes()
    (tmp_path / "src" / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "src"), str(tmp_path / "out")], "truncated or corrupt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["convert", str(fla_folder), str(tmp_path / "out")]) == 2
    assert main(["export", "--to", "fla", str(fla_folder), str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_a_missing_fla_names_the_extra(tmp_path, capsys, fla_folder, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else find_spec(name, *a))
    _refused(tmp_path, capsys, ["convert", str(fla_folder), str(tmp_path / "out")], 'pip install "attnres-hf[fla]"')


@pytest.mark.parametrize("overrides, match", [
    (dict(depth_mixing="dca"), "depth_mixing 'dca'"),
    (dict(attnres_block_size=2, attnres_score_fn="sigmoid"), "attnres_score_fn='sigmoid'"),
    (dict(attnres_block_size=2, attnres_rescale_output=True), "attnres_rescale_output=True"),
    (dict(attnres_block_size=2, attnres_num_heads=2), "attnres_num_heads=2"),
    (dict(attnres_block_size=2, attnres_key_norm=False), "attnres_key_norm=False"),
    (dict(backbone={"model_type": "phi3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 99, "pad_token_id": 0}),
     "backbone 'phi3'"),
    (dict(backbone={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 99,
                    "attention_bias": True}), "attention_bias=True"),
    (dict(backbone={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 99, "head_dim": 16}),
     "head_dim=16"),
])
def test_models_fla_cannot_compute_are_refused_on_export(tmp_path, capsys, overrides, match):
    from attnres_hf import AttnResConfig

    tiny = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    fields = {"attnres_rescale_output": False} | ({} if "backbone" in overrides else tiny) | overrides
    AttnResForCausalLM(AttnResConfig(**fields)).save_pretrained(tmp_path / "ours")
    capsys.readouterr()  # save_pretrained's progress bar
    _refused(tmp_path, capsys, ["export", "--to", "fla", str(tmp_path / "ours"), str(tmp_path / "out")], match)


def test_export_of_a_folder_that_is_not_attnres_is_refused(tmp_path, capsys, fla_folder):
    _refused(tmp_path, capsys, ["export", "--to", "fla", str(fla_folder), str(tmp_path / "out")],
             "is not an AttnRes checkpoint (model_type 'transformer')")


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints as fla writes them: mixed dtypes, shards, fields left unset, odd JSON
# ---------------------------------------------------------------------------------------------------------------

def _bf16_qk_norm_folder(tmp_path, **save_kwargs):
    """What fla writes for a qk_norm model loaded in bf16: its q/k norms are built in fp32 (`RMSNorm(..., dtype=
    torch.float32)` in fla.layers.attn) and stay fp32, everything else is bf16."""
    fla_model(layers=3, block_size=2, qk_norm=True, norm_eps=1e-5).save_pretrained(tmp_path / "fp32")
    with fla_reference_kernels():
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    model.save_pretrained(tmp_path / "fla", **save_kwargs)
    return tmp_path / "fla"


@pytest.mark.parametrize("save", [dict(max_shard_size="7KB"), dict(safe_serialization=False)])
def test_a_mixed_dtype_checkpoint_keeps_every_value(tmp_path, capsys, save):
    """Every stored value reaches the model exactly (fp32), whichever tensor the files list first; `--dtype auto`
    writes the checkpoint's dtype as transformers reads it (its config's `dtype`)."""
    folder = _bf16_qk_norm_folder(tmp_path, **save)
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 0
    assert "exact: True" in capsys.readouterr().out
    report = convert(folder, tmp_path / "auto", dtype="auto")
    assert report["dtype"] == "bfloat16" and report["verification"]["exact"]


@pytest.mark.parametrize("fields", [dict(num_kv_heads=None), dict(max_position_embeddings=None),
                                    dict(intermediate_size=None, hidden_ratio=2), dict(tie_word_embeddings=True)])
def test_round_trip_gives_fla_config_back(tmp_path, fields):
    fla_model(layers=2, block_size=2, **fields).save_pretrained(tmp_path / "fla")
    convert(tmp_path / "fla", tmp_path / "ours")
    export(tmp_path / "ours", tmp_path / "back")
    before = json.loads((tmp_path / "fla" / "config.json").read_text())
    after = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in before.items() if k != "transformers_version"} == \
        {k: v for k, v in after.items() if k != "transformers_version"}
    stored, back = load_file(tmp_path / "fla" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(stored) == sorted(back) and all(torch.equal(stored[k], back[k]) for k in stored)


@pytest.mark.parametrize("value, expected", [(2.0, 2), (True, 1)])
def test_block_sizes_fla_runs_are_read_as_fla_reads_them(tmp_path, value, expected):
    folder = save_fla(tmp_path, layers=2, block_size=expected)
    _edit_config(folder, attnres_block_size=value)
    report = convert(folder, tmp_path / "out")
    assert report["config"]["attnres_block_size"] == expected and report["verification"]["exact"]


@pytest.mark.parametrize("changes, match", [
    ({"norm_eps": "1e-6"}, "norm_eps '1e-6'"), ({"norm_eps": None}, "norm_eps None"),
    ({"intermediate_size": "64"}, "intermediate_size '64'"),
    ({"max_position_embeddings": "128"}, "max_position_embeddings '128'"),
    ({"tie_word_embeddings": "true"}, "tie_word_embeddings 'true'"), ({"initializer_range": None}, "initializer_range"),
    ({"use_cache": None}, "use_cache None"), ({"hidden_ratio": "4", "intermediate_size": None}, "hidden_ratio '4'"),
    ({"pad_token_id": 500}, "pad_token_id 500"), ({"rope_theta": "10000"}, "rope_theta '10000'"),
])
def test_wrong_typed_fla_fields_are_one_line_refusals(tmp_path, capsys, fla_folder, changes, match):
    folder = tmp_path / "src"
    shutil.copytree(fla_folder, folder)
    _edit_config(folder, **changes)
    _refused(tmp_path, capsys, ["convert", str(folder), str(tmp_path / "out")], match)


def test_fla_reference_kernels_leave_fla_as_found():
    """After the check (an exception inside it too) fla's modules hold what they held, absent names absent."""
    import fla.layers.attn as attn
    import fla.models.transformer.modeling_transformer as modeling

    before = (dict(vars(attn)), modeling.fused_attnres)
    with pytest.raises(RuntimeError, match="inside"):
        with fla_reference_kernels():
            raise RuntimeError("inside")
    assert dict(vars(attn)) == before[0] and modeling.fused_attnres is before[1]


def test_overrides_equal_to_the_checkpoint_are_accepted_and_bad_shard_sizes_refused(tmp_path, capsys, fla_folder):
    report = convert(fla_folder, tmp_path / "ours", attnres_score_fn="softmax", attnres_key_norm=True)
    assert report["verification"]["exact"]
    with pytest.raises(ValueError, match="unknown AttnResConfig field"):
        convert(fla_folder, tmp_path / "x", attnres_scor_fn="softmax")
    capsys.readouterr()  # the conversion's progress bars
    _refused(tmp_path, capsys, ["export", "--to", "fla", str(tmp_path / "ours"), str(tmp_path / "out"),
                                "--max-shard-size", "abc"], "max_shard_size must be a size")


def test_the_map_knows_every_field_of_fla_config():
    """`FLA_FIELDS` is fla 0.6's `TransformerConfig` signature: a field fla adds fails here, not silently."""
    import inspect

    from fla.models import TransformerConfig

    from attnres_hf.conversion.fla_layout import FLA_FIELDS

    assert set(FLA_FIELDS) == set(inspect.signature(TransformerConfig.__init__).parameters) - {"self", "kwargs"}
