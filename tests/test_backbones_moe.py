"""AttnRes on mixture-of-experts backbones and on Kimi Linear, the paper's own backbone (issue 12).

Families: `kimi_linear` (KDA linear-attention and MLA layers interleaved, MoE with shared experts and
sigmoid/grouped routing, hybrid cache of recurrent and KV layers), `qwen3_moe` (dense `mlp_only_layers` beside MoE
layers), `qwen2_moe` (a gated shared expert), `mixtral` (sliding-window attention), `olmoe` (q/k norms over the
whole projection). Every source is transformers' own model at a tiny size; the AttnRes model is built from it by
`retrofit` (and from its config by `retrofit_config` for models trained from scratch).
"""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import (AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM, MixtralConfig,
                          MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from attnres_hf import AttnResForCausalLM
from attnres_hf.conversion import retrofit
from attnres_hf.conversion.retrofit import retrofit_config
from attnres_hf.modeling.backbones_k3 import KimiK3Config, KimiK3ForCausalLM
from attnres_hf.modeling.backbones_moe import dispatch_kda_by_device
from attnres_hf.modeling.depth_mixing import DEPTH_MIXING, is_depth_mixing_parameter
from utils import BLOCK_METHODS, OTHER_PROCESS_ATOL, perturb_mixing

COMMON = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)

KIMI = dict(
    num_key_value_heads=4,  # transformers' KimiLinearAttention fails with fewer kv heads (see the refusal test)
    intermediate_size=48, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
)

K3 = KIMI | dict(  # every piece Kimi K3 adds to Kimi Linear switched on (`backbones_k3.py`)
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, routed_expert_hidden_size=24,
    latent_moe_use_norm=True, mla_use_output_gate=True, q_lora_rank=12, linear_use_full_rank_gate=True,
    linear_lower_bound=-5.0, n_shared_experts=2, routed_scaling_factor=1.5,
)

SOURCES = {
    "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM, KIMI),
    "kimi_k3": (KimiK3Config, KimiK3ForCausalLM, K3),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       head_dim=8, mlp_only_layers=[0])),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
}
"""`model_type -> (config class, transformers causal LM, tiny config)`: 2 layers, hidden 32, 4 experts (top 2)."""

FAMILIES = list(SOURCES)
KIMI_FAMILIES = ("kimi_linear", "kimi_k3")
AUX_LOSS_FAMILIES = [f for f in FAMILIES if f not in KIMI_FAMILIES]  # Kimi Linear's (and K3's) model adds no aux loss

METHODS = {name: {"depth_mixing": name} | ({"attnres_block_size": 2} if name in BLOCK_METHODS else {})
           for name in DEPTH_MIXING}
METHODS["full-attnres"] = {"depth_mixing": "attnres", "attnres_block_size": 1}

REFUSED = {(family, method) for family in KIMI_FAMILIES for method in ("muddformer", "dca")}
"""(family, method) pairs refused: Kimi Linear's MLA derives keys and values from one latent of one input, so the
separate key and value inputs of MUDDFormer and DCA do not exist for it."""

ATOL = 2e-5  # fp32 round-off on logits of magnitude ~1-3 (the residual sum is re-associated by the routers)


def source_config(family: str, **overrides):
    config_class, _, extra = SOURCES[family]
    return config_class(**{**COMMON, **extra, **overrides})


def source_model(family: str, seed: int = 0, **overrides):
    """The family's transformers model (K3's: ours), its KDA made to take fla's kernels on CUDA tensors only
    (`dispatch_kda_by_device`: transformers' own takes them on every device where fla is installed)."""
    _, model_class, _ = SOURCES[family]
    torch.manual_seed(seed)
    return dispatch_kda_by_device(model_class(source_config(family, **overrides))).eval()


def ids(batch=2, length=9, seed=1):
    return torch.randint(3, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def sources():
    return {family: source_model(family) for family in FAMILIES}


def retrofitted(source, perturb=False, **overrides):
    model = retrofit(source, **overrides)
    if perturb:
        perturb_mixing(model)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Exact retrofit, every method on every family
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_retrofit_computes_the_source_logits_with_every_method(family, method, sources):
    """Every backbone weight is the source's under the source's own name; mixing modules are the only extra
    parameters; logits agree to fp32 round-off on a padded batch."""
    source = sources[family]
    if (family, METHODS[method]["depth_mixing"]) in REFUSED:
        with pytest.raises(ValueError, match=f"separate key and value inputs .* {family}"):
            retrofitted(source, **METHODS[method])
        return
    model = retrofitted(source, **METHODS[method])
    assert isinstance(model, AttnResForCausalLM) and model.config.depth_mixing == METHODS[method]["depth_mixing"]
    own, theirs = model.state_dict(), source.state_dict()
    assert set(theirs) <= set(own)
    assert all(torch.equal(own[k], theirs[k]) for k in theirs)
    extra = set(own) - set(theirs)
    assert all(is_depth_mixing_parameter(k) for k in extra), sorted(extra)[:5]
    assert bool(extra) == (method != "residual")
    input_ids = ids()
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            expected, got = source(input_ids, **kwargs).logits, model(input_ids, **kwargs).logits
            delta = (expected - got).abs().max().item()
            assert delta < ATOL, f"{family}/{method} (mask={bool(kwargs)}): max |delta logits| {delta:.3g}"


def test_kimi_linear_keeps_its_hybrid_layout_and_moe(sources):
    model = retrofitted(sources["kimi_linear"])
    attn = [type(layer.self_attn).__name__ for layer in model.model.layers]
    mlp = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert attn == ["KimiLinearDeltaAttentionByDevice", "KimiLinearAttention"]  # transformers' KDA (ours) and MLA
    assert mlp == ["KimiLinearMLP", "KimiLinearMoE"]
    assert model.config.num_sublayers == 4


def test_kimi_linear_with_fewer_kv_heads_is_refused_as_the_source_fails():
    """transformers' KimiLinearAttention cannot run grouped kv heads (it fails inside its forward); the AttnRes model
    does not hide that: it refuses the config early, naming the limit."""
    config = source_config("kimi_linear", num_key_value_heads=2)
    with pytest.raises(RuntimeError, match="size of tensor"):  # not fla's failure on CPU: KDA runs torch's here
        dispatch_kda_by_device(KimiLinearForCausalLM(config))(ids())
    with pytest.raises(ValueError, match="num_key_value_heads"):
        retrofit_config(config)


# ---------------------------------------------------------------------------------------------------------------
# Generation with the family's cache
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_equals_full_recompute(family, sources):
    """Prefill + one-token steps through the cache give the logits of one full forward, and greedy `generate` with
    the cache gives the no-cache tokens (Kimi Linear: recurrent KDA states and compressed MLA latents)."""
    model = retrofitted(sources[family], perturb=True)
    input_ids = ids(length=10)
    with torch.no_grad():
        full = model(input_ids).logits
        prefill = model(input_ids[:, :7], use_cache=True)
        cache, steps = prefill.cache, [prefill.logits]
        for i in range(7, 10):
            out = model(input_ids[:, i : i + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 10
    if family in KIMI_FAMILIES:
        assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer", "DynamicLayer"]
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        cached = model.generate(input_ids[:1], **greedy)
        recomputed = model.generate(input_ids[:1], use_cache=False, **greedy)
    assert torch.equal(cached, recomputed)


# ---------------------------------------------------------------------------------------------------------------
# Router logits and the load-balancing loss, as the source model computes them
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_and_aux_loss_match_the_source(family, sources):
    source = sources[family]
    model = retrofitted(source)
    input_ids = ids()
    with torch.no_grad():
        expected = source(input_ids, labels=input_ids, output_router_logits=True)
        got = model(input_ids, labels=input_ids, output_router_logits=True)
        plain = model(input_ids, labels=input_ids)
    assert len(got.router_logits) == len(expected.router_logits) >= 1
    for a, b in zip(got.router_logits, expected.router_logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.loss, expected.loss, atol=ATOL, rtol=0)
    assert plain.router_logits is None and plain.aux_loss is None
    if family in KIMI_FAMILIES:  # aux-loss-free balancing (score-correction bias): the source adds no aux loss
        assert expected.aux_loss is None and got.aux_loss is None
        torch.testing.assert_close(got.loss, plain.loss, atol=0, rtol=0)
    else:
        torch.testing.assert_close(got.aux_loss, expected.aux_loss, atol=ATOL, rtol=0)
        coef = source.config.router_aux_loss_coef
        torch.testing.assert_close(got.loss, plain.loss + coef * got.aux_loss, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", AUX_LOSS_FAMILIES)
def test_config_output_router_logits_puts_the_aux_loss_into_the_training_gradient(family):
    """`output_router_logits=True` in the config (as for the source) adds `router_aux_loss_coef * aux_loss` to the
    loss; its gradient reaches the experts' gate, and with perturbed depth routers also the pseudo-queries."""
    source = source_model(family, output_router_logits=True, router_aux_loss_coef=0.5)
    model = retrofitted(source, perturb=True).train()
    input_ids = ids()
    out = model(input_ids, labels=input_ids)
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    gate = next(p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    (aux_grad,) = torch.autograd.grad(0.5 * out.aux_loss, gate, retain_graph=True)
    (total_grad,) = torch.autograd.grad(out.loss, gate)
    assert aux_grad.abs().sum() > 0
    model.config.output_router_logits = False
    (lm_grad,) = torch.autograd.grad(model(input_ids, labels=input_ids).loss, gate)
    torch.testing.assert_close(total_grad, lm_grad + aux_grad, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Training, checkpoints
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family, sources):
    model = retrofitted(sources[family], perturb=True).train()
    model.config.output_router_logits = True  # the aux loss (where the family has one) is part of the gradient
    input_ids = ids()

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids, labels=input_ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    checkpointed = grads()
    assert set(plain) == set(checkpointed)
    assert any(n.endswith(".query") for n in plain) and any("experts" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3", "qwen2_moe"])  # the others: every method in the retrofit test
def test_from_scratch_config_builds_every_method(family):
    """`retrofit_config` of the source config is the AttnRes config of that backbone: a model trains from it (the
    gradient reaches every mixing parameter)."""
    for method, overrides in METHODS.items():
        if (family, overrides["depth_mixing"]) in REFUSED:
            with pytest.raises(ValueError, match="separate key and value inputs"):
                retrofit_config(source_config(family), **overrides)
            continue
        config = retrofit_config(source_config(family), **overrides)
        torch.manual_seed(0)
        model = AttnResForCausalLM(config).train()
        out = model(ids(), labels=ids())
        out.loss.backward()
        assert torch.isfinite(out.loss), (family, method)
        mixing = [p for n, p in model.named_parameters() if is_depth_mixing_parameter(n)]
        assert all(p.grad is not None for p in mixing), (family, method)


REMOTE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.modules["attnres_hf"] = None  # the package must not be importable: only the checkpoint's files are used
    from transformers import AutoModelForCausalLM
    ids = torch.tensor(json.loads(sys.argv[1]))
    result = {}
    for folder in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            result[folder] = model(ids).logits.tolist()
            greedy = model.generate(ids[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        result[folder + ":generate"] = greedy.tolist()
    assert "attnres_hf" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_save_reload_native_and_remote_code(sources, tmp_path):
    """Each family saves, reloads natively with identical logits, and loads as remote code in a fresh process
    without attnres-hf installed (one process for all families)."""
    input_ids = ids()
    expected = {}
    for family in FAMILIES:
        model = retrofitted(sources[family], perturb=True)
        folder = tmp_path / family
        model.save_pretrained(folder)
        assert (folder / "modeling_attnres.py").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(loaded) is AttnResForCausalLM
        with torch.no_grad():
            logits = model(input_ids).logits
            torch.testing.assert_close(loaded(input_ids).logits, logits, atol=0, rtol=0)
            greedy = model.generate(input_ids[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        expected[str(folder)] = (logits, greedy)
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, json.dumps(input_ids.tolist()), *expected],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    for folder, (logits, greedy) in expected.items():
        torch.testing.assert_close(torch.tensor(remote[folder]), logits, atol=OTHER_PROCESS_ATOL, rtol=0)
        assert remote[folder + ":generate"] == greedy.tolist()


def test_attnres_convert_on_a_kimi_linear_folder_writes_a_verified_folder(sources, tmp_path):
    from attnres_hf.cli import main

    source = sources["kimi_linear"]
    source.save_pretrained(tmp_path / "kimi")
    assert main(["convert", str(tmp_path / "kimi"), str(tmp_path / "out"), "--block-size", "2"]) == 0
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["source"]["model_type"] == "kimi_linear"
    verification = report["verification"]
    assert verification["max_abs_logit_delta"] < ATOL and verification["argmax_agreement"] == 1.0
    assert verification["greedy_match"]
    assert "max abs logit delta vs source" in (tmp_path / "out" / "README.md").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, source(ids()).logits, atol=ATOL, rtol=0)
    # streamed: the source is checked offloaded (`conversion.offloaded`), transformers' model with our KDA on the CPU
    assert main(["convert", str(tmp_path / "kimi"), str(tmp_path / "streamed"), "--block-size", "2", "--stream"]) == 0
    streamed = json.loads((tmp_path / "streamed" / "conversion_report.json").read_text())["verification"]
    assert streamed["max_abs_logit_delta"] < ATOL and streamed["greedy_match"]


# ---------------------------------------------------------------------------------------------------------------
# `attnres train` on a mixture-of-experts AttnRes model
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["routers", "lora", "full"])
def test_attnres_train_recipes_on_an_moe_model(method, tmp_path):
    """Qwen2-MoE (a routed gate `mlp.gate` and a linear `mlp.shared_expert_gate`): `routers` trains the depth routers
    only, never the experts' gates; `lora`'s default targets leave both gates out and its routers travel with the
    adapter, and `--lora_target_parameters` adds the stacked expert weights; `full` trains the gates too; the experts'
    aux loss enters the loss and is logged."""
    from safetensors.torch import load_file

    from attnres_hf.cli import main
    from attnres_hf.training import default_lora_targets
    from utils import counting_text, word_tokenizer

    model = retrofit(source_model("qwen2_moe"), attnres_block_size=2)
    targets = default_lora_targets(model)
    assert "gate" not in targets and "shared_expert_gate" not in targets and {"q_proj", "down_proj"} <= set(targets)
    model.save_pretrained(tmp_path / "model")
    word_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "train.txt").write_text(counting_text(lines=40))
    out = tmp_path / "out"
    assert main(["train", str(tmp_path / "model"), "--data", str(tmp_path / "train.txt"), "--output-dir", str(out),
                 "--method", method, "--output-router-logits", "true", "--max-steps", "3", "--lr", "1e-2",
                 "--seq-len", "32", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--eval_steps", "3",
                 "--save_steps", "3", "--disable_tqdm", "true", "--lora_r", "2", "--seed", "0",
                 *(["--lora_target_parameters", "mlp.experts.down_proj"] if method == "lora" else [])]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["aux_loss_last"] is not None and summary["aux_loss_last"] > 0
    history = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    assert sum("aux_loss" in entry for entry in history) == 3  # one per logged training step
    before = load_file(tmp_path / "model" / "model.safetensors")
    gates = [k for k in before if k.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))]
    assert gates
    if method == "lora":
        adapter = load_file(out / "adapter_model.safetensors")
        wrapped = {k.split(".lora_A")[0] for k in adapter if "lora_A" in k}
        assert wrapped and not [k for k in wrapped if k.endswith(("gate", "shared_expert_gate"))]
        assert [k for k in adapter if "experts" in k and "lora_B" in k]  # --lora_target_parameters
        assert any(k.endswith("mlp_res.query") for k in adapter)
        return
    after = load_file(out / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if method == "routers":
        assert changed and all(is_depth_mixing_parameter(k) for k in changed)
        assert summary["trainable_parameters"] == summary["router_parameters"]
    else:
        assert set(gates) <= changed


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_lora_reaches_the_stacked_expert_weights_when_asked(family):
    """The experts' weights are `(experts, out, in)` parameters, not linear layers: `lora_target_parameters` adapts
    them through PEFT's `target_parameters`. At initialisation the logits are the model's; after a step on the
    adapters the merged model equals the adapted one; a name that is no stacked expert weight (a typo, a linear
    layer, any name on a dense model) is refused naming the valid ones."""
    from attnres_hf.training import expert_parameter_names, prepare_model

    model = retrofit(source_model(family), attnres_block_size=2)
    experts = expert_parameter_names(model)
    assert set(experts) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    x = ids()
    with torch.no_grad():
        reference = model(x).logits
    torch.manual_seed(0)
    wrapped = prepare_model(model, "lora", lora_r=2, lora_target_modules=["q_proj"], lora_target_parameters=experts)
    trainable = [name for name, param in wrapped.named_parameters() if param.requires_grad]
    assert [name for name in trainable if "experts" in name and "lora_B" in name]
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x).logits, reference, atol=1e-6, rtol=0)  # B = 0: W + 0 (round-off)
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
        adapted = wrapped(x).logits
    assert (adapted - reference).abs().max() > 1e-4  # the adapters act, on the experts too
    merged = wrapped.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, adapted, atol=1e-5, rtol=1e-5)
    for bad in (["mlp.experts.gate_proj"], ["q_proj"], []):
        with pytest.raises(ValueError, match="lora_target_parameters"):
            prepare_model(retrofit(source_model(family), attnres_block_size=2), "lora", lora_r=2,
                          lora_target_parameters=bad)
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(ValueError, match="applies to method 'lora' or 'qlora', not 'full'"):
        prepare_model(retrofit(source_model(family), attnres_block_size=2), "full", lora_target_parameters=experts)
    dense = retrofit(LlamaForCausalLM(LlamaConfig(**COMMON)), attnres_block_size=2)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        prepare_model(dense, "lora", lora_r=2, lora_target_parameters=["mlp.experts.down_proj"])


def test_kimi_linears_convolution_is_not_offered_as_an_expert_weight(sources):
    """Kimi Linear's KDA depthwise convolution is 3-D as well; only the experts' stacked weights are LoRA parameter
    targets (found offered and accepted, PEFT then treated 12,288 channels as experts)."""
    from attnres_hf.training import expert_parameter_names, prepare_model

    model = retrofitted(sources["kimi_linear"])
    assert set(expert_parameter_names(model)) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    with pytest.raises(ValueError, match="not found among this model's stacked expert weights: self_attn.conv1d"):
        prepare_model(model, "lora", lora_r=2, lora_target_parameters=["self_attn.conv1d.weight"])


def test_kimi_linear_keeps_its_fp32_modules_in_bf16_and_is_stateful(sources, tmp_path):
    """Loaded in bfloat16, every tensor has the dtype it has in transformers' own model (the experts' router,
    its score-correction bias and KDA's `dt_bias` stay fp32; the depth routers too); the recurrent KDA cache cannot be
    rewound, so assisted decoding is refused as for the source."""
    source = sources["kimi_linear"]
    source.save_pretrained(tmp_path / "source")
    retrofitted(source).save_pretrained(tmp_path / "attnres")
    theirs = KimiLinearForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.bfloat16).state_dict()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "attnres", dtype=torch.bfloat16)
    own = model.state_dict()
    assert {k: own[k].dtype for k in theirs} == {k: v.dtype for k, v in theirs.items()}
    assert {v.dtype for k, v in theirs.items()} == {torch.bfloat16, torch.float32}
    assert all(own[k].dtype == torch.float32 for k in own if is_depth_mixing_parameter(k))
    with torch.no_grad():
        assert torch.isfinite(model(ids()).logits).all()
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids()[:1], assistant_model=model, max_new_tokens=2)


def test_kimi_linear_attention_modules_get_the_arguments_their_own_layer_gives(sources):
    """KDA's keywords reach its kernels (`causal_conv1d_fn`, `chunk_kda`): each attention module of the AttnRes model
    receives exactly the keyword arguments `KimiLinearDecoderLayer` gives it, with and without a cache."""
    source = sources["kimi_linear"]
    model = retrofitted(source)

    def received(model, **kwargs):
        seen = {}

        def spy(index):
            def hook(module, args, kw):
                seen[index] = sorted(kw)
            return hook

        hooks = [layer.self_attn.register_forward_pre_hook(spy(i), with_kwargs=True)
                 for i, layer in enumerate(model.model.layers)]
        with torch.no_grad():
            model(ids(), **kwargs)
        for hook in hooks:
            hook.remove()
        return seen

    for kwargs in ({}, {"use_cache": True}):
        theirs, ours = received(source, **kwargs), received(model, **kwargs)
        assert ours == theirs and "position_ids" not in ours[0] and "position_embeddings" not in ours[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_retrofit_is_the_source_model_in_bfloat16(family, sources):
    """The experts run with the source's experts implementation (transformers' `grouped_mm` by default), so the
    residual baseline computes bit for bit the source's bfloat16 logits (the depth mixing differs only in rounding)."""
    source = sources[family]
    model = retrofitted(source, depth_mixing="residual")
    assert model.config._experts_implementation == source.config._experts_implementation
    bf16_source = copy.deepcopy(source).to(torch.bfloat16)
    with torch.no_grad():
        expected = bf16_source(ids()).logits
        torch.testing.assert_close(model.to(torch.bfloat16)(ids()).logits, expected, atol=0, rtol=0)


def test_recorders_of_a_subclass_and_its_base_record_each_module_once_in_either_order():
    """Kimi K3's attention and router subclass Kimi Linear's, and transformers matches recorders with `isinstance`:
    whichever family an AttnRes model serves first, the table ends with the base class's recorder alone (K3 first,
    then Kimi Linear, kept both, and a K3 model recorded each attention twice); recorders of other outputs or indices
    stay apart."""
    from torch import nn
    from transformers.utils.output_capturing import OutputRecorder

    from attnres_hf.modeling.backbones import merge_recorders

    class Base(nn.Module):
        pass

    class Sub(Base):
        pass

    class Other(nn.Module):
        pass

    for order in ([Sub, Base], [Base, Sub]):
        table = {}
        for cls in order:
            merge_recorders(table, {"attentions": cls, "router_logits": OutputRecorder(cls, index=0)})
        assert table["attentions"] == [Base], order
        assert [r.target_class for r in table["router_logits"]] == [Base], order
    table = {"attentions": [Sub]}
    merge_recorders(table, {"attentions": [Other, OutputRecorder(Base, index=1)]})
    assert table["attentions"][0] is Sub and table["attentions"][1] is Other and len(table["attentions"]) == 3
