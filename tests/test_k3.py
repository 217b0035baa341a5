"""Kimi K3 checkpoints: `attnres convert` of K3's layout (the released multimodal folder and the text-only one),
checked against an independent float64 forward of K3's equations (`tests/k3_reference.py`, which imports neither
attnres_hf nor transformers' models), every K3 field, cached generation, MXFP4 experts, the exact round trip through
`attnres export --to k3-layout`, the refusals, `attnres info` and training on the imported model.

`tests/test_backbones_moe.py` already runs the `kimi_k3` backbone through the exact retrofit of every method, cached
generation, router logits, gradient checkpointing and save/reload; this file is about K3's own checkpoints.

Tolerances (measured on these tiny random models, fp32 model against the float64 reference): max |delta logits| is
1e-6 to 2e-4 of max |logits| over the configs, field flips and probe batches here and in `benchmarks/k3_interop.py`
(`docs/results/k3_interop.md`); a float64 load of the model is no closer (1e-5 to 7e-5), since the model computes its
norms, gates, router, KDA and depth mixing in fp32 whatever the dtype, and a token whose top-k experts nearly tie can
take another expert in fp32 than in float64. `REL_TOL` = 1e-3 of max |logits| is 5x the worst measured case; every
K3 field flip moves the logits by 0.69 of their scale or more, so `DIFFERENT` = 0.1 (100x `REL_TOL`) separates a field
that acts from one silently ignored.
"""

import copy
import json
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.cli import main
from attnres_hf.conversion import convert, export
from attnres_hf.conversion.k3_layout import backbone_from_k3
from attnres_hf.conversion.convert import open_source
from attnres_hf.modeling.backbones_k3 import KimiK3Config
from attnres_hf.training import prepare_model
from attnres_hf.training.recipes import is_router_parameter
from k3_reference import (DELETE, MXFP4_OVERRIDES, RELEASE_MLA_LATENT_NORM_EPS, compressed_tensors_mxfp4_encode,
                          k3_reference_depth_weights, k3_reference_logits, tiny_k3_text_config, write_k3_checkpoint)
from utils import tiny_model

k3_module = sys.modules["attnres_hf.conversion.k3_source"]  # the module, whose function `k3_source` shares its name

IDS = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(1))
"""The probe tokens (any in the vocabulary but the special ones)."""

REL_TOL = 1e-3
"""Max |delta logits| (fp32 model vs float64 reference) over max |reference logits|: see the module docstring."""

DIFFERENT = 0.1
"""A flipped K3 field must move the logits by at least this fraction of their scale (100x `REL_TOL`)."""

DEPTH_TOL = 1e-3
"""Max |delta| of depth weights (probabilities): measured at most 1.1e-4 (MXFP4 experts, docs/results/k3_interop.md),
a margin of 9."""


def relative(logits, reference) -> float:
    return float((logits.double() - reference).abs().max() / reference.abs().max())


def imported(folder) -> AttnResForCausalLM:
    """The model `convert` builds from a K3 folder, without writing it: the same calls in the same order (read and
    check the config, the options, every tensor's place and shape, then load in fp32)."""
    source = open_source(folder)
    overrides = source.overrides()
    source.check_tensors(overrides)
    return source.load_model(overrides, torch.float32).model.eval()


def logits_of(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def folder_state(folder) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `folder`."""
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            state |= {name: handle.get_tensor(name) for name in handle.keys()}
    return state


def text_config_of(folder) -> dict:
    fields = json.loads((folder / "config.json").read_text())
    return fields["text_config"] if fields.get("model_type") == "kimi_k3" else fields


@pytest.fixture(scope="module")
def k3_converted(tmp_path_factory):
    """The default tiny K3 checkpoint (multimodal layout, vision tensors, every K3 piece on, 5 layers in AttnRes
    blocks of 2: the last block partial), its written tensors, and `convert`'s output folder."""
    root = tmp_path_factory.mktemp("k3")
    state = write_k3_checkpoint(root / "k3", tiny_k3_text_config(), seed=0)
    report = convert(root / "k3", root / "out")
    return root / "k3", state, root / "out", report


# ---------------------------------------------------------------------------------------------------------------
# 1. The imported model computes K3's equations
# ---------------------------------------------------------------------------------------------------------------

CONFIGS = {
    "default": ({}, {}),
    "block-1": (dict(attn_res_block_size=1), {}),
    "block-3": (dict(attn_res_block_size=3), {}),
    "block-over-all-layers": (dict(attn_res_block_size=7), {}),
    "3-layers": (dict(num_hidden_layers=3, linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2])), {}),
    "6-layers": (dict(num_hidden_layers=6, linear_attn_config=dict(kda_layers=[1, 2, 4, 5], full_attn_layers=[3, 6])),
                 {}),
    "text-layout": ({}, dict(layout="text")),
    "bf16-weights": ({}, dict(dtype=torch.bfloat16)),
    "no-attnres": (dict(attn_res_block_size=DELETE), {}),  # K3's architecture, plain residuals: a retrofit
}


@pytest.mark.parametrize("overrides, writer", CONFIGS.values(), ids=CONFIGS.keys())
def test_imported_k3_equals_the_reference(tmp_path, overrides, writer):
    """The model read from a K3 folder (fp32) gives the float64 reference's logits on the stored values (bf16 ones
    for bf16 weights), for block sizes 1, 3 and one past the last layer, 3 and 6 layers, both layouts, and K3
    without AttnRes (converted as a retrofit of its residual model)."""
    cfg = tiny_k3_text_config(**overrides)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, **writer)
    reference = k3_reference_logits(state, cfg, IDS)
    assert relative(logits_of(imported(tmp_path / "k3")), reference) <= REL_TOL


def test_converted_folder_equals_the_reference(k3_converted):
    """`convert`'s written folder, loaded back, gives the reference's logits; its report says the routers were
    imported with K3's block size (2 x attn_res_block_size sub-layers) and the plain mean."""
    _, state, out, report = k3_converted
    model = AttnResForCausalLM.from_pretrained(out).eval()
    assert relative(logits_of(model), k3_reference_logits(state, tiny_k3_text_config(), IDS)) <= REL_TOL
    assert report["source"]["format"] == "k3" and report["source"]["layout"] == "multimodal"
    assert report["source"]["name"] == str(k3_converted[0]) and report["source"]["model_type"] == "kimi_k3"
    assert report["source"]["imported_routers"] and not report["source"]["mxfp4_experts"]
    assert report["config"] == {"depth_mixing": "attnres", "attnres_block_size": 4, "num_attnres_blocks": 3,
                                "num_sublayers": 10, "attnres_rescale_output": False}
    assert report["verification"]["tensors_identical"] and not report["verification"]["tensors_not_written_back"]


@pytest.mark.parametrize("block", [2, 1, 3])
def test_depth_weights_equal_the_reference_read_for_read(tmp_path, k3_converted, block):
    """`output_depth_weights=True` gives one weight vector per router in depth order (layers.0.attn_res,
    layers.0.mlp_res, ..., final_res); K3 has no read before layer 0's attention (one source, weight 1), so ours
    minus that first one are the reference's reads, in order and source for source ([sealed blocks..., partial])."""
    cfg = tiny_k3_text_config(attn_res_block_size=block)
    if block == 2:
        _, state, out, _ = k3_converted
        model = AttnResForCausalLM.from_pretrained(out).eval()
    else:
        state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0)
        model = imported(tmp_path / "k3")
    with torch.no_grad():
        ours = model(IDS, output_depth_weights=True).depth_weights
    reads = k3_reference_depth_weights(state, cfg, IDS)
    assert [kind for kind, _, _ in reads] == ["mlp"] + ["attn", "mlp"] * 4 + ["final"]
    assert len(ours) == len(reads) + 1
    assert ours[0].shape == (*IDS.shape, 1) and torch.equal(ours[0], torch.ones_like(ours[0]))
    for mine, (kind, layer, theirs) in zip(ours[1:], reads):
        assert mine.shape == theirs.shape, (kind, layer)
        assert float((mine.double() - theirs).abs().max()) <= DEPTH_TOL, (kind, layer)


@pytest.mark.parametrize("eps", [1e-5, 0.1, 1.0])
def test_mla_latent_norms_run_at_the_releases_eps_whatever_rms_norm_eps_says(tmp_path, eps):
    """K3's released code builds MLA's latent norms (`q_a_layernorm`, `kv_a_layernorm`) at 1e-6 whatever
    `rms_norm_eps` says (`RELEASE_MLA_LATENT_NORM_EPS`); torchtitan's `kimi_k3` builds them at `rms_norm_eps`. The
    imported model equals the reference with the release's eps at every `rms_norm_eps` (the other norms follow it), and
    at 0.1 and 1.0 the reference with torchtitan's choice is far from it (measured 0.64 and 0.17 of max |logits|; at
    the release's 1e-5 the two are 2e-5 apart, under any tolerance here)."""
    cfg = tiny_k3_text_config(rms_norm_eps=eps)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0)
    logits = logits_of(imported(tmp_path / "k3"))
    assert relative(logits, k3_reference_logits(state, cfg, IDS)) <= REL_TOL
    assert RELEASE_MLA_LATENT_NORM_EPS == 1e-6  # the reference's default is the release's
    if eps >= 0.1:
        assert relative(logits, k3_reference_logits(state, cfg, IDS, mla_latent_norm_eps=None)) >= DIFFERENT


# ---------------------------------------------------------------------------------------------------------------
# 2. Every field K3 adds is read, not ignored
# ---------------------------------------------------------------------------------------------------------------

NO_LATENT_NORM = dict(latent_moe_use_norm=False)
# The latent RMSNorm divides out any per-token factor of the experts' weighted sum (routed_scaling_factor, the
# renormalisation): those two are flipped on a base without it, where they act.
FLIPS = {
    "hidden_act-silu": ({}, dict(hidden_act="silu")),
    "activation_situ_beta": ({}, dict(activation_situ_beta=2.0)),
    "activation_situ_beta-None": ({}, dict(activation_situ_beta=None)),
    "activation_situ_linear_beta": ({}, dict(activation_situ_linear_beta=5.0)),
    "activation_situ_linear_beta-None": (dict(activation_situ_linear_beta=5.0), dict(activation_situ_linear_beta=None)),
    "routed_expert_hidden_size-absent": ({}, dict(routed_expert_hidden_size=DELETE)),
    "routed_expert_hidden_size-None": ({}, dict(routed_expert_hidden_size=None)),
    "latent_moe_use_norm": ({}, dict(latent_moe_use_norm=False)),
    "mla_use_output_gate": ({}, dict(mla_use_output_gate=False)),
    "use_full_rank_gate": ({}, dict(linear_attn_config=dict(use_full_rank_gate=False))),
    "gate_lower_bound-None": ({}, dict(linear_attn_config=dict(gate_lower_bound=None))),
    "gate_lower_bound": ({}, dict(linear_attn_config=dict(gate_lower_bound=-2.0))),
    "num_shared_experts-0": ({}, dict(num_shared_experts=0)),
    "num_shared_experts-1": ({}, dict(num_shared_experts=1)),
    "routed_scaling_factor": (NO_LATENT_NORM, NO_LATENT_NORM | dict(routed_scaling_factor=1.0)),
    "moe_renormalize": (NO_LATENT_NORM, NO_LATENT_NORM | dict(moe_renormalize=False)),
    "num_expert_group-1": ({}, dict(num_expert_group=1, topk_group=1)),
    "num_expert_group-4": ({}, dict(num_expert_group=4, topk_group=2)),
    "first_k_dense_replace-0": ({}, dict(first_k_dense_replace=0)),
    "first_k_dense_replace-2": ({}, dict(first_k_dense_replace=2)),
}


@pytest.mark.parametrize("base, flipped", FLIPS.values(), ids=FLIPS.keys())
def test_every_k3_field_changes_the_model_as_k3_computes_it(tmp_path, base, flipped):
    """Flipping a K3 field (the same seed: the same weights where the shapes stay) moves the logits by a clear
    margin, and the imported model still equals the reference of the flipped config: none is silently ignored."""
    base_cfg, cfg = tiny_k3_text_config(**base), tiny_k3_text_config(**flipped)
    base_state = write_k3_checkpoint(tmp_path / "base", base_cfg, seed=0)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0)
    logits = logits_of(imported(tmp_path / "k3"))
    assert relative(logits, k3_reference_logits(base_state, base_cfg, IDS)) >= DIFFERENT
    assert relative(logits, k3_reference_logits(state, cfg, IDS)) <= REL_TOL


# ---------------------------------------------------------------------------------------------------------------
# 3. Generation with K3's hybrid cache
# ---------------------------------------------------------------------------------------------------------------

def test_cached_generation_of_the_converted_model_equals_full_recompute(k3_converted):
    """Prefill + one-token steps (KDA's recurrent state, MLA's cache) give the full forward's logits, and greedy
    `generate` with the cache gives the tokens of a full recompute at every step. Measured: 1.1e-6 of max |logits|
    (KDA's chunked and recurrent forms), bounded by REL_TOL."""
    model = AttnResForCausalLM.from_pretrained(k3_converted[2]).eval()
    with torch.no_grad():
        full = model(IDS).logits
        prefill = model(IDS[:, :8], use_cache=True)
        cache, steps = prefill.cache, [prefill.logits]
        for i in range(8, IDS.shape[1]):
            out = model(IDS[:, i:i + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
        assert cache.get_seq_length() == IDS.shape[1]
        assert relative(torch.cat(steps, 1), full.double()) <= REL_TOL
        greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
        cached = model.generate(IDS[:1], **greedy)
        recomputed = IDS[:1]
        for _ in range(6):
            recomputed = torch.cat([recomputed, model(recomputed).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(cached, recomputed)


# ---------------------------------------------------------------------------------------------------------------
# 4. The exact round trip K3 -> attnres -> K3
# ---------------------------------------------------------------------------------------------------------------

def _text_name(name: str) -> str:
    """A multimodal checkpoint's text tensor under the text layout's name (`model.*`, `lm_head.weight`)."""
    return name.removeprefix("language_model.")


def _round_trip(folder, state, out, tmp_path):
    assert main(["export", "--to", "k3-layout", str(out), str(tmp_path / "back")]) == 0
    back = folder_state(tmp_path / "back")
    text = {_text_name(n): t for n, t in state.items() if not n.startswith(("vision_tower.", "mm_projector."))}
    assert sorted(back) == sorted(text)
    for name, tensor in text.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    for inert in ("model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"):
        assert inert in back  # layer 0's inert attention router survives
    config, original = json.loads((tmp_path / "back" / "config.json").read_text()), text_config_of(folder)
    assert {k: v for k, v in config.items() if k != "dtype"} == {k: v for k, v in original.items() if k != "dtype"}
    report = json.loads((tmp_path / "back" / "export_report.json").read_text())
    assert report["verification"]["tensors_identical"]
    convert(tmp_path / "back", tmp_path / "again")
    first = AttnResForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    again = AttnResForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    assert torch.equal(logits_of(again), logits_of(first))  # the same tensors, the same code
    assert config["dtype"] == original["dtype"]  # the checkpoint's dtype, as `from_pretrained(dtype="auto")` reads it


def test_round_trip_through_the_k3_layout_is_exact(k3_converted, tmp_path):
    """convert (multimodal) -> export --to k3-layout gives every text tensor back, value and dtype, under the text
    layout's names; config.json is the original text config; converting the export again gives identical logits."""
    folder, state, out, _ = k3_converted
    _round_trip(folder, state, out, tmp_path)


def test_round_trip_through_the_k3_layout_is_exact_in_bf16(tmp_path):
    """The same with bf16 weights (K3's fp32 tensors, A_log, dt_bias, convolutions, KDA's output norm and the
    score-correction bias, stay fp32), converted with `dtype="auto"`: the export is the original, its config's
    `dtype` included."""
    cfg = tiny_k3_text_config(dtype="bfloat16")
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, dtype=torch.bfloat16)
    report = convert(tmp_path / "k3", tmp_path / "out", dtype="auto")
    assert report["dtype"] == "bfloat16"
    _round_trip(tmp_path / "k3", state, tmp_path / "out", tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# 5. MXFP4 experts
# ---------------------------------------------------------------------------------------------------------------

def test_mxfp4_experts_convert_exactly(tmp_path):
    """K3's MXFP4 routed experts (compressed-tensors' mxfp4-pack-quantized) dequantise by compressed-tensors to the
    fixture's own decoding exactly (every MXFP4 value is an fp32 value), and the model equals the reference."""
    pytest.importorskip("compressed_tensors")
    cfg = tiny_k3_text_config(**MXFP4_OVERRIDES)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, mxfp4_experts=True)
    report = convert(tmp_path / "k3", tmp_path / "out")
    assert report["source"]["mxfp4_experts"]
    model = AttnResForCausalLM.from_pretrained(tmp_path / "out").eval()
    weights = model.state_dict()
    layers = [i for i in range(cfg["num_hidden_layers"]) if i >= cfg["first_k_dense_replace"]]
    for i in layers:
        base = f"model.layers.{i}.mlp.experts."
        gate_up, down = weights[base + "gate_up_proj"], weights[base + "down_proj"]
        for e in range(cfg["num_experts"]):
            expert = f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}."
            assert torch.equal(gate_up[e], torch.cat([state[expert + "w1.weight"], state[expert + "w3.weight"]]))
            assert torch.equal(down[e], state[expert + "w2.weight"])
    assert relative(logits_of(model), k3_reference_logits(state, cfg, IDS)) <= REL_TOL


def test_mxfp4_experts_import_as_the_reference(tmp_path):
    """The fast form of the check above: the imported MXFP4 model equals the reference (experts decoded by the
    fixture's own MXFP4 decoder there, by compressed-tensors here)."""
    pytest.importorskip("compressed_tensors")
    cfg = tiny_k3_text_config(**MXFP4_OVERRIDES)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, mxfp4_experts=True)
    assert relative(logits_of(imported(tmp_path / "k3")), k3_reference_logits(state, cfg, IDS)) <= REL_TOL


def _refused(tmp_path, capsys, argv, match):
    """`attnres ARGV` exits 2 with one line naming `match` on stderr, and writes nothing."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnres ") and match in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_mxfp4_without_compressed_tensors_names_the_extra(tmp_path, capsys, monkeypatch):
    """Without compressed-tensors an MXFP4 checkpoint is refused naming `attnres-hf[k3]`, nothing written."""
    import importlib.util

    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(**MXFP4_OVERRIDES), seed=0, mxfp4_experts=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "compressed_tensors" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r'pip install "attnres-hf\[k3\]"'):
        convert(tmp_path / "k3", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out")],
             'pip install "attnres-hf[k3]"')


@pytest.fixture(scope="module")
def k3_mxfp4_converted(tmp_path_factory):
    """A bf16 K3 release in miniature (multimodal, vision tensors) whose MXFP4 experts compressed-tensors made from
    bf16 weights, as a release is made (`compressed_tensors_mxfp4_encode`), and `convert`'s output (`dtype="auto"`:
    every stored dtype kept)."""
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("k3-mxfp4")
    write_k3_checkpoint(root / "k3", tiny_k3_text_config(**MXFP4_OVERRIDES, dtype="bfloat16"), seed=0,
                        dtype=torch.bfloat16, mxfp4_experts=True, mxfp4_encoder=compressed_tensors_mxfp4_encode)
    report = convert(root / "k3", root / "out", dtype="auto")
    assert report["source"]["mxfp4_experts"] and report["source"]["k3_quantization_config"]
    return root / "k3", root / "out"


def _assert_bytes_back(folder, back):
    """Every text tensor of the K3 checkpoint `folder` is in `back` under the text layout's name with its dtype and
    bytes (MXFP4 `weight_packed` / `weight_scale` included), and `back` holds no other."""
    original = {_text_name(n): t for n, t in folder_state(folder).items()
                if not n.startswith(("vision_tower.", "mm_projector."))}
    written = folder_state(back)
    assert sorted(written) == sorted(original)
    assert sum(name.endswith("weight_packed") for name in written) > 0
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name].view(torch.uint8),
                                                                   tensor.view(torch.uint8)), name


def test_mxfp4_experts_export_back_byte_for_byte(k3_mxfp4_converted, tmp_path, capsys):
    """convert -> export --to k3-layout, in memory and streamed: every tensor of the checkpoint back byte for byte,
    MXFP4 experts as compressed-tensors' `weight_packed` / `weight_scale` again, under the text config (its
    `quantization_config` as the checkpoint declares it), read back by the import's reader (the export's check)."""
    folder, out = k3_mxfp4_converted
    report = export(out, tmp_path / "memory", to="k3-layout", stream=False)
    assert report["experts"]["format"] == "mxfp4" and report["verification"]["tensors_identical"]
    capsys.readouterr()
    assert main(["export", "--to", "k3-layout", str(out), str(tmp_path / "streamed"), "--stream"]) == 0
    assert "routed experts: mxfp4 (imported from MXFP4 experts" in capsys.readouterr().out
    for back in ("memory", "streamed"):
        _assert_bytes_back(folder, tmp_path / back)
        config, original = json.loads((tmp_path / back / "config.json").read_text()), text_config_of(folder)
        assert config == original and config["quantization_config"] == json.loads(
            (folder / "config.json").read_text())["quantization_config"]


def test_a_fine_tuned_mxfp4_expert_is_refused_by_name_or_exported_unquantized(k3_mxfp4_converted, tmp_path, capsys):
    """An expert that is no longer MXFP4 (fine-tuned after the import) is refused in one line naming the tensor and
    `--experts unquantized`, in memory and streamed, nothing written; `--experts unquantized` writes every expert as
    `.weight` (values and dtype unchanged) with no `quantization_config`; `--experts mxfp4` of a model not imported
    from MXFP4, or `experts` for fla, is refused before anything is read."""
    folder, out = k3_mxfp4_converted
    model = AttnResForCausalLM.from_pretrained(out, dtype="auto")
    with torch.no_grad():
        model.model.layers[2].mlp.experts.down_proj[3, 5, 7] += 1e-3
    model.save_pretrained(tmp_path / "tuned")
    shutil.copy(out / "conversion_report.json", tmp_path / "tuned")
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    for stream in ("--no-stream", "--stream"):
        _refused(tmp_path, capsys, ["export", "--to", "k3-layout", str(tmp_path / "tuned"), str(tmp_path / "out"),
                                    stream], f"{name} is not MXFP4: 1 of its")
    with pytest.raises(ValueError, match=f"^{name} is not MXFP4: .* --experts unquantized"):
        export(tmp_path / "tuned", tmp_path / "out", to="k3-layout", stream=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    report = export(tmp_path / "tuned", tmp_path / "plain", to="k3-layout", experts="unquantized")
    assert report["experts"]["format"] == "unquantized" and report["verification"]["tensors_identical"]
    written, tuned = folder_state(tmp_path / "plain"), model.state_dict()
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in written)
    assert torch.equal(written[name], tuned["model.layers.2.mlp.experts.down_proj"][3])
    assert written[name].dtype == torch.bfloat16
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    recorded = json.loads((out / "conversion_report.json").read_text())  # as a report written before the record
    del recorded["source"]["k3_quantization_config"], recorded["source"]["k3_text_config"]["quantization_config"]
    (tmp_path / "tuned" / "conversion_report.json").write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match="records no quantization_config"):
        export(tmp_path / "tuned", tmp_path / "x", to="k3-layout", experts="mxfp4")
    (tmp_path / "tuned" / "conversion_report.json").unlink()  # no record of the experts' MXFP4 source
    with pytest.raises(ValueError, match="not imported from MXFP4 experts"):
        export(tmp_path / "tuned", tmp_path / "x", to="k3-layout", experts="mxfp4")
    with pytest.raises(ValueError, match="only for to='k3-layout'"):
        export(out, tmp_path / "x", to="fla", experts="mxfp4")
    with pytest.raises(ValueError, match="experts must be one of mxfp4, unquantized"):
        export(out, tmp_path / "x", to="k3-layout", experts="bf16")


@pytest.mark.parametrize("declared, match", [
    ({"quant_method": "fp8", "fmt": "e4m3"}, "is not compressed-tensors' mxfp4-pack-quantized"),
    ("group_size 16", "group_size 16"), ([1], "must be an object"), ("groups [1]", "config_groups must be an object")])
def test_a_recorded_quantization_config_that_is_not_k3s_mxfp4_is_refused_before_writing(k3_mxfp4_converted, tmp_path,
                                                                                         declared, match):
    """conversion_report.json's recorded quantization_config (edited: another format, MXFP4 in other blocks than
    the 32 the experts are encoded in, not an object) is refused in one line naming that file before anything is
    encoded or written: not written under it (a config that misdescribes the experts) nor refused from the staging
    folder's name."""
    folder, out = k3_mxfp4_converted
    shutil.copytree(out, tmp_path / "model")
    recorded = json.loads((out / "conversion_report.json").read_text())
    if declared == "group_size 16":
        declared = copy.deepcopy(recorded["source"]["k3_quantization_config"])
        declared["config_groups"]["group_0"]["weights"]["group_size"] = 16
    elif declared == "groups [1]":
        declared = recorded["source"]["k3_quantization_config"] | {"config_groups": [1]}
    recorded["source"]["k3_quantization_config"] = recorded["source"]["k3_text_config"]["quantization_config"] = declared
    (tmp_path / "model" / "conversion_report.json").write_text(json.dumps(recorded))
    for stream in (False, True):
        with pytest.raises(ValueError, match=f"^{tmp_path / 'model' / 'conversion_report.json'}: .*{match}") as error:
            export(tmp_path / "model", tmp_path / "out", to="k3-layout", stream=stream)
        assert "\n" not in str(error.value) and ".tmp-" not in str(error.value)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_mxfp4_blocks_values_cannot_tell_decode_to_the_same_values():
    """`encode_mxfp4` of decoded MXFP4: compressed-tensors' own blocks (made from bf16 weights, -0 codes included)
    come back byte for byte; a block whose scale is larger than compressed-tensors picks for its values (all zero
    under a scale other than its own, every code at most 3) comes back with compressed-tensors' scale, decoding to the
    same values bit for bit; a value off the MXFP4 grid is refused."""
    pytest.importorskip("compressed_tensors")
    from attnres_hf.conversion.mxfp4 import decode_mxfp4, encode_mxfp4

    weight = 0.02 * torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    packed, scale = compressed_tensors_mxfp4_encode(weight)
    assert (packed & 0x0F == 8).any()  # a -0 code (a weight that rounded to zero from below)
    again = encode_mxfp4(decode_mxfp4(packed, scale), "w")
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)
    odd = packed.clone(), scale.clone()
    odd[0][0, :16], odd[1][0, 0] = 0, 120  # an all-zero block under scale 2^-7
    odd[0][1, :16], odd[1][1, 0] = 0x32, 125  # codes 2 (1.0) and 3 (1.5) only, under 2^-2
    values = decode_mxfp4(*odd)
    back = encode_mxfp4(values, "w")
    assert torch.equal(decode_mxfp4(*back).view(torch.int16), values.view(torch.int16))
    assert back[1][0, 0] != 120 and back[1][1, 0] == 123  # compressed-tensors' scale: the same values, other bytes
    assert torch.equal(back[0][2:], packed[2:]) and torch.equal(back[1][2:], scale[2:])
    with pytest.raises(ValueError, match=r"^w is not MXFP4: 1 of its 2048 values"):
        encode_mxfp4(values + torch.nn.functional.one_hot(torch.tensor(40), 2048).reshape(16, 128) * 1e-3, "w")


# ---------------------------------------------------------------------------------------------------------------
# 6. Bad input: one line, before anything loads, nothing written
# ---------------------------------------------------------------------------------------------------------------

def _edit_config(folder, text=None, top=None):
    """Change config.json: `text` in the text config, `top` at the top level (`DELETE` removes a key)."""
    fields = json.loads((folder / "config.json").read_text())
    for target, changes in ((fields.get("text_config", fields), text), (fields, top)):
        for key, value in (changes or {}).items():
            if value is DELETE:
                target.pop(key, None)
            elif key == "linear_attn_config":
                target[key] |= value
            else:
                target[key] = value
    (folder / "config.json").write_text(json.dumps(fields))


def _edit_tensors(folder, drop=(), change=None, add=None):
    """Drop tensors from, replace tensors in, or add tensors to (`add`, into the last shard) the shards (the index
    kept consistent)."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for file in sorted(set(index["weight_map"].values())):
        path = folder / file
        with safe_open(path, "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        tensors = {name: (change or {}).get(name, tensor) for name, tensor in tensors.items() if name not in drop}
        if add and file == sorted(set(index["weight_map"].values()))[-1]:
            tensors |= add
            index["weight_map"] |= dict.fromkeys(add, file)
        save_file(tensors, path, metadata={"format": "pt"})
    index["weight_map"] = {name: file for name, file in index["weight_map"].items() if name not in drop}
    index_file.write_text(json.dumps(index))


def _truncate(folder):
    path = folder / "model-00002-of-00002.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _non_zero_a_log_padding(folder):
    name = "language_model.model.layers.0.self_attn.A_log"
    with safe_open(folder / "model-00001-of-00002.safetensors", "pt") as handle:
        a_log = handle.get_tensor(name).clone()
    a_log[-1] = 0.5
    _edit_tensors(folder, change={name: a_log})


EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.3."
BAD_INPUT = {
    "unknown-field": (lambda f: _edit_config(f, text={"use_mtp_router": True}),
                      "use_mtp_router (not a field of K3's text model attnres-hf knows)"),
    "block-size-0": (lambda f: _edit_config(f, text={"attn_res_block_size": 0}),
                     "attn_res_block_size must be a positive number of decoder layers, got 0"),
    "block-size-negative": (lambda f: _edit_config(f, text={"attn_res_block_size": -1}), "got -1"),
    "block-size-string": (lambda f: _edit_config(f, text={"attn_res_block_size": "2"}), "got '2'"),
    "block-size-bool": (lambda f: _edit_config(f, text={"attn_res_block_size": True}), "got True"),
    "attnres-tensors-without-block-size": (lambda f: _edit_config(f, text={"attn_res_block_size": DELETE}),
                                           "AttnRes tensors, but the config has no attn_res_block_size"),
    "no-text-config": (lambda f: _edit_config(f, top={"text_config": DELETE}), "without a text_config object"),
    "topk_method": (lambda f: _edit_config(f, text={"topk_method": "greedy"}), "topk_method='greedy'"),
    "nextn-layers": (lambda f: _edit_config(f, text={"num_nextn_predict_layers": 1}), "num_nextn_predict_layers=1"),
    "rotary-mla": (lambda f: _edit_config(f, text={"mla_use_nope": False}), "mla_use_nope=False"),
    "linear_attn_config-key": (lambda f: _edit_config(f, text={"linear_attn_config": {"gate_upper_bound": 1.0}}),
                               "linear_attn_config has keys kimi_k3 does not implement: gate_upper_bound"),
    "missing-expert": (lambda f: _edit_tensors(f, drop=[EXPERT + "w2.weight"]), "incomplete: missing 3.w2"),
    "truncated-shard": (_truncate, "truncated or corrupt"),
    "expert-groups-not-dividing": (lambda f: _edit_config(f, text={"num_expert_group": 3}),
                                   "num_expert_group (3) must divide num_experts (8)"),
    "topk-group-over-groups": (lambda f: _edit_config(f, text={"topk_group": 3}),
                               "topk_group must be between 1 and num_expert_group (2), got 3"),
    "no-expert-chosen": (lambda f: _edit_config(f, text={"num_experts_per_token": 0}),
                         "num_experts_per_token must be between 1"),
    "layer-list-past-the-last-layer": (lambda f: _edit_config(f, text={"linear_attn_config": {"kda_layers": [1, 3, 6]}}),
                                       "must name each of the 5 layers once"),
    "layer-in-both-lists": (lambda f: _edit_config(f, text={"linear_attn_config": {"kda_layers": [1, 2, 3, 4]}}),
                            "must name each of the 5 layers once"),
    "wrong-typed-float": (lambda f: _edit_config(f, text={"activation_situ_beta": "4"}),
                          "activation_situ_beta"),
    "mtp-like-layer-tensors": (lambda f: _edit_tensors(f, change={}, add={
        "language_model.model.layers.5.input_layernorm.weight": torch.ones(32)}),
        "tensors the model config.json builds does not have (attnres-hf names): model.layers.5.input_layernorm"),
    "pad-past-the-vocabulary": (lambda f: _edit_config(f, text={"pad_token_id": 96}),
                                "pad_token_id=96 is not a token of the vocabulary (vocab_size 96)"),
    "negative-bos": (lambda f: _edit_config(f, text={"bos_token_id": -1}), "bos_token_id=-1 is not a token"),
    "eos-list-past-the-vocabulary": (lambda f: _edit_config(f, text={"eos_token_id": [2, 200]}),
                                     "eos_token_id=[2, 200] is not a token of the vocabulary"),
    "release-top-level-pad-past-a-tiny-vocabulary": (
        lambda f: _edit_config(f, text={"pad_token_id": DELETE}, top={"pad_token_id": 163839}),
        "pad_token_id=163839 is not a token of the vocabulary (vocab_size 96)"),
    "no-kv_lora_rank": (lambda f: _edit_config(f, text={"kv_lora_rank": DELETE}),
                        "kv_lora_rank (absent, and K3's config class has no usable default for it)"),
    "no-linear_attn_config": (lambda f: _edit_config(f, text={"linear_attn_config": DELETE}),
                              "linear_attn_config (absent, and K3's config class has no usable default for it)"),
    "no-num_experts": (lambda f: _edit_config(f, text={"num_experts": DELETE}), "num_experts (absent"),
    "no-mla_use_nope": (lambda f: _edit_config(f, text={"mla_use_nope": DELETE}), "mla_use_nope=False"),
    "rope-with-rotary-mla": (lambda f: _edit_config(f, text={"mla_use_nope": False, "rope_theta": 1e4}),
                             "mla_use_nope=False"),
    "other-quantization": (lambda f: _edit_config(f, top={"quantization_config": {"quant_method": "fp8",
                                                                                  "fmt": "e4m3"}}),
                           "quantization_config is not compressed-tensors' mxfp4-pack-quantized"),
}


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model is built off the meta device or (`reads=True` aside) a tensor's data is read."""
    def patch(reads=False):
        def loaded(*args, **kwargs):
            raise AssertionError("the refusal came after loading")

        def built(self, *args, _init=PreTrainedModel.__init__, **kwargs):  # any model but a meta-device one (shapes)
            if torch.get_default_device().type != "meta":
                loaded()
            _init(self, *args, **kwargs)

        monkeypatch.setattr(PreTrainedModel, "__init__", built)
        if not reads:
            monkeypatch.setattr(k3_module, "read_k3_tensors", loaded)
    return patch


def test_the_no_loading_guard_catches_a_load(tmp_path, no_loading):
    """The guard of the refusal tests fails a conversion that reads tensors or builds a model."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0)
    no_loading()
    with pytest.raises(AssertionError, match="after loading"):
        convert(tmp_path / "k3", tmp_path / "out")


@pytest.mark.parametrize("edit, match", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_k3_folders_are_one_line_refusals(tmp_path, capsys, no_loading, edit, match):
    """Each problem is one line from `attnres convert` (exit 2) naming it, before any tensor's data is read or any
    model built, with nothing written; `convert` raises it as a ValueError (UnsupportedSourceError is one)."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0)
    edit(tmp_path / "k3")
    no_loading()
    with pytest.raises(ValueError, match=None) as error:
        convert(tmp_path / "k3", tmp_path / "out")
    assert match in str(error.value) and "\n" not in str(error.value)
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out")], match)


def test_a_non_zero_a_log_padding_is_refused_before_the_model_is_built(tmp_path, capsys, no_loading):
    """K3 pads A_log with zeros past its heads: a non-zero entry there (a value, so read, not a header) is refused
    before any model is built, nothing written."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0)
    _non_zero_a_log_padding(tmp_path / "k3")
    no_loading(reads=True)
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out")],
             "language_model.model.layers.0.self_attn.A_log has non-zero entries past its 2 heads")


@pytest.mark.parametrize("damage, match", [
    (lambda f: _edit_tensors(f, drop=[EXPERT + "w1.weight_scale"]), "without their other half"),
    (lambda f: _edit_config(f, text={"quantization_config": DELETE}, top={"quantization_config": DELETE}),
     "no quantization_config declares them"),
    (lambda f: _edit_config(f, text={"quantization_config": DELETE}, top={"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}), "nvfp4-pack-quantized"),
    (lambda f: _edit_config(f, text={"quantization_config": DELETE}, top={"quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized", "weights": {"group_size": 16, "num_bits": 4, "type": "float"}}}}}),
     "MXFP4 other than K3's experts' (group_size 16;"),
], ids=["packed-without-scale", "undeclared", "nvfp4", "mxfp4-group-16"])
def test_bad_mxfp4_checkpoints_are_refused(tmp_path, capsys, no_loading, damage, match):
    """An MXFP4 packed tensor without its scale, packed tensors no quantization_config declares, or another
    compressed-tensors format, or MXFP4 in other blocks than K3's 32-input ones: one line before loading, nothing
    written."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(**MXFP4_OVERRIDES), seed=0, mxfp4_experts=True)
    damage(tmp_path / "k3")
    no_loading()
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out")], match)


@pytest.mark.parametrize("argv, match", [
    (["--block-size", "2"], "attnres_block_size=2 (the checkpoint's is 4)"),
    (["--block-size", "6"], "attnres_block_size=6 (the checkpoint's is 4)"),
    (["--full"], "attnres_block_size=1 (the checkpoint's is 4)"),
    (["--depth-mixing", "denseformer"], "depth_mixing='denseformer' (the checkpoint's is 'attnres')"),
    (["--depth-mixing", "residual"], "depth_mixing='residual' (the checkpoint's is 'attnres')"),
])
def test_options_that_would_change_an_imported_k3_model_are_refused(tmp_path, capsys, no_loading, argv, match):
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0)
    no_loading()
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out"), *argv], match)


def test_python_overrides_that_would_change_an_imported_k3_model_are_refused(tmp_path, no_loading):
    """The same from Python, the rescaled mean and a block size given as `attnres_block_size` included; the
    checkpoint's own values are accepted."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0)
    no_loading()
    refused = ((dict(attnres_rescale_output=True), "attnres_rescale_output=True (the checkpoint's is False)"),
               (dict(attnres_block_size=8), "attnres_block_size=8 (the checkpoint's is 4)"),
               (dict(depth_mixing="mhc"), "depth_mixing='mhc'"))
    for overrides, match in refused:
        with pytest.raises(ValueError, match=None) as error:
            convert(tmp_path / "k3", tmp_path / "out", **overrides)
        assert match in str(error.value)
        assert not (tmp_path / "out").exists()
    source = open_source(tmp_path / "k3")
    assert source.overrides(attnres_block_size=4, attnres_rescale_output=False, depth_mixing="attnres") == \
        {"depth_mixing": "attnres", "attnres_block_size": 4, "attnres_rescale_output": False}


def test_cli_converts_a_k3_folder(tmp_path, capsys):
    """`attnres convert` on a K3 AttnRes folder succeeds and says what it checked (the mapping, tensor for tensor:
    no K3 runtime runs here)."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0)
    assert main(["convert", str(tmp_path / "k3"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    out = capsys.readouterr().out
    assert "K3 tensors written back identical: True" in out and f"wrote {tmp_path / 'out'}" in out


# ---------------------------------------------------------------------------------------------------------------
# 7. `attnres info`: layer 0's attention router
# ---------------------------------------------------------------------------------------------------------------

def test_layer0_attention_router_is_inert_kept_and_reported(k3_converted, capsys):
    """K3 stores layer 0's `self_attention_res_*` pair; its router reads one source (the embedding), so it never
    acts: imported as stored, changing it changes nothing, and `attnres info` says so."""
    _, state, out, _ = k3_converted
    model = AttnResForCausalLM.from_pretrained(out).eval()
    router = model.model.layers[0].attn_res
    stored = state["language_model.model.layers.0.self_attention_res_proj.weight"]
    assert torch.equal(router.query, stored.reshape(-1))
    assert torch.equal(router.key_norm.weight, state["language_model.model.layers.0.self_attention_res_norm.weight"])
    before = logits_of(model)
    with torch.no_grad():
        router.query.mul_(-7)
        router.key_norm.weight.add_(3)
    assert torch.equal(logits_of(model), before)
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "inert               layer 0's attn_res" in text and "backbone            kimi_k3" in text
    assert "block size          4 sub-layers (Block AttnRes, 3 blocks, the last of 2)" in text


# ---------------------------------------------------------------------------------------------------------------
# 8. Training the imported model
# ---------------------------------------------------------------------------------------------------------------

def _train_steps(model, steps=2, lr=1e-2):
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return losses, parameters


def test_router_training_on_the_imported_k3_model(k3_converted):
    """`prepare_model(..., "routers")` trains only K3's imported pseudo-queries and key norms: the loss is finite,
    every `attn_res.query` but layer 0's (inert) gets a gradient and moves, nothing else does."""
    model = AttnResForCausalLM.from_pretrained(k3_converted[2])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model = prepare_model(model, "routers")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in before if is_router_parameter(n)}
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss)
    queries = {n: p for n, p in model.named_parameters() if n.endswith("attn_res.query")}
    assert len(queries) == 5
    for name, param in queries.items():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert (param.grad.count_nonzero() == 0) == (name == "model.layers.0.attn_res.query"), name
    model.zero_grad()
    losses, _ = _train_steps(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(is_router_parameter(n) for n in changed)
    assert "model.layers.1.attn_res.query" in changed and "model.final_res.query" in changed


def test_lora_training_on_the_imported_k3_model(k3_converted):
    """`prepare_model(..., "lora")` on the K3 model: adapters on its linear layers (KDA, MLA, MoE projections) and
    the routers train; two steps, finite loss, the adapters' B matrices leave zero."""
    torch.manual_seed(0)
    model = prepare_model(AttnResForCausalLM.from_pretrained(k3_converted[2]), "lora", lora_r=4)
    losses, _ = _train_steps(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.count_nonzero() > 0 for p in lora_b.values())
    for module in ("forget_gate.f_a_proj", "self_attn.g_proj", "kv_b_proj", "routed_expert_down_proj",
                   "shared_experts.up_proj"):  # KDA, MLA, latent MoE and shared experts
        assert any(f"{module}.lora_B" in n for n in lora_b), module
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.endswith("mlp_res.query") or ".mlp_res.modules_to_save" in n for n in trainable), sorted(trainable)


# ---------------------------------------------------------------------------------------------------------------
# 9. What K3's layout cannot hold is refused on export
# ---------------------------------------------------------------------------------------------------------------

def _k3_backbone(**overrides):
    backbone, problems = backbone_from_k3({k: v for k, v in tiny_k3_text_config(**overrides).items()
                                           if k != "attn_res_block_size"})
    assert not problems
    return backbone


EXPORT_REFUSALS = {
    "non-k3-backbone": (lambda: tiny_model(attnres_block_size=2, attnres_rescale_output=False), "backbone 'llama'"),
    "full-attnres": (lambda: dict(depth_mixing="attnres", attnres_block_size=1, attnres_rescale_output=False),
                     "attnres_block_size 1"),
    "rescaled": (lambda: dict(depth_mixing="attnres", attnres_block_size=4, attnres_rescale_output=True),
                 "attnres_rescale_output=True"),
    "denseformer": (lambda: dict(depth_mixing="denseformer"), "depth_mixing 'denseformer'"),
}


@pytest.mark.parametrize("make, match", EXPORT_REFUSALS.values(), ids=EXPORT_REFUSALS.keys())
def test_models_k3_cannot_hold_are_refused_on_export(tmp_path, capsys, make, match):
    """`export(..., to="k3-layout")` refuses, naming the setting, a non-K3 backbone, Full AttnRes (K3 seals whole
    decoder layers; odd block sizes past 1 the AttnRes config itself refuses), a rescaled router output and another
    method; nothing written."""
    made = make()
    if isinstance(made, dict):
        made = AttnResForCausalLM(AttnResConfig(backbone=_k3_backbone(), **made))
    made.save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match=None) as error:
        export(tmp_path / "ours", tmp_path / "out", to="k3-layout")
    assert match in str(error.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    _refused(tmp_path, capsys, ["export", "--to", "k3-layout", str(tmp_path / "ours"), str(tmp_path / "out")], match)


def test_a_native_k3_attnres_model_exports_and_converts_back(tmp_path):
    """A kimi_k3 AttnRes model made here (not converted) exports to K3's layout, whose text config K3's fields
    describe (attn_res_block_size half the block size) and which converts back to the same model."""
    config = AttnResConfig(backbone=_k3_backbone(), depth_mixing="attnres", attnres_block_size=4,
                           attnres_rescale_output=False)
    torch.manual_seed(0)
    model = AttnResForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".query"):
                param.normal_(0, 0.5)
    model.config.use_cache = False  # as a training run saves it
    model.save_pretrained(tmp_path / "ours")
    export(tmp_path / "ours", tmp_path / "k3", to="k3-layout")
    fields = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert fields["attn_res_block_size"] == 2 and fields["model_type"] == "kimi_linear"
    assert fields["use_cache"] is True and "attention_dropout" not in fields  # the release's, not training's
    report = json.loads((tmp_path / "k3" / "export_report.json").read_text())
    assert report["k3_text_config_source"].startswith("derived from the model's config")
    assert fields["linear_attn_config"]["kda_layers"] == [1, 3, 4]
    back = imported(tmp_path / "k3")
    assert torch.equal(logits_of(back), logits_of(model))
    state = folder_state(tmp_path / "k3")
    cfg = copy.deepcopy(fields)
    assert relative(logits_of(model), k3_reference_logits(state, cfg, IDS)) <= REL_TOL


def test_an_existing_output_folder_is_kept(k3_converted, tmp_path, capsys):
    """Neither convert nor export replaces an existing folder without --force."""
    folder, _, out, _ = k3_converted
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 2
    assert main(["export", "--to", "k3-layout", str(out), str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    shutil.rmtree(tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------------
# Folders other tools write, and the settings a K3 folder may have beside the released ones
# ---------------------------------------------------------------------------------------------------------------


def test_tied_embeddings_make_the_head_the_embedding(tmp_path):
    """`tie_word_embeddings: true` (no `lm_head` tensor): the head is the embedding, as K3 computes it (Kimi Linear's
    causal LM declares no tied weights, which left the head uninitialised)."""
    cfg = tiny_k3_text_config(tie_word_embeddings=True)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0)
    assert not any(name.endswith("lm_head.weight") for name in state)
    reference = k3_reference_logits(state, cfg, IDS)
    assert relative(logits_of(imported(tmp_path / "k3")), reference) <= REL_TOL
    convert(tmp_path / "k3", tmp_path / "out")
    assert relative(logits_of(AttnResForCausalLM.from_pretrained(tmp_path / "out").eval()), reference) <= REL_TOL


def test_integer_json_floats_and_a_config_re_saved_by_transformers_are_read(tmp_path):
    """JSON writers that drop `.0` (`"activation_situ_beta": 4`), and a K3 text config re-saved through
    `KimiK3Config` (its derived fields `layer_types`, `linear_num_heads`, `head_dim`, ... beside K3's), read as the
    same model."""
    cfg = tiny_k3_text_config(activation_situ_beta=4, routed_scaling_factor=2)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, layout="text")
    reference = k3_reference_logits(state, cfg, IDS)
    assert relative(logits_of(imported(tmp_path / "k3")), reference) <= REL_TOL
    resaved = backbone_from_k3(cfg)[0].to_dict() | {"attn_res_block_size": cfg["attn_res_block_size"],
                                                     "model_type": "kimi_linear"}
    (tmp_path / "k3" / "config.json").write_text(json.dumps(resaved))
    assert relative(logits_of(imported(tmp_path / "k3")), reference) <= REL_TOL


READ_FIELDS = {
    # name: (text-config overrides, writer options, top-level config edits, what the backbone config must say)
    "torchtitan-rope_parameters": (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), {}, {}, {}),
    "rope_theta": (dict(rope_theta=50000.0), dict(layout="text"), {}, {}),
    "rope_scaling-null": (dict(rope_scaling=None), {}, {}, {}),
    "no-pad_token_id": (dict(pad_token_id=DELETE), dict(layout="text"), {}, dict(pad_token_id=None)),
    "no-token-ids": (dict(pad_token_id=DELETE, bos_token_id=DELETE, eos_token_id=DELETE), dict(layout="text"), {},
                     dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    "token-ids-at-the-top-level": (dict(pad_token_id=DELETE, bos_token_id=DELETE), {},
                                   dict(pad_token_id=94, bos_token_id=3), dict(pad_token_id=94, bos_token_id=3)),
    "torchtitan-multimodal-no-token-ids": (dict(pad_token_id=DELETE, bos_token_id=DELETE, eos_token_id=DELETE), {},
                                           dict(pad_token_id=DELETE, bos_token_id=DELETE, eos_token_id=DELETE),
                                           dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    "no-rms_norm_eps": (dict(rms_norm_eps=DELETE), {}, {}, dict(rms_norm_eps=1e-6)),
    "no-num_shared_experts": (dict(num_shared_experts=DELETE), {}, {}, dict(n_shared_experts=0)),
    "no-routed_scaling_factor": (NO_LATENT_NORM | dict(routed_scaling_factor=DELETE), {}, {},
                                 dict(routed_scaling_factor=1.0)),
    "no-first_k_dense_replace": (dict(first_k_dense_replace=DELETE), {}, {}, dict(mlp_layer_types=["sparse"] * 5)),
}


@pytest.mark.parametrize("overrides, writer, top, expected", READ_FIELDS.values(), ids=READ_FIELDS.keys())
def test_fields_k3_writers_put_or_leave_out_are_read_as_k3_reads_them(tmp_path, overrides, writer, top, expected):
    """What the release, torchtitan's config writer and other K3 writers put in a text config, or leave out, loads
    and computes K3's model: rotary-embedding fields (K3 has none: accepted and dropped), token ids absent from the text
    config (the release writes its pad and bos ids only at the top level; absent everywhere: None, not Kimi Linear's
    163839, which a vocabulary under 163840 has not), and fields left out, which read K3's config class's defaults
    (`rms_norm_eps` 1e-6, no shared experts, `routed_scaling_factor` 1, an MoE layer 0), not transformers' Kimi
    Linear's; the reference reads the same defaults (`K3_CONFIG_DEFAULTS`)."""
    cfg = tiny_k3_text_config(**overrides)
    state = write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, **writer)
    if top:
        _edit_config(tmp_path / "k3", top=top)
    backbone = open_source(tmp_path / "k3").config
    assert {name: getattr(backbone, name) for name in expected} == expected
    assert relative(logits_of(imported(tmp_path / "k3")), k3_reference_logits(state, cfg, IDS)) <= REL_TOL


@pytest.mark.parametrize("pad_token_id", [96, 163839, -1])
def test_a_kimi_k3_config_with_a_pad_id_outside_its_vocabulary_is_refused_by_name(pad_token_id):
    """A pad id the embedding cannot hold (Kimi Linear's default 163839 under a smaller vocabulary among them) is a
    one-line ValueError naming the field, not torch's bare `AssertionError: Padding_idx must be within
    num_embeddings` when the model is built."""
    fields = dict(vocab_size=96, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=5)
    with pytest.raises(ValueError, match=rf"pad_token_id={pad_token_id!r} is not a token of the vocabulary"):
        KimiK3Config(**fields, pad_token_id=pad_token_id)
    assert KimiK3Config(**fields, pad_token_id=None).pad_token_id is None


def test_the_familys_own_saved_model_converts(tmp_path):
    """A folder `KimiK3ForCausalLM.save_pretrained` wrote (the kimi_k3 family's residual model, attnres-hf's names)
    converts as that model in memory does: exactly, as a retrofit."""
    from attnres_hf.modeling.backbones_k3 import KimiK3ForCausalLM

    cfg = tiny_k3_text_config(attn_res_block_size=DELETE)
    write_k3_checkpoint(tmp_path / "k3", cfg, seed=0, layout="text")
    model = open_source(tmp_path / "k3").load_model({}, torch.float32).reference.plain
    assert isinstance(model, KimiK3ForCausalLM)
    model.save_pretrained(tmp_path / "family")
    check = convert(tmp_path / "family", tmp_path / "out")["verification"]
    # fp32 rounding of the retrofit's reordered sums: 1.4e-6 to 4.1e-6 of the logits' scale over seeds 0-3 (the K3
    # folder itself converts with the same deltas)
    assert check["max_abs_logit_delta"] < 1e-5 * check["source_max_abs_logit"] and check["greedy_match"]


@pytest.mark.parametrize("method", ["denseformer", "mhc", "residual"])
def test_k3_without_attnres_retrofits_with_other_methods(tmp_path, method):
    """K3's architecture without AttnRes takes any retrofit: the methods' own parameters are no K3 tensors, and the
    check writes back only K3's."""
    cfg = tiny_k3_text_config(attn_res_block_size=DELETE)
    write_k3_checkpoint(tmp_path / "k3", cfg, seed=0)
    report = convert(tmp_path / "k3", tmp_path / "out", depth_mixing=method)
    assert report["verification"]["tensors_identical"] and report["verification"]["max_abs_logit_delta"] < 1e-4


@pytest.mark.slow  # about 6 s
@pytest.mark.parametrize("method", ["routers", "lora"])
def test_attnres_train_runs_on_a_converted_k3_folder(tmp_path, method):
    """`attnres train --method routers|lora` on a converted K3 folder (with a tokenizer: the suite's word-level one,
    over a vocabulary of 99): two steps, finite losses, a trained folder that loads and runs."""
    from utils import counting_text, word_tokenizer

    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(vocab_size=99), seed=0)
    word_tokenizer().save_pretrained(tmp_path / "k3")
    convert(tmp_path / "k3", tmp_path / "model")
    (tmp_path / "train.txt").write_text(counting_text(lines=40))
    assert main(["train", str(tmp_path / "model"), "--data", str(tmp_path / "train.txt"), "--method", method,
                 "--output-dir", str(tmp_path / "out"), "--max-steps", "2", "--seq-len", "32",
                 "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--logging_steps", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["train_loss"]))
    from attnres_hf.training import load_adapter

    trained = (AttnResForCausalLM.from_pretrained(tmp_path / "out") if method == "routers"
               else load_adapter(str(tmp_path / "model"), tmp_path / "out"))  # LoRA saves an adapter on its base
    assert torch.isfinite(trained(torch.arange(8).unsqueeze(0)).logits).all()


KIMI_LIKE_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class KimiLikeTokenizer(PreTrainedTokenizerFast):
    """A tokenizer that is the folder's own code, as Kimi's TikTokenTokenizer is."""
'''


def _with_remote_code_tokenizer(folder):
    from utils import word_tokenizer

    word_tokenizer().save_pretrained(folder)
    (folder / "tokenization_kimi_like.py").write_text(KIMI_LIKE_TOKENIZER)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "KimiLikeTokenizer",
               "auto_map": {"AutoTokenizer": [None, "tokenization_kimi_like.KimiLikeTokenizer"]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_a_remote_code_tokenizer_runs_only_when_trusted(tmp_path, capsys):
    """K3's tokenizer is its own code (`auto_map` in `tokenizer_config.json`): without `--trust-remote-code` the
    folder is refused in one line before anything is read (never transformers' interactive prompt); with it, the
    tokenizer converts along and the export carries it too."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(vocab_size=99), seed=0)
    _with_remote_code_tokenizer(tmp_path / "k3")
    _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out")],
             "tokenizer is its own code (tokenization_kimi_like.KimiLikeTokenizer")
    assert main(["convert", str(tmp_path / "k3"), str(tmp_path / "out"), "--trust-remote-code"]) == 0
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert "converted_continuation" in report["verification"]  # decoded by the source's own tokenizer
    assert report["source"]["tokenizer_code"] == "tokenization_kimi_like.KimiLikeTokenizer"
    assert 'AutoTokenizer.from_pretrained("out", trust_remote_code=True)' in (tmp_path / "out" / "README.md").read_text()
    capsys.readouterr()
    assert main(["export", "--to", "k3-layout", str(tmp_path / "out"), str(tmp_path / "back")]) == 2
    assert "tokenizer is its own code" in capsys.readouterr().err and not (tmp_path / "back").exists()
    assert main(["export", "--to", "k3-layout", str(tmp_path / "out"), str(tmp_path / "back"),
                 "--trust-remote-code"]) == 0
    assert (tmp_path / "back" / "tokenizer_config.json").is_file()


def test_a_fine_tuned_k3_model_exports_the_original_text_config(k3_converted, tmp_path):
    """A converted K3 model saved after training (`use_cache` off, the conversion report kept) exports K3's own text
    config, `use_cache` included: training changes weights, not the architecture."""
    folder, _, out, _ = k3_converted
    model = AttnResForCausalLM.from_pretrained(out)
    model.config.use_cache = False
    model.save_pretrained(tmp_path / "tuned")
    shutil.copy(out / "conversion_report.json", tmp_path / "tuned")
    export(tmp_path / "tuned", tmp_path / "k3", to="k3-layout")
    written = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert written == text_config_of(folder) | {"dtype": "float32"}
    report = json.loads((tmp_path / "k3" / "export_report.json").read_text())
    assert report["k3_text_config_source"].startswith("the K3 checkpoint's own")


def test_an_edited_recorded_text_config_k3_cannot_read_is_not_the_export_config(k3_converted, tmp_path):
    """A recorded K3 text config (conversion_report.json) whose block size K3 cannot read (edited) does not describe
    the model: the export derives the config from the model's, as for any other architecture, instead of refusing
    the model for the record's value."""
    _, _, out, _ = k3_converted
    shutil.copytree(out, tmp_path / "model")
    recorded = json.loads((out / "conversion_report.json").read_text())
    recorded["source"]["k3_text_config"]["attn_res_block_size"] = "x"
    (tmp_path / "model" / "conversion_report.json").write_text(json.dumps(recorded))
    report = export(tmp_path / "model", tmp_path / "k3", to="k3-layout")
    assert report["k3_text_config_source"].startswith("derived") and report["k3_text_config"]["attn_res_block_size"] == 2


def test_k3s_fp32_tensors_stay_fp32_in_a_bf16_model(k3_converted):
    """Loaded in bfloat16, the tensors K3 keeps in fp32 inside its bf16 checkpoint (KDA's convolutions, `A_log`,
    `dt_bias`, the gated output norm, the experts' score-correction bias) stay fp32, as do the depth routers; the
    logits are finite and near the fp32 model's."""
    out = k3_converted[2]
    model = AttnResForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    state = model.state_dict()
    kept = [name for name in state if name.endswith(("conv1d.weight", "A_log", "dt_bias", "o_norm.weight",
                                                      "e_score_correction_bias"))]
    assert len(kept) == 3 * 4 + 4 and all(state[name].dtype == torch.float32 for name in kept)
    assert state["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    reference = logits_of(AttnResForCausalLM.from_pretrained(out).eval()).double()
    delta = (logits_of(model).double() - reference).abs().mean() / reference.abs().mean()
    # measured 0.057: bf16 rounding of every other weight and activation, with top-k expert choices that flip on
    # this random tiny model; the bound only catches a broken bf16 path (e.g. a routed output in the wrong dtype)
    assert torch.isfinite(logits_of(model)).all() and delta < 0.2


def test_routing_runs_a_remote_code_tokenizer_only_when_trusted(tmp_path, capsys):
    """`attnres routing` on a converted K3 folder whose tokenizer is its own code: refused in one line without
    `--trust-remote-code` (never transformers' prompt), maps written with it."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(vocab_size=99), seed=0)
    _with_remote_code_tokenizer(tmp_path / "k3")
    assert main(["convert", str(tmp_path / "k3"), str(tmp_path / "model"), "--trust-remote-code"]) == 0
    argv = ["routing", str(tmp_path / "model"), "--text", "w5 w6 w7", "--output-dir", str(tmp_path / "maps")]
    capsys.readouterr()
    assert main(argv) == 2 and "tokenizer is its own code" in capsys.readouterr().err
    assert main([*argv, "--trust-remote-code"]) == 0 and any((tmp_path / "maps").iterdir())


def test_the_k3_releases_own_code_still_loads_with_attnres_hf_imported(tmp_path):
    """The release's `model_type` is `kimi_k3`, the backbone's too: attnres-hf registers no Auto class for it, so
    `AutoConfig.from_pretrained(release, trust_remote_code=True)` runs the release's own code (a registered class
    would take precedence over it)."""
    from transformers import AutoConfig

    import attnres_hf  # noqa: F401  (registers what it registers)

    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "configuration_kimi_k3.py").write_text(
        "from transformers import PretrainedConfig\n\n\nclass KimiK3Config(PretrainedConfig):\n"
        "    model_type = 'kimi_k3'\n")
    (tmp_path / "release" / "config.json").write_text(json.dumps({
        "model_type": "kimi_k3", "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config"},
        "text_config": tiny_k3_text_config()}))
    config = AutoConfig.from_pretrained(tmp_path / "release", trust_remote_code=True)
    assert type(config).__module__.startswith("transformers_modules")


@pytest.mark.parametrize("auto_map, match", [
    (["tokenization_kimi_like.KimiLikeTokenizer", None], "the legacy form"),
    ({"AutoTokenizer": [None, None]}, "with at least one class"),
    ({"AutoTokenizer": "tokenization_kimi_like.KimiLikeTokenizer"}, "transformers reads [slow class or null"),
    ("not json", "is not valid JSON"),
    ([], "is not a JSON object"),
])
def test_tokenizer_configs_transformers_cannot_read_are_one_line_refusals(tmp_path, capsys, auto_map, match):
    """Odd `tokenizer_config.json` files (the legacy list `auto_map`, no class, a bare string, broken JSON, a list) are
    refused naming the file before anything is read, with or without `--trust-remote-code` (transformers fails on each
    with a traceback, or after the weights are read)."""
    write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(vocab_size=99), seed=0)
    _with_remote_code_tokenizer(tmp_path / "k3")
    file = tmp_path / "k3" / "tokenizer_config.json"
    if auto_map == "not json":
        file.write_text("{'auto_map': 1}")
    elif auto_map == []:
        file.write_text("[]")
    else:
        file.write_text(json.dumps(json.loads(file.read_text()) | {"auto_map": auto_map}))
    for flag in ([], ["--trust-remote-code"]):
        _refused(tmp_path, capsys, ["convert", str(tmp_path / "k3"), str(tmp_path / "out"), *flag], match)


def test_a_16_bit_dtype_keeps_k3s_fp32_tensors(tmp_path):
    """`--dtype bfloat16` (or float16) on a K3 checkpoint writes every tensor in it but those K3 keeps in fp32, which
    keep their stored values; the export gives the bf16 checkpoint back bit for bit; the report says bfloat16, and the
    source's generation config goes along."""
    state = write_k3_checkpoint(tmp_path / "k3", tiny_k3_text_config(), seed=0, layout="text", dtype=torch.bfloat16)
    (tmp_path / "k3" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7],
                                                                        "max_new_tokens": 77}))
    report = convert(tmp_path / "k3", tmp_path / "out", dtype="bfloat16")
    assert report["dtype"] == "bfloat16"
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 7] and generation["max_new_tokens"] == 77
    export(tmp_path / "out", tmp_path / "back", to="k3-layout")
    back = folder_state(tmp_path / "back")
    assert {n: (t.dtype, t.shape) for n, t in back.items()} == {n: (t.dtype, t.shape) for n, t in state.items()}
    assert all(torch.equal(back[n], state[n]) for n in state)
