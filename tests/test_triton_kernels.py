"""`attnres_implementation="triton"`: the fused kernels of two-phase Block AttnRes (`attnres_kernels.py`: phase 1
and the merge, forward and backward) run here on CPU tensors in Triton's interpreter (`TRITON_INTERPRET=1`), on tiny
shapes: against `naive_attnres` (the paper's Eq. 1-4) in float64 on outputs, depth weights and gradients, fp32 and
bf16; a whole model against the torch path (logits, depth weights, every gradient, the in-place and the per-source
gradient sums, inference, generation); the config's refusals; and the fallbacks (`torch.compile`, CPU without the
interpreter).

Tolerances, from measured errors (this machine, these shapes): the kernels in fp32 are within 1.4e-5 of float64 on
every output and gradient, relative to the largest value (bound 5e-5); in bf16, where outputs and gradients are bf16
roundings of fp32 arithmetic, within 1.2e-2 (bound 2e-2; bf16 keeps 8 bits). A whole fp32 model differs from the
torch path by at most 2e-6 of the largest logit and 1.4e-5 of a parameter's largest gradient (bound 1e-4). In bf16
the two paths round differently (the kernels compute in fp32 and round once, but add each read's source gradients to
the sums in bf16; the torch path rounds some products to bf16 and sums the score terms in fp32), and a tiny random
model's bf16 gradients are 1-6% from float64 either way: each path against a float64 run of the torch path, all
gradients as one vector (relative Frobenius error), the kernels within 2x the torch path's error plus 1e-2 (measured
over 4 seeds x Full/Block: the ratio was 0.46-1.47).
"""

import pytest
import torch

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.modeling import torch_internals
from attnres_hf.modeling.attnres_reference import naive_attnres
from utils import tiny_config, tiny_model

pytest.importorskip("triton")

EPS = 1e-6
FP32_KERNEL, BF16_KERNEL = 5e-5, 2e-2


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the kernels run: compiled on CUDA, else on CPU tensors in Triton's interpreter (`conftest.py` sets
`TRITON_INTERPRET=1` before Triton is imported)."""


@pytest.fixture(scope="module")
def kernels():
    from attnres_hf.modeling import attnres_kernels
    if DEVICE == "cpu" and not attnres_kernels.INTERPRETED:
        pytest.skip("Triton's interpreter is off: run with TRITON_INTERPRET=1 set before Triton is imported")
    return attnres_kernels


class on_device:  # noqa: N801 (a wrapper used like a function)
    """The kernels' launchers with their tensor arguments moved to `DEVICE` (written-to arguments copied back) and
    their results brought back to the CPU: the same tests on CUDA and in the interpreter."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name):
        launcher = getattr(self.kernels, name)

        def call(*args):
            moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
            out = launcher(*moved)
            for arg, copy in zip(args, moved):
                if isinstance(arg, torch.Tensor) and copy is not arg:
                    arg.copy_(copy)
            return tuple(o.cpu() if isinstance(o, torch.Tensor) else o for o in out)

        return call


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max().clamp_min(1e-30)).item()


def frobenius(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).norm() / reference.double().norm()).item()


def reference_router(sources, query, weight, key_norm: bool):
    """One router over `sources` in float64: `naive_attnres` with the key norm, else `softmax(w . v_i)`."""
    if key_norm:
        return naive_attnres(sources, query, weight, EPS)
    values = torch.stack(sources, dim=-2)
    weights = torch.softmax(values @ query, dim=-1)
    return (weights.unsqueeze(-1) * values).sum(-2), weights


SHAPES = [  # (completed sources n, routers S, hidden D, batch, tokens)
    (1, 1, 32, 1, 1), (3, 4, 40, 2, 3), (5, 3, 64, 1, 5), (2, 2, 24, 3, 1), (4, 1, 32, 2, 11)]


@pytest.mark.parametrize("key_norm", [True, False], ids=["key_norm", "no_key_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-S{}-D{}-B{}-T{}".format(*s))
def test_phase1_and_merge_equal_naive_attnres(kernels, shape, dtype, key_norm):
    """Phase 1 over `n` completed sources for `S` routers, then each router's merge of one partial sum: the output
    and depth weights of `naive_attnres` over the `n + 1` sources, and the gradients of a random projection of
    both with respect to the sources, the pseudo-queries and the key-norm weights (float64 autograd)."""
    kernels = on_device(kernels)
    n, S, dim, batch, seq = shape
    generator = torch.Generator().manual_seed(sum(shape))
    values = (torch.randn(n, batch, seq, dim, generator=generator) * 2).to(dtype)
    partial = torch.randn(batch, seq, dim, generator=generator).to(dtype)
    queries = torch.randn(S, dim, generator=generator)
    weights = 1 + 0.3 * torch.randn(S, dim, generator=generator)
    up_hidden = torch.randn(S, batch, seq, dim, generator=generator)
    up_weights = torch.randn(S, batch, seq, n + 1, generator=generator)

    # float64 reference by autograd
    ref_in = [t.double().requires_grad_() for t in (values, partial, queries, weights)]
    ref_loss, ref_out = 0, []
    for s in range(S):
        hidden, alpha = reference_router([*ref_in[0].unbind(0), ref_in[1]], ref_in[2][s], ref_in[3][s], key_norm)
        ref_out.append((hidden, alpha))
        ref_loss = ref_loss + (hidden * up_hidden[s].double()).sum() + (alpha * up_weights[s].double()).sum()
    ref_loss.backward()

    # the kernels, with their backward given the same upstream gradients (by autograd of the cheap torch glue)
    folded = (queries * weights if key_norm else queries).contiguous()
    values_f = values.float()
    inv_rms = torch.rsqrt(values_f.pow(2).mean(-1) + EPS).permute(1, 2, 0).contiguous() if key_norm else None
    probs, lse, mixed = kernels.phase1_forward(values.contiguous(), inv_rms, folded)
    grad_mixed, grad_lse, grad_probs = torch.zeros_like(mixed, dtype=torch.float32), torch.zeros_like(lse), \
        torch.zeros_like(probs)
    grad_partial, grad_folded = torch.zeros(batch, seq, dim), torch.zeros(S, dim)
    scale = 1.0 if dtype == torch.float32 else BF16_KERNEL / FP32_KERNEL
    for s in range(S):
        hidden, logit = kernels.merge_forward(partial.contiguous(), mixed[:, :, s], folded[s], lse[..., s], EPS,
                                              key_norm)
        completed = torch.sigmoid(lse[..., s] - logit)
        alpha = torch.cat([probs[:, :, s] * completed.unsqueeze(-1), (1 - completed).unsqueeze(-1)], dim=-1)
        ref_hidden, ref_alpha = ref_out[s]
        assert relative(hidden, ref_hidden) < FP32_KERNEL * scale
        assert relative(alpha, ref_alpha) < FP32_KERNEL * scale
        # d(loss)/d(alpha) through the merge's shares, by autograd of the glue above
        leaves = [t.detach().requires_grad_() for t in (probs[:, :, s], lse[..., s], logit)]
        share = torch.sigmoid(leaves[1] - leaves[2])
        glue = torch.cat([leaves[0] * share.unsqueeze(-1), (1 - share).unsqueeze(-1)], dim=-1)
        g_probs, g_lse, g_logit = torch.autograd.grad((glue * up_weights[s]).sum(), leaves)
        d_partial, d_mixed, d_lse, d_query = kernels.merge_backward(
            partial.contiguous(), mixed[:, :, s], folded[s], lse[..., s], logit, up_hidden[s].to(dtype), g_logit,
            EPS, key_norm)
        grad_partial += d_partial.float()
        grad_folded[s] += d_query
        grad_mixed[:, :, s] = d_mixed.float()
        grad_lse[..., s] = d_lse + g_lse
        grad_probs[:, :, s] = g_probs
    grad_values = torch.zeros(n, batch, seq, dim, dtype=dtype)
    grad_inv, grad_queries = kernels.phase1_backward(values.contiguous(), inv_rms, folded, probs,
                                                     grad_mixed.to(dtype), grad_lse, grad_probs, grad_values, True)
    grad_folded += grad_queries
    grad_values = grad_values.float()
    if key_norm:  # through inv_rms = (mean(v^2) + eps)^(-1/2) and the folded query w * g
        grad_values += (grad_inv * inv_rms.pow(3) / -dim).permute(2, 0, 1).unsqueeze(-1) * values_f
        grad_query, grad_weight = grad_folded * weights, grad_folded * queries
    else:
        grad_query, grad_weight = grad_folded, None
    assert relative(grad_values, ref_in[0].grad) < FP32_KERNEL * scale
    assert relative(grad_partial, ref_in[1].grad) < FP32_KERNEL * scale
    assert relative(grad_query, ref_in[2].grad) < FP32_KERNEL * scale
    if grad_weight is not None:
        assert relative(grad_weight, ref_in[3].grad) < FP32_KERNEL * scale


@pytest.mark.parametrize(("shape", "tile"), [((3, 4, 40, 2, 3), 32), ((5, 3, 64, 1, 5), 128)],
                         ids=["S4-one_query_tiles-D_chunks_of_8", "S3-two_query_tiles-D_chunks_of_32"])
def test_a_token_split_across_programs_equals_naive_attnres(kernels, monkeypatch, shape, tile):
    """The split of a token's `S x D` across programs that large hidden sizes take (`attnres_kernels.TILE`, 8192
    elements; models' `D` from 2048 at `S = 8`), here on tiny shapes with a tiny tile: phase 1 by query tiles (the
    last one part-masked at `S = 3`), the key-norm gradient summed over them, and the sources' gradients by chunks
    of the hidden units. The test above, fp32 with the key norm."""
    monkeypatch.setattr(kernels, "TILE", tile)
    n, S, dim = shape[:3]
    assert kernels._phase1_tiles(dim, S)[2] > 1 and kernels._values_tiles(dim, S)[2] > 1
    test_phase1_and_merge_equal_naive_attnres(kernels, shape, torch.float32, True)


@pytest.mark.parametrize("gap", [8.0, 12.0, 16.0])
def test_a_small_partial_share_keeps_the_digits_of_its_gradient(kernels, gap):
    """The partial sum holds `e^-gap` of the softmax mass: its gradient (that share times the upstream gradient) is
    computed from its own sigmoid, not `1 - sigmoid(gap)` (at gap 16 in fp32: no correct digit). Against float64."""
    kernels = on_device(kernels)
    generator = torch.Generator().manual_seed(int(gap))
    batch, seq, dim = 2, 3, 16
    partial, mixed = torch.randn(batch, seq, dim, generator=generator), torch.randn(batch, seq, dim, generator=generator)
    query, grad = torch.randn(dim, generator=generator), torch.randn(batch, seq, dim, generator=generator)
    logit = (partial @ query) * torch.rsqrt(partial.pow(2).mean(-1) + EPS)
    lse = logit + gap
    hidden, ours = kernels.merge_forward(partial, mixed, query, lse, EPS, True)
    grad_partial = kernels.merge_backward(partial, mixed, query, lse, ours, grad, None, EPS, True)[0]
    leaf = partial.double().requires_grad_()
    p = (leaf @ query.double()) * torch.rsqrt(leaf.pow(2).mean(-1) + EPS)
    share = torch.sigmoid(lse.double() - p).unsqueeze(-1)
    reference = share * mixed.double() + torch.sigmoid(p - lse.double()).unsqueeze(-1) * leaf
    assert relative(hidden, reference) < FP32_KERNEL
    assert relative(grad_partial, torch.autograd.grad(reference, leaf, grad.double())[0]) < FP32_KERNEL


@pytest.mark.parametrize("key_norm", [True, False], ids=["key_norm", "no_key_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_merge_with_the_add_reads_the_sum_torch_adds(kernels, dtype, key_norm):
    """`merge_forward(..., output)` (inference: the sub-layer's output added to the partial sum in the merge's
    launch): the sum torch's `partial + output` gives, within one unit of the dtype's last place (Triton's
    interpreter truncates bf16 where a GPU rounds to nearest), and the merge of the sum it returns; a router's strided
    view of phase 1's sums as `mixed`, a hidden size that masks lanes."""
    kernels = on_device(kernels)
    generator = torch.Generator().manual_seed(7)
    batch, seq, S, dim = 2, 3, 3, 40
    partial, output = (torch.randn(batch, seq, dim, generator=generator).to(dtype) for _ in range(2))
    mixed = torch.randn(batch, seq, S, dim, generator=generator).to(dtype)[:, :, 1]
    query, lse = torch.randn(dim, generator=generator), torch.randn(batch, seq, S, generator=generator)[..., 1]
    hidden, logit, summed = kernels.merge_forward(partial, mixed, query, lse, EPS, key_norm, output)
    expected = partial + output
    torch.testing.assert_close(summed, expected, rtol=torch.finfo(dtype).eps, atol=0)
    reference, reference_logit = kernels.merge_forward(summed, mixed, query, lse, EPS, key_norm)
    assert relative(hidden, reference) < FP32_KERNEL and relative(logit, reference_logit) < FP32_KERNEL
    with pytest.raises(ValueError, match="output must match the partial sum"):
        kernels.merge_forward(partial, mixed, query, lse, EPS, key_norm, output[:, :1])


def test_accumulate_adds_to_what_the_gradient_buffer_holds(kernels):
    """`phase1_backward(accumulate=True)` adds to `grad_values` (the in-place gradient sums), else overwrites."""
    kernels = on_device(kernels)
    generator = torch.Generator().manual_seed(0)
    values, queries = torch.randn(3, 1, 2, 16, generator=generator), torch.randn(2, 16, generator=generator)
    probs, lse, mixed = kernels.phase1_forward(values, None, queries)
    grad = torch.randn_like(mixed)
    fresh, held = torch.zeros_like(values), torch.full_like(values, 0.5)
    kernels.phase1_backward(values, None, queries, probs, grad, None, None, fresh, False)
    kernels.phase1_backward(values, None, queries, probs, grad, None, None, held, True)
    torch.testing.assert_close(held, fresh + 0.5)


# ---------------------------------------------------------------------------------------------------------------
# A whole model: the kernels against the torch path
# ---------------------------------------------------------------------------------------------------------------

MODELS = {"full": dict(attnres_block_size=1), "block2": dict(attnres_block_size=2),
          "block4_rescaled": dict(attnres_block_size=4, attnres_rescale_output=True),
          "block2_no_key_norm": dict(attnres_block_size=2, attnres_key_norm=False)}


def training_step(model, input_ids):
    """Logits, depth weights and every parameter's gradient (fp32) of one step."""
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    model.zero_grad()
    out = model(input_ids.to(DEVICE), output_depth_weights=True)
    (out.logits.float() @ projection).square().mean().backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float().cpu(), [w.detach().float().cpu() for w in out.depth_weights], grads


def pair(kernels, dtype=torch.float32, **overrides):
    """The same model with the torch path and with the kernels."""
    torch_model = tiny_model(**overrides).to(DEVICE, dtype).train()
    triton_model = tiny_model(**overrides, attnres_implementation="triton").to(DEVICE, dtype).train()
    triton_model.load_state_dict(torch_model.state_dict())
    return torch_model, triton_model


@pytest.mark.parametrize("name,per_source", [*((name, False) for name in MODELS), ("full", True),
                                              ("block4_rescaled", True)],
                         ids=lambda value: {False: "in_place_sums", True: "per_source_sums"}.get(value, value))
def test_a_model_with_the_kernels_trains_like_the_torch_path(kernels, monkeypatch, input_ids, name, per_source):
    """fp32: logits, depth weights and every gradient, with the sources' gradients summed in place (eager training)
    and one per source (what tracing uses, and a torch without graph-task ids: `torch_internals`)."""
    if per_source:
        monkeypatch.setattr(torch_internals, "current_graph_task_id", None)  # (no in-place sums)
    torch_model, triton_model = pair(kernels, **MODELS[name])
    ours, theirs = training_step(triton_model, input_ids), training_step(torch_model, input_ids)
    assert relative(ours[0], theirs[0]) < 1e-5
    for mine, other in zip(ours[1], theirs[1], strict=True):
        assert (mine - other).abs().max() < 1e-5
    assert ours[2].keys() == theirs[2].keys()
    worst = max(relative(ours[2][key], theirs[2][key]) for key in theirs[2])
    assert worst < 1e-4, worst


@pytest.mark.parametrize("name", ["full", "block4_rescaled"])
def test_bf16_kernels_are_as_close_to_float64_as_the_torch_path(kernels, input_ids, name):
    """bf16 rounds differently on the two paths: each against a float64 run of the torch path."""
    reference_model = tiny_model(**MODELS[name]).to(DEVICE, torch.float64).train()
    torch_model, triton_model = pair(kernels, torch.bfloat16, **MODELS[name])
    reference = training_step(reference_model, input_ids)
    ours, theirs = training_step(triton_model, input_ids), training_step(torch_model, input_ids)
    assert frobenius(ours[0], reference[0]) <= 2 * frobenius(theirs[0], reference[0]) + 1e-2
    every = [torch.cat([grads[key].flatten() for key in reference[2]]) for grads in (ours[2], theirs[2], reference[2])]
    assert frobenius(every[0], every[2]) <= 2 * frobenius(every[1], every[2]) + 1e-2


@pytest.mark.parametrize("name", ["full", "block4_rescaled"])
def test_inference_and_generation_match_the_torch_path(kernels, input_ids, name):
    """No-grad forwards (prefill, cached decode) and greedy generation (in a block of 4, two of its merges add the
    last sub-layer's output to the partial sum themselves: `attnres_triton.add`)."""
    torch_model, triton_model = (m.eval() for m in pair(kernels, **MODELS[name]))
    input_ids = input_ids.to(DEVICE)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert relative(triton_model(input_ids).logits, torch_model(input_ids).logits) < 1e-5
        torch.testing.assert_close(triton_model.generate(input_ids, **kwargs), torch_model.generate(input_ids, **kwargs),
                                   atol=0, rtol=0)


def test_a_frozen_start_trains_on_the_kernels_as_on_the_torch_path(kernels, input_ids):
    """Only the first MLP trainable (as with LoRA: frozen embeddings and routers), no depth weights asked: phase 1
    reads sources that need no gradient, while the later merges read a partial sum that does (their backward needs
    phase 1's softmax). The torch path's gradients."""
    torch_model, triton_model = pair(kernels, **MODELS["block4_rescaled"])
    grads = []
    for model in (torch_model, triton_model):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.startswith("model.layers.0.mlp."))
        model(input_ids.to(DEVICE)).logits.square().mean().backward()
        grads.append({name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert max(relative(grads[1][key], grads[0][key]) for key in grads[0]) < 1e-4


def test_a_hook_that_steers_the_partial_sum_is_read_on_the_kernels(kernels, input_ids):
    """No gradients, a block of 4 (whose merges the partial sum's add computes ahead: `attnres_triton.add`): a
    forward hook on a decoder layer that adds to the partial sum of the state it returns, in place, is read by the
    next router, as on the torch path (under `torch.inference_mode` too, whose tensors count no writes); a sub-layer
    output that only broadcasts against the partial sum (a hook on an MLP keeping one row of the batch) is added as
    torch adds it."""
    torch_model, triton_model = (m.eval() for m in pair(kernels, **MODELS["block4_rescaled"]))
    steer = torch.randn(torch_model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)

    def steering(module, args, output):
        if output[0].partial is not None:
            output[0].partial.add_(steer)

    for mode in (torch.no_grad, torch.inference_mode):
        logits = []
        for model in (torch_model, triton_model):
            handle = model.model.layers[0].register_forward_hook(steering)
            with mode():
                logits.append(model(input_ids.to(DEVICE)).logits)
            handle.remove()
        assert relative(logits[1], logits[0]) < 1e-5, mode
    logits = []
    for model in (torch_model, triton_model):
        handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output[:1])
        with torch.no_grad():
            logits.append(model(input_ids.to(DEVICE)).logits)
        handle.remove()
    assert relative(logits[1], logits[0]) < 1e-5


@pytest.mark.parametrize("name", ["full", "block2"])
def test_gradient_checkpointing_replays_the_kernels(kernels, input_ids, name):
    """A checkpointed layer rewrites its block's buffer slot and runs the kernels again in backward: the torch path's
    gradients without checkpointing, as a step without it gives them (the test above)."""
    plain, checkpointed = pair(kernels, **MODELS[name])
    checkpointed.gradient_checkpointing_enable()
    ours, theirs = training_step(checkpointed, input_ids), training_step(plain, input_ids)
    assert ours[2].keys() == theirs[2].keys()
    worst = max(relative(ours[2][key], theirs[2][key]) for key in theirs[2])
    assert worst < 1e-4, worst


@pytest.mark.parametrize("name", ["full", "block4_rescaled"])
def test_fp16_inference_is_finite_and_close_to_the_torch_path(kernels, input_ids, name):
    """fp16 (the kernels compute in fp32 and round once): finite, and as close to the torch path as fp16 allows."""
    torch_model, triton_model = (m.eval() for m in pair(kernels, torch.float16, **MODELS[name]))
    with torch.no_grad():
        ours, theirs = (m(input_ids.to(DEVICE)).logits.float().cpu() for m in (triton_model, torch_model))
    assert torch.isfinite(ours).all()
    assert relative(ours, theirs) < 1e-2  # fp16 keeps 11 bits; measured 1.2e-3 to 2.5e-3 of the largest logit


def test_compiled_reads_stay_on_torch(kernels, input_ids):
    """Under `torch.compile` the reads take the torch path (a Triton launch would break the graph): fullgraph
    traces, and the logits are the eager kernels'."""
    torch._dynamo.reset()
    model = tiny_model(attnres_block_size=2, num_hidden_layers=2, attnres_implementation="triton").to(DEVICE)
    input_ids = input_ids.to(DEVICE)
    with torch.no_grad():
        eager = model(input_ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids).logits
    assert relative(compiled, eager) < 1e-5


def test_cpu_tensors_without_the_interpreter_are_refused(kernels, monkeypatch, input_ids):
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    model = tiny_model(attnres_block_size=2, attnres_implementation="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors .*TRITON_INTERPRET=1.*attnres_implementation='torch'"):
        model(input_ids)


@pytest.mark.parametrize("knob", [dict(attnres_score_fn="sigmoid"), dict(attnres_window=2),
                                  dict(attnres_num_heads=2), dict(attnres_query="input_dependent"),
                                  dict(attnres_scalar_weights=True), dict(depth_mixing="denseformer")],
                         ids=lambda k: next(iter(k)))
def test_knobs_the_kernels_do_not_compute_are_refused(knob):
    name = next(iter(knob))
    with pytest.raises(ValueError, match=f"attnres_implementation='triton' needs {name}="):
        tiny_config(attnres_block_size=2, attnres_implementation="triton", **knob)
    config = tiny_config(attnres_block_size=2, **knob)
    with pytest.raises(ValueError, match=f"attnres_implementation='triton' needs {name}="):
        config.attnres_implementation = "triton"


def test_a_knob_changed_after_the_implementation_is_refused_at_construction():
    config = tiny_config(attnres_block_size=2, attnres_implementation="triton")
    config.attnres_score_fn = "sigmoid"
    with pytest.raises(ValueError, match="attnres_implementation='triton' needs attnres_score_fn="):
        AttnResForCausalLM(config)


def test_the_implementation_is_saved_and_loaded(kernels, tmp_path, input_ids):
    model = tiny_model(attnres_block_size=2, attnres_implementation="triton").to(DEVICE)
    input_ids = input_ids.to(DEVICE)
    model.save_pretrained(tmp_path)
    loaded = AttnResForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    assert AttnResConfig.from_pretrained(tmp_path).attnres_implementation == "triton"
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, atol=0, rtol=0)
    back = AttnResForCausalLM.from_pretrained(tmp_path, attnres_implementation="torch")
    assert back.config.attnres_implementation == "torch"


def test_a_meta_device_forward_takes_the_torch_path(input_ids):
    """Meta tensors (shapes only, e.g. accelerate's `init_empty_weights` checks) need no kernel and no CUDA."""
    with torch.device("meta"):
        model = AttnResForCausalLM(tiny_config(attnres_block_size=2, attnres_implementation="triton"))
        logits = model(input_ids.to("meta")).logits
    assert logits.shape == (*input_ids.shape, model.config.vocab_size) and logits.is_meta
