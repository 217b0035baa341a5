"""The depth-mixing family on one backbone: DenseFormer, MUDDFormer, DCA, mHC and the AttnRes Table 4 knobs.

Each method must start as the residual model, keep generation with the KV cache and gradient checkpointing exact
once its mixing parameters are trained (here: randomly perturbed), save and reload (natively and as remote code),
and compute what its paper's update equation says (2-layer references written out below).
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from attnres_hf import AttnResForCausalLM
from attnres_hf.modeling.depth_mixing import (DEPTH_MIXING, MIXING_MODULES, depth_mixing_parameters,
                                             is_depth_mixing_parameter, is_no_weight_decay_parameter,
                                             modules_to_not_convert)
from attnres_hf.modeling.mixing_mhc import sinkhorn_knopp
from utils import OTHER_PROCESS_ATOL, TINY, VARIANTS, perturb_mixing, tiny_config, variant_model

EXTRA_VARIANTS = {
    "attnres-full": {"attnres_block_size": 1},
    "denseformer-k2-p2": {"depth_mixing": "denseformer", "denseformer_dilation": 2, "denseformer_period": 2},
    "mhc-2streams": {"depth_mixing": "mhc", "mhc_num_streams": 2},
}
WINDOW = {name: overrides for name, overrides in VARIANTS.items() if "attnres_window" in overrides}
"""A window drops sources: no initialisation reproduces the residual model."""
EXACT_AT_INIT = {
    name: overrides | ({"attnres_rescale_output": True} if overrides.get("depth_mixing", "attnres") == "attnres" else {})
    for name, overrides in (VARIANTS | EXTRA_VARIANTS).items()
    if name not in WINDOW and overrides.get("depth_mixing") != "residual"
}
ALL = EXACT_AT_INIT | WINDOW


@pytest.mark.parametrize("name", list(EXACT_AT_INIT))
def test_new_model_is_the_residual_model(name, input_ids):
    """At initialisation each method reproduces the residual model with the same backbone weights."""
    model = variant_model(EXACT_AT_INIT[name], perturb=False)
    residual = AttnResForCausalLM(tiny_config(depth_mixing="residual")).eval()
    residual.load_state_dict(model.state_dict(), strict=False)
    assert set(residual.state_dict()) < set(model.state_dict())  # the mixing parameters are extra, nothing else
    with torch.no_grad():
        delta = (model(input_ids).logits - residual(input_ids).logits).abs().max().item()
    assert delta <= 1e-5, delta
    perturb_mixing(model)
    with torch.no_grad():
        assert (model(input_ids).logits - residual(input_ids).logits).abs().max() > 1e-3  # the mixing is used


def test_sliding_window_drops_sources_and_equals_full_when_wide_enough(input_ids):
    narrow = variant_model({"attnres_block_size": 1, "attnres_window": 2})
    wide = variant_model({"attnres_block_size": 1, "attnres_window": 100})
    full = variant_model({"attnres_block_size": 1})
    with torch.no_grad():
        weights = narrow(input_ids, output_depth_weights=True).depth_weights
        torch.testing.assert_close(wide(input_ids).logits, full(input_ids).logits, atol=1e-6, rtol=0)
    assert [w.shape[-1] for w in weights] == [1, 2, 3, 3, 3, 3, 3]  # the embedding + at most 2 recent sources


@torch.no_grad()
@pytest.mark.parametrize("window", [2, 4])
def test_sliding_window_at_depth_is_the_papers_window_over_sub_layers(window, input_ids):
    """Table 4's "the W most recent layers plus the embedding", a layer being a sub-layer (attention and MLP each
    count), the partial sum never a source (block size 1) and the final router windowed like the others: 4 layers,
    8 sub-layers, so the window slides over 4 (W=4) or 6 (W=2) routers. Written-out reference (`attnres_reference`);
    measured max |Δ| 4e-7 on the logits and 8e-7 on the depth weights (fp32 rounding), checked at 1e-5."""
    model = variant_model({"attnres_block_size": 1, "attnres_window": window}, num_hidden_layers=4,
                          attn_implementation="sdpa")
    logits, weights = attnres_reference(model, input_ids)
    out = model(input_ids, output_depth_weights=True)
    assert [w.shape[-1] for w in out.depth_weights] == [min(sublayer, window) + 1 for sublayer in range(9)]
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=0)
    for actual, expected in zip(out.depth_weights, weights, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(ALL))
def test_gradient_checkpointing_gives_the_same_outputs_and_gradients(name, input_ids):
    model = variant_model(ALL[name]).train()
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    replays = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: replays.append(1))
    again = model(input_ids, labels=input_ids)
    again.loss.backward()
    hook.remove()
    assert len(replays) == 2  # checkpointing is really on
    torch.testing.assert_close(again.logits, out.logits, atol=0, rtol=0)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == plain.keys()
    mixing = [n for n in grads if is_depth_mixing_parameter(n)]
    assert mixing and any(grads[n].abs().sum() > 0 for n in mixing)  # the mixing parameters learn
    for key, grad in grads.items():
        torch.testing.assert_close(grad, plain[key], atol=1e-6, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


REMOTE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.modules["attnres_hf"] = None  # only the checkpoint's files may be used
    from transformers import AutoModelForCausalLM
    ids = torch.tensor(json.loads(sys.argv[1]))
    result = {}
    for folder in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            result[folder] = model(ids).logits.tolist()
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_every_method_saves_and_reloads_natively_and_as_remote_code(tmp_path, input_ids, tmp_path_factory):
    expected = {}
    for name, overrides in ALL.items():
        model = variant_model(overrides)
        model.save_pretrained(tmp_path / name)
        assert (tmp_path / name / "depth_mixing.py").is_file()  # the sibling travels with the modeling file
        loaded = AttnResForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            expected[str(tmp_path / name)] = logits = model(input_ids).logits
            torch.testing.assert_close(loaded(input_ids).logits, logits, atol=0, rtol=0)
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, json.dumps(input_ids.tolist()), *expected],
        capture_output=True, text=True, check=False, cwd=tmp_path_factory.mktemp("cwd"),
        env={"HF_HOME": str(tmp_path_factory.mktemp("hf_home")), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    for folder, logits in expected.items():
        torch.testing.assert_close(torch.tensor(remote[folder]), logits, atol=OTHER_PROCESS_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# What each method's weights must look like
# ---------------------------------------------------------------------------------------------------------------


def test_mhc_mixing_matrices_are_doubly_stochastic(input_ids):
    model = variant_model(EXACT_AT_INIT["mhc"])
    with torch.no_grad():
        weights = model(input_ids, output_depth_weights=True).depth_weights
    assert len(weights) == 2 * TINY["num_hidden_layers"]
    for h_res in weights:
        assert h_res.shape == (*input_ids.shape, 4, 4) and (h_res >= 0).all()
        torch.testing.assert_close(h_res.sum(-1), torch.ones(h_res.shape[:-1]), atol=1e-4, rtol=0)
        torch.testing.assert_close(h_res.sum(-2), torch.ones(h_res.shape[:-1]), atol=1e-4, rtol=0)
        assert h_res.std(dim=(0, 1)).max() > 1e-4  # dynamic: it varies with the token


def test_mhc_permutation_mixing_changes_the_output(input_ids):
    model = variant_model(EXACT_AT_INIT["mhc"])
    connection = model.model.layers[1].attn_mhc
    outputs = {}
    for name, matrix in (("identity", torch.eye(4)), ("permutation", torch.eye(4)[[1, 2, 3, 0]])):
        with torch.no_grad():
            connection.alpha_res.zero_()  # static H_res = Sinkhorn(b_res)
            connection.b_res.copy_(torch.where(matrix > 0, 0.0, -30.0))
            out = model(input_ids, output_depth_weights=True)
        torch.testing.assert_close(out.depth_weights[2][0, 0], matrix, atol=1e-4, rtol=0)
        outputs[name] = out.logits
    assert (outputs["identity"] - outputs["permutation"]).abs().max() > 1e-3


def test_sinkhorn_on_a_hand_computed_matrix():
    # exp -> [[1, 3], [3, 1]]; rows normalise to [[1/4, 3/4], [3/4, 1/4]], which is already doubly stochastic.
    logits = torch.log(torch.tensor([[1.0, 3.0], [3.0, 1.0]]))
    torch.testing.assert_close(sinkhorn_knopp(logits, 1), torch.tensor([[0.25, 0.75], [0.75, 0.25]]))
    # [[1, 2], [3, 4]]: the limit is [[a, 1-a], [1-a, a]] with a/(1-a) ... odds ratio (1*4)/(2*3) = 2/3 -> a = 0.4495
    limit = sinkhorn_knopp(torch.log(torch.tensor([[1.0, 2.0], [3.0, 4.0]])), 50)
    a = (2 / 3) ** 0.5 / (1 + (2 / 3) ** 0.5)
    torch.testing.assert_close(limit, torch.tensor([[a, 1 - a], [1 - a, a]]), atol=1e-6, rtol=0)


def test_muddformer_four_streams_are_distinct_inputs_of_q_k_v_and_the_residual(input_ids):
    model = variant_model(EXACT_AT_INIT["muddformer"])
    layer = model.model.layers[1]
    seen = {}
    hooks = [model.model.layers[0].mudd.register_forward_hook(lambda m, a, out: seen.update(streams=out[0]))]
    for key in ("q_proj", "k_proj", "v_proj", "o_proj"):
        module = getattr(layer.self_attn, key)
        hooks.append(module.register_forward_hook(lambda m, a, out, key=key: seen.update({key: (a[0], out)})))
    hooks.append(layer.post_attention_layernorm.register_forward_hook(lambda m, a, out: seen.update(mlp_in=a[0])))
    with torch.no_grad():
        model(input_ids)
    for hook in hooks:
        hook.remove()
    streams = seen["streams"]
    assert len(streams) == 4
    for i in range(4):
        for j in range(i):
            assert (streams[i] - streams[j]).abs().max() > 1e-3, (i, j)
    for index, key in enumerate(("q_proj", "k_proj", "v_proj")):
        torch.testing.assert_close(seen[key][0], layer.input_layernorm(streams[index]))
    torch.testing.assert_close(seen["mlp_in"], streams[3] + seen["o_proj"][1])  # residual stream + attention


def test_dca_weights_vary_per_feature_and_start_at_one(input_ids):
    fresh = variant_model(EXACT_AT_INIT["dca"], perturb=False)
    model = variant_model(EXACT_AT_INIT["dca"])
    with torch.no_grad():
        initial = fresh(input_ids, output_depth_weights=True).depth_weights
        weights = model(input_ids, output_depth_weights=True).depth_weights
    assert [w.shape[2:4] for w in weights] == [(3, 1), (3, 2), (3, 3), (1, 4)]
    assert all(torch.equal(w, torch.ones_like(w)) for w in initial)
    for w in weights:
        assert w.shape[-1] == TINY["hidden_size"]
        assert w.std(dim=-1).min() > 1e-3  # per feature: every (token, output, source) row varies over features
    assert weights[1][0, 0].std(dim=-1).max() > 1e-3 and (weights[1][0, 0] != weights[1][0, 1]).any()  # per token


@pytest.mark.parametrize("name", list(EXACT_AT_INIT))
def test_every_mixing_parameter_family_learns_from_the_initialisation(name, input_ids):
    """From the residual-exact initialisation the mixing must be able to move: no parameter group stuck at zero
    gradient (e.g. DCA's ReLU(w . k) with w = 0 under torch's ReLU'(0) = 0), except those that are constant by
    construction at step 0 (the first AttnRes router has one source; MUDDFormer's w1 sits behind w2 = 0; mHC's
    gates multiply phi = 0; with equal streams H_res does not change the output; Delta AttnRes's pseudo-queries sit
    behind its gates = 0, and learn once the gates have moved, checked after one step)."""
    model = variant_model(EXACT_AT_INIT[name], perturb=False).train()
    model(input_ids, labels=input_ids).loss.backward()
    delta = model.config.depth_mixing == "delta_attnres"
    exempt = ("layers.0.attn_res.", ".w1", "alpha_pre", "alpha_post", "alpha_res", "b_res", "phi_res",
              *((".query",) if delta else ()))
    for param_name, param in model.named_parameters():
        if is_depth_mixing_parameter(param_name) and "key_norm" not in param_name:
            if not any(k in param_name for k in exempt):
                assert param.grad is not None and param.grad.abs().sum() > 0, param_name
    if delta:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith(".gate"):
                    param.sub_(param.grad.sign() * 0.1)  # one sign-SGD step of the gates (Adam's first step)
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        queries = {n: p for n, p in model.named_parameters() if n.endswith(".query") and "layers.0.attn_res" not in n}
        assert queries and all(p.grad.abs().sum() > 0 for p in queries.values())


def test_invalid_combinations_raise_value_errors_naming_the_rule():
    cases = [
        ({"depth_mixing": "residual", "mhc_num_streams": 2}, "mhc_num_streams only apply to depth_mixing='mhc'"),
        ({"depth_mixing": "mhc", "attnres_score_fn": "sigmoid"},
         "attnres_score_fn only apply to depth_mixing='attnres'"),
        ({"depth_mixing": "dca", "denseformer_period": 2}, "denseformer_period only apply"),
        ({"depth_mixing": "mhc", "mhc_num_streams": 1}, "mhc_num_streams must be greater or equal to 2, got 1"),
        ({"attnres_score_fn": "relu"}, "attnres_score_fn must be one of ('softmax', 'sigmoid'), got relu"),
        ({"attnres_query": "dynamic"}, "attnres_query must be one of ('static', 'input_dependent'), got dynamic"),
        ({"attnres_num_heads": 3}, "attnres_num_heads (3) must divide hidden_size (32)"),
        ({"attnres_window": 0}, "attnres_window must be a positive number of sources or None, got 0"),
        ({"attnres_scalar_weights": True, "attnres_num_heads": 2}, "attnres_scalar_weights=True replaces the query"),
        ({"depth_mixing": "denseformer", "denseformer_dilation": 0}, "denseformer_dilation must be greater or equal to 1"),
        ({"attnres_num_heads": 0}, "attnres_num_heads must be greater or equal to 1, got 0"),
        ({"attnres_key_norm": 1}, "attnres_key_norm must be bool, got int"),
        ({"hidden_size": "32"}, "hidden_size must be int, got str"),
    ]
    for overrides, rule in cases:
        with pytest.raises(ValueError) as error:
            tiny_config(**overrides)
        assert rule in str(error.value) and "\n" not in str(error.value), (overrides, str(error.value))


# ---------------------------------------------------------------------------------------------------------------
# Two-layer references: each method's update equation written out from its paper, on the model's own sub-layers
# ---------------------------------------------------------------------------------------------------------------

TWO_LAYERS = {"num_hidden_layers": 2, "attn_implementation": "sdpa"}


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TINY.get("rms_norm_eps", 1e-6))


class Parts:
    """The backbone's sub-layers of a 2-layer model, called directly (sdpa without a mask is causal)."""

    def __init__(self, model, input_ids):
        self.model, self.inner = model, model.model
        self.embedding = self.inner.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1])[None]
        self.rope = self.inner.rotary_emb(self.embedding, positions)

    def attn(self, i, q, k=None, v=None):
        """Llama attention written out (causal sdpa, GQA), with separate query, key and value inputs."""
        layer = self.inner.layers[i]
        attn, norm = layer.self_attn, layer.input_layernorm
        k, v = (q, q) if k is None else (k, v)
        shape = (*q.shape[:-1], -1, attn.head_dim)
        query, key, value = (proj(norm(x)).view(shape).transpose(1, 2)  # (B, heads, T, head_dim)
                             for proj, x in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)))
        query, key = apply_rotary_pos_emb(query, key, *self.rope)
        key, value = repeat_kv(key, attn.num_key_value_groups), repeat_kv(value, attn.num_key_value_groups)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(*q.shape[:-1], -1))

    def mlp(self, i, x):
        layer = self.inner.layers[i]
        return layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden):
        return self.model.lm_head(self.inner.norm(hidden))


def check(model, input_ids, reference_logits, reference_weights=None):
    out = model(input_ids, output_depth_weights=True)
    torch.testing.assert_close(out.logits, reference_logits, atol=1e-5, rtol=1e-5)
    if reference_weights is not None:
        assert len(out.depth_weights) == len(reference_weights)
        for actual, expected in zip(out.depth_weights, reference_weights):
            torch.testing.assert_close(actual, expected.expand_as(actual), atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_denseformer_two_layers_by_hand(input_ids):
    model = variant_model({"depth_mixing": "denseformer"}, **TWO_LAYERS)
    p = Parts(model, input_ids)
    a0, a1 = model.model.layers[0].dwa.alpha, model.model.layers[1].dwa.alpha
    b0 = p.embedding
    h = b0 + p.attn(0, b0)
    b1 = h + p.mlp(0, h)
    x1 = a0[0] * b0 + a0[1] * b1  # DWA_1 over B_0, B_1
    h = x1 + p.attn(1, x1)
    b2 = h + p.mlp(1, h)
    x2 = a1[0] * b0 + a1[1] * b1 + a1[2] * b2  # DWA_2 over B_0, B_1, B_2
    check(model, input_ids, p.logits(x2), [a0, a1])

    # dilation 2, period 2: no DWA after layer 1; DWA_2 averages B_0 and B_2 only (0 = 2 mod 2)
    model = variant_model({"depth_mixing": "denseformer", "denseformer_dilation": 2, "denseformer_period": 2},
                          **TWO_LAYERS)
    assert model.model.layers[0].dwa is None
    p = Parts(model, input_ids)
    a1 = model.model.layers[1].dwa.alpha
    b0 = p.embedding
    h = b0 + p.attn(0, b0)
    b1 = h + p.mlp(0, h)
    h = b1 + p.attn(1, b1)
    b2 = h + p.mlp(1, h)
    check(model, input_ids, p.logits(a1[0] * b0 + a1[1] * b2), [a1])


@torch.no_grad()
def test_muddformer_two_layers_by_hand(input_ids):
    model = variant_model({"depth_mixing": "muddformer"}, **TWO_LAYERS)
    p = Parts(model, input_ids)

    def da(mudd, xs, streams):  # A = GELU(RMSNorm(X_last) W1) W2 + static, per stream over X_0 .. X_last
        a = F.gelu(rms(xs[-1]) @ mudd.w1.T) @ mudd.w2.T
        a = a.reshape(*a.shape[:-1], streams, len(xs)) + mudd.static_weights
        return [sum(a[..., c, j:j + 1] * xs[j] for j in range(len(xs))) for c in range(streams)], a

    x0 = p.embedding
    h = x0 + p.attn(0, x0, x0, x0)
    x1 = h + p.mlp(0, h)
    (q, k, v, r), a0 = da(model.model.layers[0].mudd, [x0, x1], 4)
    h = r + p.attn(1, q, k, v)
    x2 = h + p.mlp(1, h)
    (out,), a1 = da(model.model.layers[1].mudd, [x0, x1, x2], 1)
    check(model, input_ids, p.logits(out), [a0, a1])


@torch.no_grad()
def test_dca_two_layers_by_hand(input_ids):
    model = variant_model({"depth_mixing": "dca"}, **TWO_LAYERS)
    p = Parts(model, input_ids)

    def grn(module, ys):  # x_c = sum_i (b_{c,i} + ReLU(w_c . RMSNorm(y_i))) * y_i, elementwise
        weights = torch.stack([module.bias[:, i] + F.relu(rms(y) @ module.proj.T).unsqueeze(-1)  # (B, T, C, D)
                               for i, y in enumerate(ys)], dim=-2)  # (B, T, C, n, D)
        return [sum(weights[..., c, i, :] * y for i, y in enumerate(ys)) for c in range(module.proj.shape[0])], weights

    y0 = p.embedding
    (q, k, v), w0 = grn(model.model.layers[0].dca, [y0])
    a = p.attn(0, q, k, v)
    y1 = a + p.mlp(0, q + a)
    (q, k, v), w1 = grn(model.model.layers[1].dca, [y0, y1])
    a = p.attn(1, q, k, v)
    y2 = a + p.mlp(1, q + a)
    (out,), w2 = grn(model.model.final_dca, [y0, y1, y2])
    check(model, input_ids, p.logits(out), [w0, w1, w2])


@torch.no_grad()
@pytest.mark.parametrize("streams", [4, 2])
def test_mhc_two_layers_by_hand(streams, input_ids):
    model = variant_model({"depth_mixing": "mhc", "mhc_num_streams": streams}, **TWO_LAYERS)
    p = Parts(model, input_ids)
    x = [p.embedding] * streams  # n copies of the embedding
    residuals = []
    for sublayer in range(4):
        layer = model.model.layers[sublayer // 2]
        hc = layer.attn_mhc if sublayer % 2 == 0 else layer.mlp_mhc
        flat = rms(torch.cat(x, dim=-1))  # RMSNorm(vec X), 1 x nD
        h_pre = torch.sigmoid(hc.alpha_pre * flat @ hc.phi_pre + hc.b_pre)
        h_post = 2 * torch.sigmoid(hc.alpha_post * flat @ hc.phi_post + hc.b_post)
        m = torch.exp(hc.alpha_res * (flat @ hc.phi_res).unflatten(-1, (streams, streams)) + hc.b_res)
        for _ in range(model.config.mhc_sinkhorn_iterations):  # Sinkhorn-Knopp: rows, then columns
            m = m / m.sum(-1, keepdim=True)
            m = m / m.sum(-2, keepdim=True)
        branch_input = sum(h_pre[..., k:k + 1] * x[k] for k in range(streams))
        out = p.attn(sublayer // 2, branch_input) if sublayer % 2 == 0 else p.mlp(sublayer // 2, branch_input)
        x = [sum(m[..., i, j:j + 1] * x[j] for j in range(streams)) + h_post[..., i:i + 1] * out
             for i in range(streams)]
        residuals.append(m)
    check(model, input_ids, p.logits(sum(x) / streams), residuals)


def attnres_reference(model, input_ids):
    """Full AttnRes (block size 1) with the model's knobs, written out: sources v_0 = embedding, v_i = outputs."""
    config, p = model.config, Parts(model, input_ids)
    routers = [r for layer in model.model.layers for r in (layer.attn_res, layer.mlp_res)] + [model.model.final_res]
    sources, all_weights = [p.embedding], []
    for sublayer, router in enumerate(routers):
        visible = sources
        if config.attnres_window is not None and len(sources) - 1 > config.attnres_window:
            visible = [sources[0], *sources[len(sources) - config.attnres_window:]]
        values = torch.stack(visible, dim=-2)  # (B, T, n, D)
        if config.attnres_scalar_weights:
            logits = router.logits.expand(*values.shape[:-1])
        else:
            keys = rms(values) * router.key_norm.weight if config.attnres_key_norm else values
            query = router.query
            if config.attnres_query == "input_dependent":
                query = query + rms(visible[-1]) @ router.query_proj.T / config.hidden_size  # (B, T, D)
            heads = config.attnres_num_heads
            query = query.unflatten(-1, (heads, -1)).expand(*values.shape[:2], heads, -1)  # (B, T, H, D/H)
            logits = torch.einsum("btnhe,bthe->bthn", keys.unflatten(-1, (heads, -1)), query)
            logits = logits.squeeze(-2) if heads == 1 else logits
        weights = torch.sigmoid(logits) if config.attnres_score_fn == "sigmoid" else torch.softmax(logits, -1)
        all_weights.append(weights)
        if weights.dim() == 3:
            hidden = (weights.unsqueeze(-1) * values).sum(-2)
        else:  # per head: head h mixes its slice of the sources with its own weights
            hidden = torch.einsum("bthn,btnhe->bthe", weights, values.unflatten(-1, (weights.shape[2], -1))).flatten(-2)
        if sublayer == len(routers) - 1:
            return p.logits(hidden), all_weights
        sources.append(p.attn(sublayer // 2, hidden) if sublayer % 2 == 0 else p.mlp(sublayer // 2, hidden))


KNOBS = {
    "sigmoid": {"attnres_score_fn": "sigmoid"},
    "no-key-norm": {"attnres_key_norm": False},
    "window1": {"attnres_window": 1},
    "input-query": {"attnres_query": "input_dependent"},
    "heads4": {"attnres_num_heads": 4},
    "scalar": {"attnres_scalar_weights": True},
}


@torch.no_grad()
@pytest.mark.parametrize("knob", list(KNOBS))
def test_attnres_ablation_knobs_two_layers_by_hand(knob, input_ids):
    model = variant_model({"attnres_block_size": 1, **KNOBS[knob]}, **TWO_LAYERS)
    logits, weights = attnres_reference(model, input_ids)
    check(model, input_ids, logits, weights)


@torch.no_grad()
@pytest.mark.parametrize("block_size", [1, 2])
def test_delta_attnres_two_layers_by_hand(block_size, input_ids):
    """Delta AttnRes (arXiv:2605.18855) written out: the residual stream x kept, each sub-layer reads
    `x + gate * softmax_i(w . RMSNorm(v_i)) v_i` over AttnRes's sources (the embedding, then the sub-layer outputs;
    with blocks of 2: the completed blocks' sums and the current block's partial sum); the final norm reads x."""
    model = variant_model({"depth_mixing": "delta_attnres", "attnres_block_size": block_size}, **TWO_LAYERS)
    p = Parts(model, input_ids)
    routers = [r for layer in model.model.layers for r in (layer.attn_res, layer.mlp_res)]
    x, completed, partial, all_weights = p.embedding, [p.embedding], None, []
    for sublayer, router in enumerate(routers):
        if sublayer % block_size == 0 and partial is not None:  # a block closes
            completed, partial = [*completed, partial], None
        values = torch.stack(completed + ([partial] if partial is not None else []), dim=-2)  # (B, T, n, D)
        weights = torch.softmax(rms(values) * router.key_norm.weight @ router.query, dim=-1)
        all_weights.append(weights)
        h = x + router.gate * (weights.unsqueeze(-1) * values).sum(-2)
        out = p.attn(sublayer // 2, h) if sublayer % 2 == 0 else p.mlp(sublayer // 2, h)
        x, partial = x + out, out if partial is None else partial + out
    assert all(router.gate.abs() > 0.05 for router in routers)  # (perturbed: the reads enter the inputs)
    check(model, input_ids, p.logits(x), all_weights)


# ---------------------------------------------------------------------------------------------------------------
# The method records: one home per fact, read by the model, the recipes and the tools
# ---------------------------------------------------------------------------------------------------------------


def test_every_attnres_knob_has_a_test_variant():
    from utils import ATTNRES_KNOBS

    knobs = {name for overrides in ATTNRES_KNOBS.values() for name in overrides}
    assert knobs == set(DEPTH_MIXING["attnres"].config_fields)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_record_describes_the_models_modules_and_parameters(name):
    model = variant_model(VARIANTS[name], perturb=False)
    method = DEPTH_MIXING[model.config.depth_mixing]
    mixing = {n: m for n, m in model.named_modules() if isinstance(m, MIXING_MODULES)}
    assert all(isinstance(m, method.module_classes) for m in mixing.values())
    assert {n.split(".")[-1] for n in mixing} == set(method.module_names) - {None}  # DenseFormer p>1: empty slots
    for module_name in mixing:  # prefixes: model.layers.N.<field> and model.<field>
        field = module_name.split(".")[-1]
        expected = (f"model.layers.{module_name.split('.')[2]}.{field}" if field in method.layer_modules._fields
                    else f"model.{field}")
        assert module_name == expected
    params = dict(model.named_parameters())
    mixing_params = {f"{m}.{p}": param for m, module in mixing.items() for p, param in module.named_parameters()}
    assert depth_mixing_parameters(model).keys() == mixing_params.keys()
    assert model.num_depth_mixing_parameters() == sum(p.numel() for p in mixing_params.values())
    assert sum(p.numel() for n, p in params.items() if is_depth_mixing_parameter(n)) == model.num_depth_mixing_parameters()
    for key in method.no_weight_decay:  # each declared name exists in this method's modules (under some knob)
        assert any(n.endswith("." + key) for n in mixing_params) or name.startswith("attnres"), key
    assert modules_to_not_convert(model.config) == list(method.module_names)


@pytest.mark.parametrize("overrides, expected", [
    ({}, 288), ({"attnres_query": "input_dependent"}, 2592), ({"attnres_key_norm": False}, 144),
    ({"attnres_scalar_weights": True}, 1 + 2 + 2 + 3 + 3 + 4 + 4 + 5 + 5),  # one logit per source of each router
    ({"attnres_num_heads": 2}, 288), ({"attnres_window": 2}, 288), ({"attnres_score_fn": "sigmoid"}, 288),
    ({"depth_mixing": "residual"}, 0),
], ids=["paper", "input-query", "no-key-norm", "scalar", "heads2", "window2", "sigmoid", "residual"])
def test_depth_mixing_parameters_are_counted_on_the_model(overrides, expected):
    """The issue's 4-layer, 16-wide Block model: 9 routers x (query 16 + key norm 16) = 288 by default."""
    from attnres_hf import AttnResConfig

    config = AttnResConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                           num_attention_heads=2, attnres_block_size=2, **overrides)
    assert AttnResForCausalLM(config).num_depth_mixing_parameters() == expected


def test_peft_wrapped_router_names_are_still_depth_mixing_parameters():
    assert is_depth_mixing_parameter("base_model.model.model.layers.0.attn_res.modules_to_save.default.query")
    assert is_no_weight_decay_parameter("base_model.model.model.layers.0.attn_res.modules_to_save.default.query")
    assert is_no_weight_decay_parameter("base_model.model.model.final_res.original_module.key_norm.weight")
    assert not is_no_weight_decay_parameter("model.layers.0.attn_res.query_proj")
    assert not is_depth_mixing_parameter("model.layers.0.self_attn.q_proj.weight")
    assert not is_depth_mixing_parameter("model.layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("name", [n for n in VARIANTS | EXTRA_VARIANTS if VARIANTS.get(n, {}).get("depth_mixing") != "residual"])
def test_weight_decay_leaves_what_the_record_declares_unchanged(name, tmp_path):
    """Issue 15 item 7: zero-gradient AdamW steps (lr 1e-3, weight decay 0.1) must not move a parameter whose initial
    value encodes the residual path (mHC's H_pre stays a distribution), while the decayed ones shrink."""
    from transformers import TrainingArguments

    from attnres_hf.training.trainer import AttnResTrainer

    model = variant_model((VARIANTS | EXTRA_VARIANTS)[name], perturb=False).train()
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.1, report_to=[],
                             use_cpu=True, save_strategy="no")
    trainer = AttnResTrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(10):
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
    kept = [n for n in before if is_no_weight_decay_parameter(n)]
    assert kept, "the record declares no parameter out of decay"
    for n in kept:
        assert torch.equal(dict(model.named_parameters())[n], before[n]), n
    decayed = [n for n, p in model.named_parameters() if n.endswith("q_proj.weight")]
    assert all(not torch.equal(dict(model.named_parameters())[n], before[n]) for n in decayed)  # decay is on
    if model.config.depth_mixing == "mhc":
        connection = model.model.layers[0].attn_mhc
        torch.testing.assert_close(torch.sigmoid(connection.b_pre).sum(), torch.tensor(1.0))  # H_pre at equal streams


@pytest.mark.parametrize("name", list(VARIANTS | EXTRA_VARIANTS))
def test_attnres_info_prints_the_models_own_mixing_parameter_count(name, tmp_path, capsys):
    from attnres_hf.cli import main

    model = variant_model((VARIANTS | EXTRA_VARIANTS)[name], perturb=False)
    model.config.save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("mixing parameters"))
    assert line.split()[2] == f"{model.num_depth_mixing_parameters():,}"
