"""`attnres_implementation="fla"`: flash-linear-attention's fused AttnRes read (`fla.ops.attnres.fused_attnres`,
Triton on CUDA) for the direct router reads: the config field, its refusals, the dispatch and its numbers.

On CPU fla's kernel refuses the tensors, so the dispatch is checked with a stand-in for `fused_attnres`: fla's own
torch reference `naive_attnres` (the same signature; fp32 inside, one cast back), or a wrapper of it that saves its
sources for backward as fla's kernel does (`fla_like`); the CPU check of `attnres_fla._on_cuda` is passed for them.
The GPU tests run the kernel itself, where CUDA and fla are.
"""

import json
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.modeling import attnres_buffer, attnres_fla, ops, torch_internals
from attnres_hf.modeling.attnres_reference import attnres_num_sources
from attnres_hf.modeling.mixing_attnres import AttnResRouter, AttnResState
from test_two_phase import saved_source_bytes
from utils import ATTNRES_KNOBS, TINY, tiny_config, tiny_model

SUBLAYERS = 2 * TINY["num_hidden_layers"]
DEVICE = "cuda"  # of the GPU tests


@pytest.fixture
def naive():
    """fla's `naive_attnres` (skips where fla is not installed; never at module level)."""
    return pytest.importorskip("fla.ops.attnres").naive_attnres


@pytest.fixture
def stand_in(monkeypatch, naive):
    """Make `naive_attnres` the "kernel" of `attnres_implementation="fla"` on CPU and record every call."""
    calls = []

    def fused(query, residuals, rms_weight, *args, **kwargs):
        calls.append((query, list(residuals), rms_weight, args, kwargs))
        return naive(query, residuals, rms_weight, *args, **kwargs)

    monkeypatch.setattr(attnres_fla, "_fused_attnres", lambda: fused)
    monkeypatch.setattr(attnres_fla, "_on_cuda", lambda tensor: True)
    return calls


def routers(model) -> list[AttnResRouter]:
    """The model's routers in depth order (`layers.0.attn_res`, `layers.0.mlp_res`, ..., `final_res`)."""
    layers = model.model.layers
    return [r for layer in layers for r in (layer.attn_res, layer.mlp_res)] + [model.model.final_res]


def run(model, input_ids, **kwargs):
    """Logits, depth weights and every parameter's gradient of one training step."""
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    out = model(input_ids, **kwargs)
    (out.logits.float() @ projection.to(out.logits.device)).square().mean().backward()
    weights = [w.detach() for w in out.depth_weights] if out.depth_weights else None
    return out.logits.detach().float(), weights, {n: p.grad.float() for n, p in model.named_parameters()
                                                  if p.grad is not None}


def pair(input_ids, dtype=torch.float32, **overrides):
    """The same tiny model (trained-like routers) with `attnres_implementation` "torch" and "fla", run by `run`."""
    results = {}
    for implementation in ("torch", "fla"):
        model = tiny_model(attnres_implementation=implementation, **overrides).train().to(dtype)
        results[implementation] = run(model, input_ids)
    return results["torch"], results["fla"]


# ---------------------------------------------------------------------------------------------------------------
# (a) The config field
# ---------------------------------------------------------------------------------------------------------------


def test_implementation_defaults_to_torch_saves_and_reloads(tmp_path):
    assert tiny_config().attnres_implementation == "torch"
    config = tiny_config(attnres_block_size=1, attnres_implementation="fla")
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attnres_implementation"] == "fla"
    assert AttnResConfig.from_pretrained(tmp_path).attnres_implementation == "fla"


def test_from_pretrained_kwarg_sets_the_implementation(tmp_path, stand_in, input_ids):
    """Like `attn_implementation`: a keyword of `from_pretrained`, on a checkpoint saved with "torch"."""
    tiny_model(attnres_block_size=1).save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, attnres_implementation="fla").attnres_implementation == "fla"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attnres_implementation="fla").eval()
    assert model.config.attnres_implementation == "fla"
    with torch.no_grad():
        model(input_ids)
    assert len(stand_in) == model.config.num_sublayers + 1  # every router of Full AttnRes reads directly
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.attnres_implementation == "torch"


# ---------------------------------------------------------------------------------------------------------------
# (b) Refusals
# ---------------------------------------------------------------------------------------------------------------


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match=r"^attnres_implementation must be one of \('torch', 'fla', 'triton', 'naive'\), got "
                                         r"flash$"):
        tiny_config(attnres_implementation="flash")


@pytest.mark.parametrize("knob", [*ATTNRES_KNOBS, "residual"])
def test_fla_refuses_each_knob_it_does_not_compute(knob, tmp_path):
    """At construction, on assignment (the config left as it was) and as a `from_pretrained` keyword, naming the
    knob."""
    overrides = {"depth_mixing": "residual"} if knob == "residual" else ATTNRES_KNOBS[knob]
    name = next(iter(overrides))
    rule = rf"^attnres_implementation='fla' needs {name}=.*, got {name}="
    with pytest.raises(ValueError, match=rule) as error:
        tiny_config(attnres_implementation="fla", **overrides)
    assert "\n" not in str(error.value)
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match=rule):
        config.attnres_implementation = "fla"
    assert config.attnres_implementation == "torch"
    if knob == "sigmoid":
        AttnResForCausalLM(config).save_pretrained(tmp_path)
        with pytest.raises(ValueError, match=rule):
            AutoModelForCausalLM.from_pretrained(tmp_path, attnres_implementation="fla")


def test_fla_not_importable_is_refused_at_model_construction(monkeypatch):
    config = tiny_config(attnres_implementation="fla")  # a config needs no fla
    monkeypatch.setitem(sys.modules, "fla.ops.attnres", None)  # what an environment without fla raises
    with pytest.raises(ImportError, match=r'pip install "attnres-hf\[fla\]"'):
        AttnResForCausalLM(config)


def test_fla_on_cpu_tensors_is_refused_at_the_forward(monkeypatch, input_ids):
    monkeypatch.setattr(attnres_fla, "_fused_attnres", lambda: pytest.fail)  # never called: ours comes first
    model = tiny_model(attnres_block_size=2, attnres_implementation="fla")
    with pytest.raises(ValueError, match=r"^attnres_implementation='fla' needs CUDA tensors .* got cpu tensors; "
                                         r"use attnres_implementation='torch' on cpu$") as error:
        model(input_ids)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# (c) Dispatch on CPU, with the stand-in kernel
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_partial", [False, True], ids=["full", "block-partial"])
def test_the_fla_op_on_tensors_equals_the_reference(stand_in, with_partial):
    """`ops_fla.attnres` (the registry's "fla" read, one signature) on plain tensors with gradients, fla's autograd
    run inside `_FusedRead` over a buffer of them: the output and the gradients of the sources, the partial sum, the
    query and the key-norm weight of `ops_naive.attnres` in float64 (fp32 round-off: measured under 2e-7 of each
    tensor's largest element, bound 2e-6); with depth weights asked for, the torch read's (fla returns none), without
    a call of fla."""
    generator = torch.Generator().manual_seed(3)
    sources = torch.randn(3, 2, 2, 16, generator=generator) * 2
    partial = torch.randn(2, 2, 16, generator=generator) if with_partial else None
    query, weight = torch.randn(16, generator=generator), 1 + 0.3 * torch.randn(16, generator=generator)
    grad = torch.randn(2, 2, 16, generator=generator)
    results = {}
    for name, dtype in (("fla", torch.float32), ("naive", torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in (sources, query, weight, partial) if t is not None]
        read = ops.get(name, "cpu")  # (`_on_cuda` passed for the stand-in)
        hidden, weights = read(leaves[0], leaves[1], leaves[2], partial=leaves[3] if with_partial else None,
                               eps=1e-6, return_weights=name == "naive")
        assert (weights is None) == (name == "fla")
        results[name] = (hidden, *torch.autograd.grad(hidden, leaves, grad.to(dtype)))
    assert len(stand_in) == 1
    for ours, reference in zip(results["fla"], results["naive"], strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), reference, atol=2e-6 * reference.abs().max().item(), rtol=0)
    stand_in.clear()
    _, weights = ops.get("fla", "cpu")(sources, query, weight, partial=partial, eps=1e-6)
    assert not stand_in and weights is not None



def test_direct_reads_call_fused_attnres_with_the_router_arguments(stand_in, input_ids):
    """Full AttnRes, inference: each router calls it once, with its own pseudo-query and key-norm weight (fla folds
    them itself), the config's epsilon, and its sources in depth order: the embedding, then each sub-layer's output."""
    model = tiny_model(attnres_block_size=1, attnres_implementation="fla")
    with torch.no_grad():
        embeddings = model.model.embed_tokens(input_ids)
        model(input_ids)
    assert len(stand_in) == len(routers(model))
    for sublayer, (router, (query, residuals, rms_weight, args, kwargs)) in enumerate(zip(routers(model), stand_in)):
        assert query is router.query and rms_weight is router.key_norm.weight
        assert args == () and kwargs == {"rms_eps": model.config.rms_norm_eps}
        assert len(residuals) == attnres_num_sources(model.config, sublayer)
        assert all(r.shape == embeddings.shape and r.dtype == embeddings.dtype for r in residuals)
        torch.testing.assert_close(residuals[0], embeddings, atol=0, rtol=0)  # a copy of the same values
    completed = stand_in[-1][1][:-1]  # the final router's, but its last source: the last sub-layer's output
    assert {r.untyped_storage().data_ptr() for r in completed} == {completed[0].untyped_storage().data_ptr()}


# Measured (CPU, fp32, the tiny model, every router trained-like): the fla path's logits differ from the torch path's by
# at most 4e-7 (logits ~0.4) and each gradient by at most 1.4e-5 of its largest element: another summation order
# (naive_attnres sums its weighted sources in fp32 in one einsum). Tolerances with margin: logits 1e-5, gradients
# test_two_phase's `assert_same_grad`.
FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rescale", [False, True], ids=["mean", "rescale"])
@pytest.mark.parametrize("block_size", [1, 2, 6], ids=["full", "block2", "block6-one"])
def test_fla_path_matches_the_torch_path_fp32(block_size, rescale, stand_in, input_ids):
    (logits, _, grads), (fla_logits, _, fla_grads) = pair(input_ids, attnres_block_size=block_size,
                                                          attnres_rescale_output=rescale)
    assert len(stand_in) == (SUBLAYERS + 1 if block_size == 1 else 1)  # Block: the final router only
    torch.testing.assert_close(fla_logits, logits, **FP32)
    assert fla_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert_same_grad(fla_grads[name], grad, name)


def assert_same_grad(grad, reference, name):
    atol = max(1e-5, 256 * torch.finfo(torch.float32).eps * reference.abs().max().item())
    torch.testing.assert_close(grad, reference, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# bf16 (the whole model, routers too) against the torch path's own bf16 error (its distance to fp32, a norm per tensor;
# a tiny random bf16 model's gradients are far from fp32's, up to 70% on some, so only that comparison means anything).
# Measured over 8 input draws: the fla path's logits are within 1.4x of it; its gradients within 1.0x for Block AttnRes
# and 3.7x for Full AttnRes, whose every read rounds its sources' gradients to bf16 (fla's kernel writes them in the
# sources' dtype; the torch path sums the score terms of all reads in fp32). Bounds: 2x and 8x.
BF16_LOGITS, BF16_GRADS = 2.0, 8.0


def assert_within_bf16_rounding(fla, torch_bf16, fp32):
    """`(logits, _, grads)` of the fla path in bf16 against the torch path's in bf16 and in fp32 (see above)."""
    pairs = [(fla[0], torch_bf16[0], fp32[0], BF16_LOGITS),
             *[(fla[2][n], torch_bf16[2][n], fp32[2][n], BF16_GRADS) for n in fp32[2]]]
    for ours, theirs, exact, bound in pairs:
        rounding = (theirs - exact).norm()
        assert (ours - theirs).norm() <= bound * max(rounding, 1e-6 * exact.norm())


@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_fla_path_in_bf16_is_within_the_torch_paths_own_rounding(block_size, stand_in, input_ids):
    fp32 = pair(input_ids, attnres_block_size=block_size)[0]
    torch_bf16, fla_bf16 = pair(input_ids, torch.bfloat16, attnres_block_size=block_size)
    assert torch_bf16[0].abs().max() > 0.1 and fla_bf16[2].keys() == fp32[2].keys()
    assert_within_bf16_rounding(fla_bf16, torch_bf16, fp32)


def test_depth_weights_take_the_torch_path(stand_in, input_ids):
    """fla's kernel returns no depth weights: asked for, every read is the torch path's (the same numbers)."""
    results = {}
    for implementation in ("torch", "fla"):
        model = tiny_model(attnres_block_size=1, attnres_implementation=implementation).train()
        results[implementation] = run(model, input_ids, output_depth_weights=True)
    assert not stand_in
    (logits, weights, grads), (fla_logits, fla_weights, fla_grads) = results["torch"], results["fla"]
    torch.testing.assert_close(fla_logits, logits, atol=0, rtol=0)  # the same code: the same numbers
    assert len(fla_weights) == len(weights) == len(routers(model))
    for ours, theirs in zip(fla_weights, weights, strict=True):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert fla_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fla_grads[name], grad, atol=0, rtol=0, msg=name)


def test_two_phase_reads_keep_their_own_path(stand_in, input_ids, monkeypatch):
    merged = []
    monkeypatch.setattr(AttnResRouter, "_merge", lambda self, *a, _f=AttnResRouter._merge: merged.append(1) or _f(
        self, *a))
    model = tiny_model(attnres_block_size=2, attnres_implementation="fla")
    with torch.no_grad():
        model(input_ids)
    assert len(merged) == model.config.num_sublayers and len(stand_in) == 1  # the final router only
    assert stand_in[0][0] is model.model.final_res.query


@pytest.mark.parametrize("setup", ["summed-in-place", "per-source", "checkpointing", "inputs-embeds"])
def test_fla_gradients_reach_the_sources(setup, stand_in, input_ids, monkeypatch):
    """The sources' gradients from the fla reads join the buffer's readers' (`_SourceGrads`, summed in place in
    eager training), or go one per source (`per-source`: the path without it), under gradient checkpointing (the
    replayed layers rewrite their slots), and to `inputs_embeds` that require grad (a leaf source)."""
    if setup == "per-source":
        monkeypatch.setattr(torch_internals, "current_graph_task_id", None)  # (no in-place sums)
    results = {}
    for implementation in ("torch", "fla"):
        model = tiny_model(attnres_block_size=1, attnres_implementation=implementation).train()
        if setup == "checkpointing":
            model.gradient_checkpointing_enable()
        if setup == "inputs-embeds":
            embeds = model.model.embed_tokens(input_ids).detach().requires_grad_()
            out = model(inputs_embeds=embeds)
            out.logits.square().mean().backward()
            results[implementation] = embeds.grad
        else:
            results[implementation] = run(model, input_ids)[2]
    assert stand_in
    if setup == "inputs-embeds":
        assert_same_grad(results["fla"], results["torch"], "inputs_embeds")
        return
    assert results["fla"].keys() == results["torch"].keys()
    for name, grad in results["torch"].items():
        assert_same_grad(results["fla"][name], grad, name)


class _SavesItsSources(torch.autograd.Function):
    """`naive_attnres` saving the sources it is given for backward, as fla's kernel does
    (`FusedAttnresFunction.forward`: `ctx.save_for_backward(..., *residuals)`), and recomputing in backward."""

    @staticmethod
    def forward(ctx, naive, query, weight, eps, *residuals):
        ctx.save_for_backward(query, weight, *residuals)
        ctx.naive, ctx.eps = naive, eps
        return naive(query, residuals, weight, rms_eps=eps)

    @staticmethod
    def backward(ctx, grad):
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.naive(leaves[0], leaves[2:], leaves[1], rms_eps=ctx.eps)
        grad_query, grad_weight, *grad_sources = torch.autograd.grad(out, leaves, grad)
        return None, grad_query, grad_weight, None, *grad_sources


def test_fla_keeps_the_sources_once(monkeypatch, naive, input_ids):
    """The fla reads get views of the source buffer, not the source tensors: with a kernel that saves what it is given
    (as fla's does), Full AttnRes training saves exactly the torch path's source bytes (the buffer once). Measured:
    given the original source tensors instead, it saved one more source per sub-layer (2 more per layer)."""
    def fla_like(query, residuals, rms_weight, rms_eps):
        return _SavesItsSources.apply(naive, query, rms_weight, rms_eps, *residuals)

    monkeypatch.setattr(attnres_fla, "_fused_attnres", lambda: fla_like)
    monkeypatch.setattr(attnres_fla, "_on_cuda", lambda tensor: True)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    for layers in (2, 4):
        saved = {implementation: saved_source_bytes(tiny_model(
            attnres_block_size=1, num_hidden_layers=layers, hidden_size=64, attnres_implementation=implementation
        ).train(), input_ids) for implementation in ("torch", "fla")}
        assert saved["fla"] == saved["torch"], saved


# ---------------------------------------------------------------------------------------------------------------
# (d) The kernel itself, on CUDA
# ---------------------------------------------------------------------------------------------------------------


def fla_on_cuda():
    """fla's ops where CUDA and fla are, else skip (inside the tests: a module-level skip would skip them all)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return pytest.importorskip("fla.ops.attnres")


# Not measured on a GPU in the session that wrote them (it had none): fp32 from the round-off of another summation
# order, with margin; in bf16 both compute in fp32 and cast once, so 2 bf16 ulps (of the largest element, at least 1).
KERNEL = {torch.float32: 1e-5, torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_attnres_matches_naive_attnres_on_cuda(dtype):
    """fla's kernel against its reference at tiny shapes (7 sources, `(2, 5, 64)`): outputs and gradients to the
    query, the key-norm weight and every source; the depth weights our torch router returns against the reference's."""
    ops = fla_on_cuda()
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 5, 64, generator=generator).to(DEVICE, dtype) for _ in range(7)]
    query = torch.randn(64, generator=generator).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(64, generator=generator)).to(DEVICE)
    outputs = {}
    for name, read in (("fused", ops.fused_attnres), ("naive", ops.naive_attnres)):
        leaves = [t.clone().requires_grad_() for t in (query, weight, *sources)]
        out = read(leaves[0], leaves[2:], leaves[1], rms_eps=1e-6)
        out.float().square().sum().backward()
        outputs[name] = [out.detach(), *(leaf.grad for leaf in leaves)]
    for fused, naive in zip(outputs["fused"], outputs["naive"], strict=True):
        tolerance = KERNEL[dtype]
        torch.testing.assert_close(fused.float(), naive.float(), atol=tolerance * max(naive.abs().max().item(), 1.0),
                                   rtol=max(tolerance, 1e-4))
    config = tiny_config(hidden_size=64, rms_norm_eps=1e-6)
    router = AttnResRouter(config, 6).to(DEVICE)
    with torch.no_grad():
        router.query.copy_(query)
        router.key_norm.weight.copy_(weight)
    _, reference = ops.naive_attnres(query, sources, weight, rms_eps=1e-6, return_weights=True)  # (n, B, T)
    buffer = torch.stack(sources)  # (n, B, T, D): the source buffer
    state = AttnResState(tuple(sources), torch.stack([attnres_buffer.inverse_rms(s, 1e-6) for s in sources], -1),
                         None, 1e-6, 1, 6, buffer, handles=tuple(sources), implementation="fla", keep_weights=True)
    _, weights = router(state)  # depth weights asked for: the torch path
    torch.testing.assert_close(weights, reference.permute(1, 2, 0).float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_fla_model_matches_torch_on_cuda(block_size, input_ids):
    """A whole tiny model on CUDA: "fla" against "torch", fp32 within the CPU tolerances above, bf16 within the bounds
    of the CPU bf16 test (`assert_within_bf16_rounding`)."""
    fla_on_cuda()
    input_ids = input_ids.to(DEVICE)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for implementation in ("torch", "fla"):
            model = tiny_model(attnres_block_size=block_size, attnres_implementation=implementation)
            results[dtype, implementation] = run(model.train().to(DEVICE, dtype), input_ids)
    (logits, _, grads), (fla_logits, _, fla_grads) = results[torch.float32, "torch"], results[torch.float32, "fla"]
    torch.testing.assert_close(fla_logits, logits, **FP32)
    for name, grad in grads.items():
        assert_same_grad(fla_grads[name], grad, name)
    assert_within_bf16_rounding(results[torch.bfloat16, "fla"], results[torch.bfloat16, "torch"],
                                results[torch.float32, "torch"])
