"""Quantized loads (bitsandbytes 4-bit / 8-bit on its CPU backend, torchao int8 weight-only) and QLoRA training.

The depth-mixing modules stay unquantized fp32 for every `depth_mixing`; the names the quantizers skip come from the
model's own modules (`MIXING_MODULES`), never a hand list.
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.cli import main
from attnres_hf.modeling.configuration_attnres import DEPTH_MIXING_METHODS
from attnres_hf.modeling.depth_mixing import MIXING_MODULES
from attnres_hf.quantization import (
    check_4bit_shapes,
    keep_4bit_layers_trainable,
    qlora_quantization_config,
    quantized_modules,
    unsupported_4bit_shapes,
)
from attnres_hf.training.recipes import merge_lora, prepare_model
from utils import FOUR_BIT_SHAPE, TINY, counting_text, tiny_model, word_tokenizer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def _int8_weight_only():
    # torchao is the optional `torchao` extra (not in `test`: with a CPU torch its import warns about its CUDA kernels
    # in every process that imports a transformers model).
    Int8WeightOnlyConfig = pytest.importorskip("torchao.quantization").Int8WeightOnlyConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _dequantized_4bit(quantized, model):
    """A copy of the fp32 `model` holding the 4-bit weights of `quantized`, dequantized: the function the 4-bit model
    computes, up to its matmuls' rounding (taken before the first forward, which may repack the weights)."""
    import bitsandbytes as bnb

    reference = copy.deepcopy(model)
    weights = {f"{name}.weight": bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
               for name, module in quantized.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
    assert not reference.load_state_dict(weights, strict=False).unexpected_keys
    return reference


QUANTIZATIONS = {
    # NF4 itself is ~0.13-0.39 from the fp32 model on these random weights (0.39: AttnRes with random routers), so the
    # 4-bit model is held to its own dequantized weights. bitsandbytes' AVX-512 BF16 CPU kernel computes in bf16:
    # measured 0.004-0.009 (0.021 for AttnRes) from them; a misread input (a row-strided one, DCA's) gave 1.08.
    "bnb-4bit": (lambda: qlora_quantization_config(), _dequantized_4bit, 0.05),
    # LLM.int8 and int8 weight-only on the same weights: well under 0.05 from the fp32 model
    "bnb-8bit": (lambda: BitsAndBytesConfig(load_in_8bit=True), None, 0.05),
    "torchao-int8": (_int8_weight_only, None, 0.05),
}
"""name -> (quantization config, the reference the logits are held to (`None`: the fp32 model), bound on the logits'
relative error against it)."""


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
        model = tiny_model(seed=1, depth_mixing=method, **FOUR_BIT_SHAPE)
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
    config, dequantized, tolerance = QUANTIZATIONS[quantization]
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config(), device_map="cpu", dtype=torch.bfloat16
    ).eval()
    if dequantized is not None:
        reference = dequantized(model, reference)
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
    assert model.generate(IDS[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, IDS.shape[1] + 4)


@pytest.mark.parametrize("method", DEPTH_MIXING_METHODS)
def test_every_projection_reads_a_row_major_input(method):
    """The depth state hands the sub-layers contiguous inputs (`DepthRead`), whatever the method computes them with:
    bitsandbytes' AVX-512 BF16 4-bit CPU kernel reads its input as row-major, so a strided one (DCA's einsum output
    had the hidden axis strided) gives unrelated outputs on that CPU and right ones elsewhere."""
    model = tiny_model(depth_mixing=method)
    layouts = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda mod, args, name=name: layouts.append((name, args[0].stride(),
                                                                                         args[0].is_contiguous())))
    with torch.no_grad():
        model(IDS)
    assert len(layouts) == TINY["num_hidden_layers"] * len(PROJECTIONS) + 1  # and the head
    assert [entry for entry in layouts if not entry[2]] == []


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


SHAPES = {"hidden32": dict(hidden_size=32, intermediate_size=64), "down96": dict(hidden_size=64, intermediate_size=96),
          "hidden64": FOUR_BIT_SHAPE}
"""Layer shapes around bitsandbytes' AVX-512 BF16 CPU kernel's rule: no projection, the down projection only, all."""


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_4bit_shape_rule_is_what_bitsandbytes_runs_on_this_cpu(shape, tmp_path):
    """`unsupported_4bit_shapes` says which models bitsandbytes' 4-bit CPU kernel cannot run here: a plain transformers
    Llama and the AttnRes model of the same shape both run an eval-mode no-grad forward exactly when it finds no
    layer (on a CPU without AVX-512 BF16 every shape runs and it finds none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**{**TINY, **shape}))
    for name, model in (("llama", llama), ("attnres", tiny_model(**shape))):
        model.save_pretrained(tmp_path / name)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name, quantization_config=qlora_quantization_config())
        unsupported = unsupported_4bit_shapes(loaded.config)
        try:
            with torch.no_grad():
                loaded.eval()(IDS)
        except (RuntimeError, AssertionError) as error:  # bitsandbytes asserts the output tile, reshapes the scales
            assert unsupported, f"{name}: bitsandbytes failed where no layer was predicted to: {error}"
        else:
            assert not unsupported, f"{name}: ran although {unsupported} were predicted not to"


def test_4bit_shape_rule_names_each_layer_that_breaks_it():
    """The rule itself, on every CPU (the kernel's detection forced on): in_features % 64, out_features % 32."""
    from utils import tiny_config

    assert unsupported_4bit_shapes(tiny_config(**FOUR_BIT_SHAPE), repacking=True) == []
    assert unsupported_4bit_shapes(tiny_config(**SHAPES["down96"]), repacking=False) == []
    assert unsupported_4bit_shapes(tiny_config(**SHAPES["down96"]), repacking=True) == [
        f"model.layers.{i}.mlp.down_proj (96 -> 64)" for i in range(TINY["num_hidden_layers"])]
    # k/v: 32 -> 16 (2 heads of 8) breaks both rules; the tied lm_head is never quantized
    bad = unsupported_4bit_shapes(tiny_config(), repacking=True)
    assert len(bad) == 6 * TINY["num_hidden_layers"] and "model.layers.0.self_attn.k_proj (32 -> 16)" in bad
    assert not any("lm_head" in name or "down_proj" in name for name in bad)
    # GPT-2's Conv1D layers (weight (in, out)) are quantized too: at width 96 all but the MLP's output break the rule
    from transformers import GPT2Config

    gpt2 = unsupported_4bit_shapes(GPT2Config(n_embd=96, n_layer=1, n_head=2, vocab_size=99), repacking=True)
    assert gpt2 == ["transformer.h.0.attn.c_attn (96 -> 288)", "transformer.h.0.attn.c_proj (96 -> 96)",
                    "transformer.h.0.mlp.c_fc (96 -> 384)"]
    with pytest.raises(ValueError, match=r"^bitsandbytes' 4-bit CPU kernel .* by 64 and out_features by 32; "
                                         r"model\.layers\.0\.self_attn\.q_proj \(32 -> 32\) and 17 more"):
        check_4bit_shapes(tiny_config(), repacking=True)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()
    return grads


def _qlora_model(folder, evaluate_first: bool = False):
    loaded = AutoModelForCausalLM.from_pretrained(folder, quantization_config=qlora_quantization_config())
    if evaluate_first:  # a baseline perplexity or `generate` before training: repacks the weights on AVX-512 BF16
        with torch.no_grad():
            loaded.eval()(IDS)
    torch.manual_seed(0)
    model = prepare_model(loaded, "qlora", lora_r=4)
    with torch.no_grad():  # LoRA B starts at zero: give every adapter a gradient path through the 4-bit layers
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model.train()


def test_qlora_on_a_model_evaluated_before_it_gets_its_gradients(tmp_path):
    """A model that ran a no-grad forward before `prepare_model(..., "qlora")` (its weights repacked where the CPU has
    AVX-512 BF16) has its weights unpacked again, and its gradients pass through every 4-bit layer: those of a model
    that did not, up to its scales' rounding (repacking keeps them in bf16, unpacking quantizes them again): measured
    on an AVX-512 Xeon, relative differences median 0.015, largest 0.06; with the gradients cut, median 0.45."""
    tiny_model(**FOUR_BIT_SHAPE).save_pretrained(tmp_path)
    model = _qlora_model(tmp_path, evaluate_first=True)
    states = [getattr(param, "quant_state", None) for param in model.parameters()]
    assert not any(getattr(state, "packing_format_for_cpu", False) for state in states)
    fresh, evaluated = _lora_grads(_qlora_model(tmp_path)), _lora_grads(model)
    assert fresh.keys() == evaluated.keys()
    differences = sorted(((evaluated[n] - grad).norm() / grad.norm()).item() for n, grad in fresh.items())
    assert differences[len(differences) // 2] < 0.05 and differences[-1] < 0.2, differences


@pytest.mark.parametrize("shape", [SHAPES["hidden32"], FOUR_BIT_SHAPE], ids=["hidden32", "hidden64"])
def test_qlora_keeps_gradients_through_4bit_layers_after_an_evaluation(shape, tmp_path):
    """An evaluation in the middle of QLoRA training (`Trainer.evaluate`: eval mode, no grad) must not change the next
    step's gradients: bitsandbytes' AVX-512 BF16 CPU kernel, which a no-grad forward switches to, has no backward (every
    adapter before the last layer lost part of its gradient), and it runs only some shapes (hidden 32 crashed)."""
    tiny_model(**shape).save_pretrained(tmp_path)
    model = _qlora_model(tmp_path)
    before = _lora_grads(model)
    with torch.no_grad():
        model.eval()(IDS)
    after = _lora_grads(model.train())
    adapters = TINY["num_hidden_layers"] * len(PROJECTIONS)
    assert before.keys() == after.keys() and sum("lora_A" in name for name in after) == adapters
    for name, grad in after.items():  # the same layers, kernels and inputs: only the order of a few sums may differ
        torch.testing.assert_close(grad, before[name], rtol=1e-5, atol=1e-7, msg=name)
    assert keep_4bit_layers_trainable(model) == adapters


@pytest.fixture
def four_bit_model_dir(tmp_path):
    """`tiny_model_dir` at layer shapes bitsandbytes' 4-bit CPU kernels run on every CPU."""
    tiny_model(routers=False, attnres_block_size=2, **FOUR_BIT_SHAPE).save_pretrained(tmp_path / "model")
    word_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "train.txt").write_text(counting_text())
    return tmp_path


@pytest.mark.slow
def test_qlora_trains_saves_reloads_and_merges(four_bit_model_dir):
    root = four_bit_model_dir
    out = root / "qlora"
    assert main(["train", str(root / "model"), "--data", str(root / "train.txt"), "--output-dir", str(out),
                 "--method", "qlora", "--max-steps", "8", "--lr", "1e-2", "--lora_r", "4", "--seq-len", "64",
                 "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--seed", "0", "--eval_strategy", "steps", "--eval_steps", "8",
                 "--save_steps", "8", "--logging_steps", "4"]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["method"] == "qlora"
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.05
    adapter = load_file(out / "adapter_model.safetensors")
    assert sum("lora_B" in k for k in adapter) == TINY["num_hidden_layers"] * len(PROJECTIONS)
    assert any(k.endswith("mlp_res.query") for k in adapter)  # the fp32 routers train and travel with the adapter
    assert all(v.dtype == torch.float32 for v in adapter.values())

    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(root / "model", quantization_config=qlora_quantization_config())
    reloaded = PeftModel.from_pretrained(base, out).eval()
    merged = merge_lora(root / "model", out, root / "merged").eval()
    with torch.no_grad():  # the merged fp32 model and the adapter on the 4-bit base differ by the 4-bit rounding only
        adapted, full = reloaded(IDS).logits, merged(IDS).logits
    assert (adapted - full).norm() / full.norm() < 0.15
    generated = merged.generate(IDS[:1], max_new_tokens=5, min_new_tokens=5, do_sample=False)
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
