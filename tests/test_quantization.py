"""Quantized loads (bitsandbytes 4-bit / 8-bit on its CPU backend, torchao int8 weight-only) and QLoRA training.

The depth-mixing modules stay unquantized fp32 for every `depth_mixing`; the names the quantizers skip come from the
model's own modules (`MIXING_MODULES`), never a hand list.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

from attnres_hf.cli import main
from attnres_hf.modeling.configuration_attnres import DEPTH_MIXING_METHODS
from attnres_hf.modeling.depth_mixing import MIXING_MODULES
from attnres_hf.quantization import qlora_quantization_config, quantized_modules
from attnres_hf.training.recipes import merge_lora, prepare_model
from utils import TINY, tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def _int8_weight_only():
    # torchao is the optional `torchao` extra (not in `test`: with a CPU torch its import warns about its CUDA kernels
    # in every process that imports a transformers model).
    Int8WeightOnlyConfig = pytest.importorskip("torchao.quantization").Int8WeightOnlyConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


QUANTIZATIONS = {
    "bnb-4bit": (lambda: qlora_quantization_config(), 0.3),  # NF4 on random weights: ~0.17 measured
    "bnb-8bit": (lambda: BitsAndBytesConfig(load_in_8bit=True), 0.05),
    "torchao-int8": (_int8_weight_only, 0.05),
}
"""name -> (quantization config, bound on the logits' relative error against the fp32 model)."""


def _mixing_parameters(model) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{param_name}": param
        for name, module in model.named_modules()
        if isinstance(module, MIXING_MODULES)
        for param_name, param in module.named_parameters()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """depth_mixing -> (folder, fp32 model) for a tiny model with trained-like mixing parameters."""
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for method in DEPTH_MIXING_METHODS:
        model = tiny_model(seed=1, depth_mixing=method, hidden_size=64, intermediate_size=128)
        with torch.no_grad():  # every mixing parameter away from its init, so a lost or rounded one shows
            for param in _mixing_parameters(model).values():
                param.add_(0.1 * torch.randn_like(param))
        model.save_pretrained(root / method)
        out[method] = (root / method, model)
    return out


# 4-bit for every method; the 8-bit paths for one router method and one multi-stream method.
CASES = [(method, "bnb-4bit") for method in DEPTH_MIXING_METHODS]
CASES += [(method, name) for name in ("bnb-8bit", "torchao-int8") for method in ("attnres", "mhc")]


@pytest.mark.parametrize(("method", "quantization"), CASES, ids=[f"{m}-{q}" for m, q in CASES])
def test_quantized_load_keeps_depth_mixing_in_fp32(saved, method, quantization):
    folder, reference = saved[method]
    config, tolerance = QUANTIZATIONS[quantization]
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config(), device_map="cpu", dtype=torch.bfloat16
    ).eval()
    layers = TINY["num_hidden_layers"]
    assert quantized_modules(model) == sorted(
        f"model.layers.{i}.{'self_attn' if p.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{p}"
        for i in range(layers)
        for p in PROJECTIONS
    )
    mixing = _mixing_parameters(model)
    assert (method == "residual") == (not mixing)
    expected = _mixing_parameters(reference)
    assert set(mixing) == set(expected)
    for name, param in mixing.items():  # unquantized, fp32 under dtype=bfloat16, the saved values exactly
        assert param.dtype == torch.float32, name
        torch.testing.assert_close(param.data, expected[name].data, rtol=0, atol=0)
    with torch.no_grad():
        logits, want = model(IDS).logits.float(), reference(IDS).logits
    assert (logits - want).norm() / want.norm() < tolerance
    assert model.generate(IDS[:1], max_new_tokens=4, do_sample=False).shape == (1, IDS.shape[1] + 4)


def test_bfloat16_load_keeps_depth_mixing_in_fp32(saved):
    folder, _ = saved["muddformer"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    mixing = _mixing_parameters(model)
    assert mixing and all(param.dtype == torch.float32 for param in mixing.values())
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model(IDS).logits.dtype == torch.bfloat16


def test_qlora_needs_a_4bit_model():
    with pytest.raises(ValueError, match="needs a 4-bit model"):
        prepare_model(tiny_model(), "qlora")


@pytest.mark.slow
def test_qlora_trains_saves_reloads_and_merges(tiny_model_dir):
    out = tiny_model_dir / "qlora"
    assert main(["train", str(tiny_model_dir / "model"), "--data", str(tiny_model_dir / "train.txt"), "--output-dir",
                 str(out), "--method", "qlora", "--max-steps", "8", "--lr", "1e-2", "--lora_r", "4", "--seq-len", "64",
                 "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--seed", "0", "--eval_steps", "8",
                 "--save_steps", "8", "--logging_steps", "4"]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["method"] == "qlora"
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.05
    adapter = load_file(out / "adapter_model.safetensors")
    assert sum("lora_B" in k for k in adapter) == TINY["num_hidden_layers"] * len(PROJECTIONS)
    assert any(k.endswith("mlp_res.query") for k in adapter)  # the fp32 routers train and travel with the adapter
    assert all(v.dtype == torch.float32 for v in adapter.values())

    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir / "model", quantization_config=qlora_quantization_config())
    reloaded = PeftModel.from_pretrained(base, out).eval()
    merged = merge_lora(tiny_model_dir / "model", out, tiny_model_dir / "merged").eval()
    with torch.no_grad():  # the merged fp32 model and the adapter on the 4-bit base differ by the 4-bit rounding only
        adapted, full = reloaded(IDS).logits, merged(IDS).logits
    assert (adapted - full).norm() / full.norm() < 0.15
    generated = merged.generate(IDS[:1], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, IDS.shape[1] + 5)


# ---------------------------------------------------------------------------------------------------------------
# An adapter's base quantisation: recorded, and checked before the adapter loads (`attnres_hf.training.adapters`)
# ---------------------------------------------------------------------------------------------------------------

from types import SimpleNamespace  # noqa: E402

from attnres_hf.training import adapters  # noqa: E402
from attnres_hf.training.adapters import check_base_quantization, load_adapter, save_base_quantization  # noqa: E402

BASES = {
    "full-precision": lambda: None,
    "nf4-double": qlora_quantization_config,
    "nf4-double-bf16-compute": lambda: qlora_quantization_config(torch.bfloat16),
    "nf4-single": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4 (load_in_4bit=True alone)": lambda: BitsAndBytesConfig(load_in_4bit=True),
    "fp4-double": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True),
    "int8": lambda: BitsAndBytesConfig(load_in_8bit=True),
}
"""name -> the quantization config a base is loaded with (None: full precision)."""

ACCEPTED = {  # trained on -> the bases its adapter accepts (a full-precision base always: the merge)
    "nf4-double": {"full-precision", "nf4-double", "nf4-double-bf16-compute"},
    "full-precision": {"full-precision"},
    "int8": {"full-precision", "int8"},
    "fp4 (load_in_4bit=True alone)": {"full-precision", "fp4 (load_in_4bit=True alone)"},
}
CHECKS = [(trained, base) for trained in ACCEPTED for base in BASES]


def _recorded_adapter(folder, trained_on: str):
    """An adapter folder (PEFT's file, a stand-in) whose record says its base was `trained_on`."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    config = BASES[trained_on]()
    save_base_quantization(SimpleNamespace(config=SimpleNamespace(quantization_config=config)), folder)
    return folder


def _as_dict(config):
    return None if config is None else json.loads(json.dumps(config.to_dict()))


@pytest.mark.parametrize(("trained", "base"), CHECKS, ids=[f"{t}-on-{b}" for t, b in CHECKS])
def test_adapter_accepts_only_its_own_base_quantisation_or_full_precision(tmp_path, trained, base):
    folder = _recorded_adapter(tmp_path / "adapter", trained)
    quantization = _as_dict(BASES[base]())
    if base in ACCEPTED[trained]:
        check_base_quantization(quantization, folder)
    else:
        with pytest.raises(ValueError, match=r"was trained on a base in .* but this base is in .*load_adapter"):
            check_base_quantization(quantization, folder)
    check_base_quantization(quantization, folder, allow_other_quantization=True)  # the explicit override


def test_adapter_record_descriptions_and_unrecorded_adapters(tmp_path):
    folder = _recorded_adapter(tmp_path / "adapter", "nf4-double")
    record = json.loads((folder / adapters.BASE_QUANTIZATION_FILE).read_text())
    assert record["description"] == "bitsandbytes 4-bit nf4 with double quantization"
    assert adapters.base_quantization_config(folder).to_dict() == qlora_quantization_config().to_dict()
    assert adapters.describe_quantization(_as_dict(BASES["int8"]())) == "bitsandbytes 8-bit (int8)"
    assert adapters.describe_quantization(None).startswith("full precision")
    (folder / adapters.BASE_QUANTIZATION_FILE).unlink()  # PEFT alone writes no record: nothing to check against
    check_base_quantization(_as_dict(BASES["int8"]()), folder)
    assert adapters.base_quantization_config(folder) is None
    for broken in ("{not json", '{"description": "x"}', '{"quantization_config": 4}'):
        (folder / adapters.BASE_QUANTIZATION_FILE).write_text(broken)
        with pytest.raises(ValueError, match="base_quantization.json"):
            check_base_quantization(None, folder)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model or adapter load fails the test: the refusals below come before one."""
    from peft import PeftModel

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(PeftModel, "from_pretrained", refuse)


@pytest.mark.parametrize("base", ["fp4 (load_in_4bit=True alone)", "nf4-single", "int8"])
def test_load_adapter_refuses_another_quantisation_before_loading(saved, tmp_path, base, no_model_loads):
    folder = _recorded_adapter(tmp_path / "adapter", "nf4-double")
    with pytest.raises(ValueError, match="but this base is in bitsandbytes"):
        load_adapter(saved["attnres"][0], folder, quantization_config=BASES[base]())


def test_merge_lora_refuses_before_loading(saved, tmp_path, no_model_loads):
    folder = _recorded_adapter(tmp_path / "adapter", "nf4-double")
    with pytest.raises(FileNotFoundError, match="no tokenizer in .* nor in the base folder"):  # neither has one
        merge_lora(saved["attnres"][0], folder, tmp_path / "merged")
    (tmp_path / "merged").mkdir()
    with pytest.raises(FileExistsError, match="already exists; pass force=True"):
        merge_lora(saved["attnres"][0], folder, tmp_path / "merged")
    assert not any((tmp_path / "merged").iterdir())  # nothing written, nothing lost


def test_merge_lora_refuses_a_base_quantised_otherwise(saved, tmp_path):
    folder = _recorded_adapter(tmp_path / "adapter", "nf4-double")
    base = AutoModelForCausalLM.from_pretrained(saved["attnres"][0], quantization_config=BitsAndBytesConfig(
        load_in_8bit=True), device_map="cpu")
    with pytest.raises(ValueError, match="trained on a base in bitsandbytes 4-bit nf4 .* this base is in bitsandbytes "
                                         "8-bit"):
        merge_lora(base, folder)  # PEFT would fail on the stand-in adapter_config.json: the check came first
