"""Train elsewhere and come back: an AttnRes model exported to another trainer's layout, trained there, and converted
back with `attnres convert` keeps every trained tensor bit for bit, the routers' trained values included.

- fla: `attnres export --to fla` -> flash-linear-attention 0.6's own `TransformerForCausalLM` (loaded with transformers'
  `AutoModelForCausalLM`, on CPU with `fla_reference_kernels()`) takes two AdamW steps on its own LM loss and
  `save_pretrained`s -> `attnres convert` (Block and Full AttnRes, fp32 and bf16).
- K3 layout: `attnres export --to k3-layout` -> two AdamW steps on the exported tensors under K3's names -> `attnres
  convert`. No K3 trainer runs here: torchtitan 0.3.0, its only release on PyPI, has no Kimi K3 model (its models are
  deepseek_v3, flux, gpt_oss, kimi_k2_7 (Kimi K2.5: MLA + MoE, no KDA, no AttnRes), llama3, muse_glimmer, qwen3 and
  qwen3_5), and its `kimi_k3` exists only on a development branch that pip cannot install. The trainer here is the
  independent float64 K3 forward of `tests/k3_reference.py` (written from K3's specs; it imports neither attnres_hf nor
  transformers' models), which reads the tensors under K3's Hugging Face names, the names torchtitan's
  `kimi_k3/hf_key_map.py` reads and writes (bare `model.` as exported, or the release's `language_model.model.`): its
  loss's gradients, fp32 master weights, then the tensors written back in their stored dtypes. K3's router biases
  (`e_score_correction_bias`) take no gradient (they pick experts only); the trainer moves them as aux-loss-free
  balancing does (DeepSeek-V3's rule, K3's `noaux_tc` router), by 1e-3 times the sign of each expert's load below the
  mean. Layer 0's pre-attention router pair gets no gradient in either layout (never read) and is kept as exported,
  or, in one case, written as the zeros and ones torchtitan's development `KimiK3StateDictAdapter.to_hf` puts there.

Checks: every tensor the trainer saved equals, bit for bit and dtype for dtype, the tensor it maps to in the AttnRes
model `attnres convert` makes of it (stored, and as loaded); every tensor but layer 0's never-read pair moved in
training, every pseudo-query and key norm included (so a router reset or re-initialised on import would fail the
test); the converted model computes the trained model's logits.

Tolerances (fp32 logits, max |delta| over max |logits|; measured with these tiny models over seeds 0-2): fla's
trained model against the converted one 2.5e-7 to 1.8e-6 for Block and Full AttnRes (logits 0.6-0.8; fla's kernels
and ours for the same function), bounded by `EXACT_TOLERANCE` (1e-4, as in `tests/test_fla.py`); the converted K3
model against the float64 reference on the trained tensors 5.8e-7 to 1.1e-6 (logits 0.7-1.0), bounded by `REL_TOL`
(1e-3, `tests/test_k3.py`'s bound for the same comparison, set there from top-k expert near-ties across configs).
The tensors are compared with `torch.equal`, no tolerance.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import k3_reference
from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.cli import main
from attnres_hf.conversion.fla_cpu import fla_reference_kernels
from attnres_hf.conversion.fla_source import EXACT_TOLERANCE
from attnres_hf.conversion.k3_layout import PREFIXES, backbone_from_k3, to_k3_state_dict
from k3_reference import k3_reference_logits, tiny_k3_text_config
from utils import randomize_routers, tiny_model

REL_TOL = 1e-3
"""Max |delta logits| (fp32 converted model vs float64 K3 reference) over max |reference logits| (test_k3.py's)."""

STEPS, LR = 2, 1e-2
"""Two AdamW steps (no weight decay): every tensor with a gradient moves by about `LR` per step."""

BALANCE_RATE = 1e-3
"""Aux-loss-free balancing's bias update speed (DeepSeek-V3's)."""


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `folder`, as stored."""
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            state |= {name: handle.get_tensor(name) for name in handle.keys()}
    return state


def relative(logits, reference) -> float:
    return float((logits.double() - reference.double()).abs().max() / reference.double().abs().max())


def reimported(folder) -> dict[str, torch.Tensor]:
    """The tensors of the AttnRes model `attnres convert` wrote to `folder`, as stored, after checking that the model
    loaded from it (`dtype="auto"`) holds exactly these values (it keeps its routers in fp32 in a bf16 model: an
    exact upcast)."""
    stored = folder_tensors(folder)
    loaded = AttnResForCausalLM.from_pretrained(folder, dtype="auto").state_dict()
    assert sorted(loaded) == sorted(stored)
    for name, tensor in loaded.items():
        assert torch.equal(tensor.to(stored[name].dtype), stored[name]), name
    return stored


def assert_came_back(trained: dict, back: dict, exported: dict, is_router, unchanged: set):
    """`back` (the converted model's tensors under the trainer's names) holds every `trained` tensor bit for bit and
    in its dtype; training moved every tensor away from its `exported` value, the routers' included, but the
    `unchanged` ones (layer 0's never-read router pair, if the trainer saved it as it was exported)."""
    assert sorted(back) == sorted(trained)
    for name, tensor in trained.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    kept = {name for name, tensor in trained.items() if torch.equal(tensor, exported[name].to(tensor.dtype))}
    assert kept == unchanged
    routers = {name for name in trained if is_router(name)}
    assert len(routers - unchanged) >= 10  # pseudo-queries and key norms, trained and come back


# ---------------------------------------------------------------------------------------------------------------
# fla: its own TransformerForCausalLM trains
# ---------------------------------------------------------------------------------------------------------------

FLA_IDS = torch.randint(3, 99, (2, 17), generator=torch.Generator().manual_seed(1))


def fla_train(folder, out, dtype):
    """Two AdamW steps of fla's `TransformerForCausalLM` from `folder` on fla's own LM loss, saved to `out`; returns
    the trained model (fp32: its logits are the reference)."""
    with fla_reference_kernels():
        # fla's fused cross entropy is Triton-only: on CPU it takes its torch loss (a kernel choice, same function)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, fuse_cross_entropy=False)
        assert type(model).__name__ == "TransformerForCausalLM"
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        model.train()
        for _ in range(STEPS):
            loss = model(input_ids=FLA_IDS, labels=FLA_IDS).loss
            assert torch.isfinite(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.save_pretrained(out)
    return model.eval()


def fla_logits(folder):
    with fla_reference_kernels():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(FLA_IDS).logits


FLA_CASES = {"block-2": (2, torch.float32), "full": (1, torch.float32), "block-2-bf16": (2, torch.bfloat16)}


@pytest.mark.parametrize("block_size, dtype", FLA_CASES.values(), ids=FLA_CASES.keys())
def test_training_in_fla_comes_back_bit_for_bit(tmp_path, block_size, dtype):
    pytest.importorskip("fla")
    from attnres_hf.conversion.fla_layout import to_fla_name

    model = tiny_model(attnres_block_size=block_size, attnres_rescale_output=False)  # trained-like routers
    model.save_pretrained(tmp_path / "ours")
    assert main(["export", "--to", "fla", str(tmp_path / "ours"), str(tmp_path / "fla")]) == 0
    fla_train(tmp_path / "fla", tmp_path / "trained", dtype)
    assert main(["convert", str(tmp_path / "trained"), str(tmp_path / "back"), "--dtype", "auto"]) == 0

    trained = folder_tensors(tmp_path / "trained")
    assert {t.dtype for t in trained.values()} == {dtype}
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["attnres_block_size"] == block_size and config["attnres_rescale_output"] is False
    back = {to_fla_name(name): tensor.reshape(trained[to_fla_name(name)].shape)
            for name, tensor in reimported(tmp_path / "back").items()}
    assert_came_back(trained, back, folder_tensors(tmp_path / "fla"), is_router=lambda name: "res_" in name,
                     unchanged={"model.layers.0.attn_res_proj.weight", "model.layers.0.attn_res_norm.weight"})

    back32 = AttnResForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative(back32(FLA_IDS).logits, fla_logits(tmp_path / "trained")) <= EXACT_TOLERANCE


# ---------------------------------------------------------------------------------------------------------------
# K3 layout: a trainer that reads K3's names (the float64 reference forward, see the module docstring)
# ---------------------------------------------------------------------------------------------------------------

K3_IDS = torch.randint(3, 95, (2, 13), generator=torch.Generator().manual_seed(1))
"""Probe and training tokens (any in the tiny K3 vocabulary of 96 but the special ones)."""


def k3_model() -> AttnResForCausalLM:
    """A native `kimi_k3` AttnRes model (every K3 piece on: KDA, MLA, latent MoE, SiTU, 5 layers) in Block AttnRes of 4
    sub-layers (K3's 2 layers), with trained-like routers."""
    backbone, problems = backbone_from_k3({k: v for k, v in tiny_k3_text_config().items()
                                           if k != "attn_res_block_size"})
    assert not problems
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(backbone=backbone, depth_mixing="attnres", attnres_block_size=4,
                                             attnres_rescale_output=False)).eval()
    randomize_routers(model, seed=0)
    return model


def k3_train(tensors: dict, text_config: dict, monkeypatch) -> dict[str, torch.Tensor]:
    """Two AdamW steps on the LM loss of the K3 reference forward over `tensors` (K3 names), fp32 master weights,
    plus aux-loss-free balancing of the router biases; returns the tensors in their stored dtypes."""
    params = {name: tensor.to(torch.float32, copy=True).requires_grad_() for name, tensor in tensors.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.0)
    chosen = {}

    def route(W, m, x, cfg):  # the reference's router, recording each MoE layer's expert choices
        idx, weights = original_route(W, m, x, cfg)
        chosen[m] = idx
        return idx, weights

    original_route = k3_reference._route
    monkeypatch.setattr(k3_reference, "_route", route)
    for _ in range(STEPS):
        logits = k3_reference_logits(params, text_config, K3_IDS)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), K3_IDS[:, 1:].flatten())
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()  # A_log's zero padding gets zero gradients, and Adam moves a zero gradient by zero
        optimizer.zero_grad()
        with torch.no_grad():
            for prefix, idx in chosen.items():
                bias = next(p for n, p in params.items() if n.endswith(prefix + "gate.e_score_correction_bias"))
                load = torch.bincount(idx.flatten(), minlength=bias.numel()).to(bias.dtype)
                bias += BALANCE_RATE * torch.sign(load.mean() - load)
    assert len(chosen) == 4  # layers 1-4 are MoE
    return {name: param.detach().to(tensors[name].dtype) for name, param in params.items()}


def save_k3(folder, tensors: dict, text_config: dict, layout: str):
    """Write a K3 folder as a trainer would: `text` as exported (config.json the text config, `model.` names), or
    `multimodal` (the release's `kimi_k3` config with `text_config`, `language_model.` names: torchtitan's
    `titan_to_official` spelling)."""
    folder.mkdir()
    prefix, head = PREFIXES[layout]
    renamed = {head if name == "lm_head.weight" else prefix + name.removeprefix("model."): tensor.contiguous()
               for name, tensor in tensors.items()}
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    config = text_config if layout == "text" else {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text_config,
        **{name: text_config[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                                                "dtype")}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


LAYER0_PAIR = ("model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight")
"""Layer 0's pre-attention router (never read: no gradient)."""

K3_CASES = {"text": ("text", torch.float32, False), "release-names": ("multimodal", torch.float32, False),
            "bf16": ("text", torch.bfloat16, False), "layer-0-placeholders": ("multimodal", torch.float32, True)}
"""(layout written, dtype, whether the trainer writes layer 0's pair as placeholders, zeros and ones, as torchtitan's
development `KimiK3StateDictAdapter.to_hf` does: it drops the pair on reading)."""


@pytest.mark.parametrize("layout, dtype, placeholders", K3_CASES.values(), ids=K3_CASES.keys())
def test_training_in_the_k3_layout_comes_back_bit_for_bit(tmp_path, monkeypatch, layout, dtype, placeholders):
    k3_model().save_pretrained(tmp_path / "fp32")
    # a bf16 model keeps K3's fp32 tensors (A_log, dt_bias, convolutions, o_norm, the router) and the routers fp32
    AttnResForCausalLM.from_pretrained(tmp_path / "fp32", dtype=dtype).save_pretrained(tmp_path / "ours")
    assert main(["export", "--to", "k3-layout", str(tmp_path / "ours"), str(tmp_path / "k3")]) == 0
    text_config = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert text_config["attn_res_block_size"] == 2
    exported = folder_tensors(tmp_path / "k3")
    assert dtype in {t.dtype for t in exported.values()}
    trained = k3_train(exported, text_config, monkeypatch)
    if placeholders:
        proj, norm = LAYER0_PAIR
        trained[proj], trained[norm] = torch.zeros_like(trained[proj]), torch.ones_like(trained[norm])
    save_k3(tmp_path / "trained", trained, text_config, layout)
    assert main(["convert", str(tmp_path / "trained"), str(tmp_path / "back"), "--dtype", "auto"]) == 0

    backbone = AttnResConfig.from_pretrained(tmp_path / "back").backbone
    back = to_k3_state_dict(reimported(tmp_path / "back"), backbone, layout="text")
    assert_came_back(trained, back, exported, is_router=lambda name: "_res_" in name,
                     unchanged=set() if placeholders else set(LAYER0_PAIR))
    biases = [name for name in trained if name.endswith("e_score_correction_bias")]
    assert biases and not any(torch.equal(trained[name], exported[name]) for name in biases)

    back32 = AttnResForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative(back32(K3_IDS).logits, k3_reference_logits(trained, text_config, K3_IDS)) <= REL_TOL
