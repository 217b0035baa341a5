"""Quantized loads (bitsandbytes 4-bit / 8-bit on its CPU backend, torchao int8 weight-only) and QLoRA training.

The depth-mixing modules stay unquantized fp32 for every `depth_mixing`; the names the quantizers skip come from the
model's own modules (`MIXING_MODULES`), never a hand list.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

from attnres_hf import AttnResConfig, AttnResForCausalLM
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


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A plain LlamaForCausalLM folder of the tiny shape: it holds no depth-mixing tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", [m for m in DEPTH_MIXING_METHODS if m != "residual"])
def test_mixing_initialised_at_load_is_fp32(llama_folder, method, dtype):
    # every mixing tensor is missing from a Llama folder: transformers initialises it, and it is fp32 as loaded ones are
    def load(dtype):
        torch.manual_seed(0)  # MUDDFormer's w1 and mHC's phi are random: the same draws in both loads
        config = AttnResConfig(**TINY, depth_mixing=method)
        return AutoModelForCausalLM.from_pretrained(llama_folder, config=config, dtype=dtype)

    model, reference = load(dtype), load(torch.float32)
    mixing = _mixing_parameters(model)
    assert mixing and {name: p.dtype for name, p in mixing.items()} == dict.fromkeys(mixing, torch.float32)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    expected = _mixing_parameters(reference)  # initialised in fp32, not rounded through `dtype`
    for name, param in mixing.items():
        torch.testing.assert_close(param.data, expected[name].data, rtol=0, atol=0)
    assert model(IDS).logits.dtype == dtype


def test_mixing_partly_in_checkpoint_is_fp32_and_keeps_loaded_values(saved, tmp_path):
    # the queries are in the checkpoint, the key-norm weights are not: all fp32, the queries exactly the saved ones
    from safetensors.torch import save_file

    folder, reference = saved["attnres"]
    state = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in state.items() if "_res.key_norm" not in k}
    assert len(kept) < len(state)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = AttnResForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    expected = _mixing_parameters(reference)
    for name, param in _mixing_parameters(model).items():
        assert param.dtype == torch.float32, name
        want = torch.ones_like(param) if ".key_norm." in name else expected[name]
        torch.testing.assert_close(param.data, want.data, rtol=0, atol=0)


def test_mixing_built_in_bfloat16_is_fp32():
    for model in (AttnResForCausalLM._from_config(AttnResConfig(**TINY), dtype=torch.bfloat16),
                  AutoModelForCausalLM.from_config(AttnResConfig(**TINY, depth_mixing="mhc"), dtype=torch.bfloat16)):
        mixing = _mixing_parameters(model)
        assert mixing and all(param.dtype == torch.float32 for param in mixing.values())
        assert model.lm_head.weight.dtype == torch.bfloat16


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
