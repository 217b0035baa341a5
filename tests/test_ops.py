"""The AttnRes read's implementations through their one signature (`attnres_hf.modeling.ops`; paper Eq. 1-4 over
the sources of Eq. 6), compared with each other directly, as fla's tests compare `naive_attnres` with
`fused_attnres`: the reference (`ops_naive`) in float64 against the torch one-pass read, the torch two-phase read
(Algorithm 1: `phase1` then `merge`), the Triton kernels (in Triton's interpreter on CPU) and fla's kernel (CUDA
only), on outputs, depth weights and the gradients of the sources, the partial sum, the query and the key-norm
weight; the registry's choices and refusals.

Tolerances, from measured errors (relative to each tensor's largest element, worst over the shapes, routers and
implementations below, on a 2-core AMD EPYC), about 2-5x the worst: fp32 outputs within 2.2e-7 of float64 (bound
1e-6), gradients within 1.4e-5 (the query's and key-norm weight's, sums over tokens; bound 5e-5); bf16 sources (fp32
arithmetic, bf16 outputs and gradients; bf16 keeps 8 bits) outputs within 7.7e-3 (bound 2e-2), gradients within
3.1e-2 (the two-phase read's, rescaled: its output is rounded to bf16 before the scale; bound 6e-2); the depth
weights, fp32 whatever the sources, within 1.9e-7 (bound 1e-6). A model takes the reference for every read with
`attnres_implementation="naive"` (the tests at the end; test_two_phase.py holds the model's paths against it).
"""

import pytest
import torch

from attnres_hf.modeling import attnres_buffer, ops, ops_naive, ops_torch, torch_internals
from attnres_hf.modeling.attnres_buffer import SourceBuffer
from attnres_hf.modeling.modeling_attnres import AttnResForCausalLM
from utils import TINY, tiny_config, tiny_model

EPS = 1e-6
TOLERANCE = {  # (sources' dtype, result) -> bound on the relative error (module docstring)
    (torch.float32, "hidden"): 1e-6, (torch.float32, "gradient"): 5e-5,
    (torch.bfloat16, "hidden"): 2e-2, (torch.bfloat16, "gradient"): 6e-2,
}
WEIGHTS_TOLERANCE = 1e-6

SHAPES = {  # (completed sources n, batch, tokens, hidden, with a partial sum)
    "full-embedding-only": (1, 2, 3, 16, False),
    "full-5-sources": (5, 2, 1, 16, False),
    "block-partial": (3, 2, 2, 24, True),
    "decode": (4, 1, 1, 32, True),
    "decode-batch3": (2, 3, 1, 8, True),
}
GRADCHECK_SHAPE = (2, 2, 1, 4, True)
"""Small: gradcheck evaluates the read twice per input element."""
ROUTERS = {  # keyword arguments of the read: the paper's router and Table 4's knobs
    "softmax": dict(key_norm=True, sigmoid=False),
    "no-key-norm": dict(key_norm=False, sigmoid=False),
    "sigmoid": dict(key_norm=True, sigmoid=True),
    "rescaled": dict(key_norm=True, sigmoid=False, output_scale=3.0),
}


def inputs(shape, dtype, router="softmax", seed=0):
    """Sources `(n, B, T, D)`, the partial sum `(B, T, D)` or `None`, a query and a key-norm weight `(D,)` fp32.

    Without the key norm the logits are `q . v`, `RMS(v) sqrt(D)` (here about `2 sqrt(D)`) times those with it: the
    query is scaled by `1 / (2 sqrt(D))` so that both softmaxes are as sharp. (Unscaled, logits near 60 saturate the
    softmax, and the query's fp32 gradient at one token was 2e-4 from float64: the problem's conditioning, which every
    implementation shares, not an implementation's error.)"""
    n, batch, seq, dim, with_partial = shape
    generator = torch.Generator().manual_seed(seed)
    sources = (torch.randn(n, batch, seq, dim, generator=generator) * 2).to(dtype)
    partial = torch.randn(batch, seq, dim, generator=generator).to(dtype) if with_partial else None
    query = torch.randn(dim, generator=generator)
    if not ROUTERS[router].get("key_norm", True):
        query = query / (2 * dim ** 0.5)
    weight = 1 + 0.3 * torch.randn(dim, generator=generator)
    return sources, partial, query, weight


def read(op, sources, partial, query, weight, dtype=None, **knobs):
    """The op's output, depth weights and gradients (of a fixed random projection of both) with respect to the
    sources, partial sum, query and weight (`None` where absent), all taken in `dtype` if given."""
    leaves = [None if t is None else (t if dtype is None else t.to(dtype)).detach().requires_grad_()
              for t in (sources, partial, query, weight)]
    sources, partial, query, weight = leaves
    key_weight = weight if knobs.get("key_norm", True) else None
    hidden, weights = op(sources, query, key_weight, partial=partial, eps=EPS, **knobs)
    generator = torch.Generator().manual_seed(1)
    loss = (hidden.double() * torch.randn(hidden.shape, generator=generator, dtype=torch.float64)).sum()
    if weights is not None:
        loss = loss + (weights.double() * torch.randn(weights.shape, generator=generator, dtype=torch.float64)).sum()
    wanted = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    return {"hidden": hidden.detach(), "weights": None if weights is None else weights.detach(),
            **{name: None if t is None else next(grads) for name, t in zip(("d_sources", "d_partial", "d_query",
                                                                          "d_weight"), leaves)}}


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max().clamp_min(1e-30)).item()


DTYPES = {"hidden": None, "weights": torch.float32, "d_sources": None, "d_partial": None,
          "d_query": torch.float32, "d_weight": torch.float32}
"""Each result's dtype (`None`: the sources')."""


def assert_matches_reference(ours: dict, reference: dict, dtype: torch.dtype, weights: bool = True):
    """Each of `ours` (`read`'s results for `dtype` sources) within its bound of the float64 `reference`'s, finite and
    in its dtype (`DTYPES`)."""
    for name, value in ours.items():
        expected = reference[name]
        if name == "weights" and not weights:
            assert value is None
            continue
        if expected is None or value is None:  # (absent; or without the key norm, the weight is not read)
            assert (value is None or not value.any()) and (expected is None or not expected.any()), name
            continue
        assert value.dtype == (DTYPES[name] or dtype), name
        assert torch.isfinite(value).all(), name
        bound = WEIGHTS_TOLERANCE if name == "weights" else TOLERANCE[dtype, "hidden" if name == "hidden" else
                                                                          "gradient"]
        error = relative(value, expected)
        assert error <= bound, f"{name}: {error:.2e} > {bound:.0e}"


def reference_read(shape, dtype, router="softmax", **knobs):
    """`ops_naive.attnres` in float64 on the `dtype` inputs (their bf16 rounding included)."""
    sources, partial, query, weight = inputs(shape, dtype, router)
    return read(ops_naive.attnres, sources, partial, query, weight, dtype=torch.float64, **ROUTERS[router], **knobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("implementation", ["torch", "two-phase"])
def test_torch_reads_equal_the_reference(implementation, shape, router, dtype):
    """The one-pass read and the two-phase read (`phase1` with one query, then `merge`) against `ops_naive` in
    float64: output, depth weights, every gradient."""
    op = ops_torch.attnres if implementation == "torch" else ops_torch.two_phase
    reference = reference_read(SHAPES[shape], dtype, router)
    ours = read(op, *inputs(SHAPES[shape], dtype, router), **ROUTERS[router])
    assert ours["hidden"].dtype == dtype and ours["weights"].dtype == torch.float32
    assert_matches_reference(ours, reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["full-5-sources", "block-partial", "decode-batch3"])
def test_triton_read_equals_the_reference(shape, dtype):
    """The Triton kernels (phase 1 with one query, then the merge; Triton's interpreter on CPU) against `ops_naive`
    in float64, with and without the key norm."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        op = ops.get("triton", device)
    except ValueError:
        pytest.skip("Triton's interpreter is off: run with TRITON_INTERPRET=1 set before Triton is imported")
    for router in ("softmax", "no-key-norm"):
        reference = reference_read(SHAPES[shape], dtype, router)
        tensors = [None if t is None else t.to(device) for t in inputs(SHAPES[shape], dtype, router)]
        ours = {k: None if v is None else v.cpu() for k, v in read(op, *tensors, **ROUTERS[router]).items()}
        assert_matches_reference(ours, reference, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernel runs on CUDA")
@pytest.mark.parametrize("shape", ["full-5-sources", "block-partial", "decode"])
def test_fla_read_equals_the_reference(shape):
    """fla's `fused_attnres` (CUDA only; no depth weights) against `ops_naive` in float64: output and gradients."""
    pytest.importorskip("fla.ops.attnres")
    op = ops.get("fla", "cuda")
    reference = reference_read(SHAPES[shape], torch.float32, return_weights=False)
    tensors = [None if t is None else t.cuda() for t in inputs(SHAPES[shape], torch.float32)]
    ours = {k: None if v is None else v.cpu() for k, v in read(op, *tensors, return_weights=False).items()}
    assert_matches_reference(ours, reference, torch.float32, weights=False)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_torch_reads_pass_gradcheck_in_float64(router):
    """The torch reads' gradients (plain autograd in one pass; phase 1 and `_PartialMerge`'s own backward in two)
    are their forwards' derivatives, in float64."""
    sources, partial, query, weight = (t.double().requires_grad_() for t in inputs(GRADCHECK_SHAPE, torch.float64,
                                                                                     router))
    for op in (ops_torch.attnres, ops_torch.two_phase):
        def function(sources, partial, query, weight, op=op):
            hidden, weights = op(sources, query, weight, partial=partial, eps=EPS, **ROUTERS[router])
            return hidden, weights
        assert torch.autograd.gradcheck(function, (sources, partial, query, weight))


@pytest.mark.parametrize("router", ["softmax", "sigmoid", "no-key-norm"])
def test_the_merge_with_its_sources_passes_gradcheck_in_float64(router):
    """`ops_torch.merge` given its sources (`_PartialMerge`, the model's training merge: it keeps neither `mixed` nor
    the sources for backward and recomputes `mixed` from them): its backward is the derivative of its forward, for
    the output and the depth weights, in float64; its forward is the plain merge's exactly."""
    knobs = {k: v for k, v in ROUTERS[router].items() if k != "sigmoid"}
    sources, partial, query, weight = (t.double() for t in inputs(GRADCHECK_SHAPE, torch.float64, router))
    probs, lse, mixed = (t if t is None else t.squeeze(2) for t in ops_torch.phase1(
        sources, query.unsqueeze(0), weight.unsqueeze(0), eps=EPS, sigmoid=ROUTERS[router]["sigmoid"], **knobs))
    leaves = [t.clone().requires_grad_() for t in (partial, mixed, query, weight) + (() if lse is None else (lse,))]

    def merged(partial, mixed, query, weight, *lse, sources=sources):
        return ops_torch.merge(probs, lse[0] if lse else None, mixed, partial, query, weight, eps=EPS,
                               output_scale=1.5, sources=sources, **knobs)

    assert torch.autograd.gradcheck(merged, leaves)
    for ours, plain in zip(merged(*leaves), merged(*leaves, sources=None), strict=True):
        torch.testing.assert_close(ours, plain, atol=0, rtol=0)


@pytest.mark.parametrize("gap", [8.0, 12.0, 16.0])
@pytest.mark.parametrize("sigmoid", [False, True], ids=["softmax", "sigmoid"])
def test_a_small_partial_share_keeps_the_digits_of_its_gradient(sigmoid, gap):
    """A partial sum with a share of `e^-gap` of the softmax mass (or a sigmoid gate near 1): its gradient is that
    share times the upstream gradient, which `1 - sigmoid(gap)` in fp32 computes with few correct digits (at gap 16,
    none). The merge given its sources (`_PartialMerge`) in fp32 against the same inputs merged in float64."""
    generator = torch.Generator().manual_seed(int(gap))
    n, batch, seq, dim = 3, 2, 3, 16
    sources = torch.randn(n, batch, seq, dim, generator=generator)
    probs = torch.randn(batch, seq, n, generator=generator).softmax(-1)
    mixed = torch.einsum("btn,nbtd->btd", probs, sources)  # (B, T, D)
    partial = torch.randn(batch, seq, dim, generator=generator)
    query = torch.randn(dim, generator=generator)
    logit = (partial @ query) * torch.rsqrt(partial.pow(2).mean(-1) + 1e-5)
    lse = None if sigmoid else logit + gap
    if sigmoid:  # a sigmoid gate of 1 - e^-gap: scale the query so that the logit is gap
        query = query * (gap / logit.abs()).min()
    grad = torch.randn(batch, seq, dim, generator=generator)
    grads = []
    for dtype in (torch.float32, torch.float64):
        leaf = partial.to(dtype).requires_grad_()
        hidden, _ = ops_torch.merge(probs.to(dtype), None if lse is None else lse.to(dtype), mixed.to(dtype), leaf,
                                    query.to(dtype), eps=1e-5, sources=sources.to(dtype), return_weights=False)
        grads.append(torch.autograd.grad(hidden, leaf, grad.to(dtype))[0])
    assert relative(grads[0], grads[1]) < 1e-4  # measured: under 1e-6


def test_the_model_buffer_reads_as_the_tensor():
    """The router's argument, the source buffer with the sources' autograd handles (`SourceBuffer`, read through the
    buffer's autograd Functions), gives the plain tensor's numbers and hands each source its gradient."""
    sources, partial, query, weight = inputs(SHAPES["block-partial"], torch.float32)
    plain = read(ops_torch.attnres, sources, partial, query, weight)
    handles = [s.clone().requires_grad_() for s in sources.unbind(0)]
    buffer = torch.empty(len(handles) + 2, *sources.shape[1:])  # (slots: the sources, then two not written yet)
    buffer[:len(handles)] = sources
    leaves = [partial.clone().requires_grad_(), query.clone().requires_grad_(), weight.clone().requires_grad_()]
    hidden, weights = ops_torch.attnres(SourceBuffer(buffer, tuple(handles), tuple(handles), None), leaves[1],
                                        leaves[2], partial=leaves[0], eps=EPS)
    torch.testing.assert_close(hidden, plain["hidden"], atol=0, rtol=0)
    torch.testing.assert_close(weights, plain["weights"], atol=0, rtol=0)
    generator = torch.Generator().manual_seed(1)
    loss = ((hidden.double() * torch.randn(hidden.shape, generator=generator, dtype=torch.float64)).sum()
            + (weights.double() * torch.randn(weights.shape, generator=generator, dtype=torch.float64)).sum())
    grads = torch.autograd.grad(loss, handles + leaves)
    torch.testing.assert_close(torch.stack(grads[:len(handles)]), plain["d_sources"], atol=1e-6, rtol=1e-5)
    for grad, name in zip(grads[len(handles):], ("d_partial", "d_query", "d_weight")):
        torch.testing.assert_close(grad, plain[name], atol=1e-6, rtol=1e-5)


BUFFER_READS = {  # (the accumulator, the key norm's statistics in it, a pass that sums in place)
    "summed-in-place": (True, False, True), "per-source": (False, False, False),
    "statistics-summed-in-place": (True, True, True), "statistics-per-source": (True, True, False),
}


def through_buffer(accumulator: bool, statistics: bool):
    """`ops_torch.attnres` over the model's source buffer: each source written into its slot by `_store`, whose
    handle hands it the slot's gradient, summed by `_SourceGrads` (`accumulator`, as eager training does) or one per
    reader, with the read's signature. With `statistics` (Full AttnRes's torch training) the accumulator also holds
    the key norm's statistics, which the read takes from it (`inv_rms` not given)."""
    def op(sources, query, key_norm_weight, eps, **knobs):
        slots = sources.unbind(0)
        buffer = torch.empty(len(slots) + 1, *sources.shape[1:], dtype=sources.dtype)  # (one slot not written)
        grads = attnres_buffer._SourceGrads(buffer, eps if statistics else None) if accumulator else None
        handles = tuple(attnres_buffer._store(buffer, grads, slot, source) for slot, source in enumerate(slots))
        return ops_torch.attnres(SourceBuffer(buffer, slots, handles, grads), query, key_norm_weight, eps=eps,
                                 **knobs)
    return op


@pytest.mark.parametrize("mode", list(BUFFER_READS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reads_of_the_model_buffer_equal_the_reference(shape, router, dtype, mode, monkeypatch):
    """The torch read over the model's source buffer (without a partial sum one autograd Function for the whole read,
    `attnres_buffer._SourceRead`; with one, the scores and sums Functions) against `ops_naive` in float64: output,
    depth weights and every gradient, the sources' summed in place or handed per source (a pass without an id: a
    torch without the private names, as compiled autograd's), the key norm's statistics computed or the buffer's."""
    accumulator, statistics, in_place = BUFFER_READS[mode]
    if not in_place:
        monkeypatch.setattr(torch_internals, "current_graph_task_id", None)
    reference = reference_read(SHAPES[shape], dtype, router)
    ours = read(through_buffer(accumulator, statistics), *inputs(SHAPES[shape], dtype, router), **ROUTERS[router])
    assert_matches_reference(ours, reference, dtype)


def test_sources_may_be_a_list_and_weights_may_be_left_out():
    sources, partial, query, weight = inputs(SHAPES["block-partial"], torch.float32)
    stacked = ops_torch.attnres(sources, query, weight, partial=partial, eps=EPS)
    listed = ops_torch.attnres(list(sources.unbind(0)), query, weight, partial=partial, eps=EPS)
    torch.testing.assert_close(listed, stacked, atol=0, rtol=0)
    hidden, weights = ops_torch.attnres(sources, query, weight, partial=partial, eps=EPS, return_weights=False)
    assert weights is None and torch.equal(hidden, stacked[0])


def test_a_zero_query_averages_the_sources():
    """Zero-initialised pseudo-queries (the paper's requirement) give uniform weights: the mean of the sources."""
    sources, partial, _, weight = inputs(SHAPES["block-partial"], torch.float32)
    everything = torch.cat([sources, partial.unsqueeze(0)])
    for implementation in ("naive", "torch"):
        hidden, weights = ops.get(implementation, "cpu")(sources, torch.zeros(24), weight, partial=partial, eps=EPS)
        torch.testing.assert_close(hidden, everything.mean(0))
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / len(everything)))


def test_the_registry_chooses_and_refuses():
    assert ops.get("torch", "cpu") is ops_torch.attnres and ops.get("naive", torch.device("cpu")) is ops_naive.attnres
    assert ops.get("fla", "meta") is ops_torch.attnres  # (meta tensors: shapes only)
    with pytest.raises(KeyError, match="no AttnRes implementation 'cuda'"):
        ops.get("cuda", "cpu")
    with pytest.raises(ValueError, match="attnres_implementation='fla' needs CUDA tensors"):
        ops.get("fla", "cpu")
    with pytest.raises(ValueError, match="at least one source"):
        ops_torch.attnres([], torch.zeros(8))
    with pytest.raises(ValueError, match="at least one source"):
        ops_naive.attnres([], torch.zeros(8))


@pytest.mark.parametrize("knob", [dict(attnres_num_heads=2), dict(attnres_window=2),
                                  dict(attnres_query="input_dependent"), dict(attnres_scalar_weights=True)],
                         ids=["heads", "window", "input-dependent", "scalar-weights"])
def test_a_model_refuses_the_reference_for_knobs_it_does_not_compute(knob):
    """`attnres_implementation="naive"` computes the paper's router (static query, one head, no window; softmax or
    sigmoid, with or without the key norm): other knobs are refused naming the field, when the config is built and
    when the implementation is set later."""
    field = next(iter(knob))
    with pytest.raises(ValueError, match=f"attnres_implementation='naive' needs {field}="):
        tiny_config(**knob, attnres_implementation="naive")
    config = tiny_config(**knob)
    with pytest.raises(ValueError, match=f"attnres_implementation='naive' needs {field}="):
        config.attnres_implementation = "naive"
    assert config.attnres_implementation == "torch"


@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_a_model_with_the_reference_reads_saves_loads_and_generates_as_the_torch_one(block_size, tmp_path):
    """A model whose reads are the reference's (`attnres_implementation="naive"`, as `attn_implementation="eager"`)
    keeps it through `save_pretrained`, is chosen by `from_pretrained(..., attnres_implementation="naive")`, and
    decodes with the KV cache the torch reads' tokens, logits within fp32 round-off (test_two_phase.py compares the
    training paths)."""
    model = tiny_model(attnres_block_size=block_size)
    model.save_pretrained(tmp_path / "torch")
    naive = AttnResForCausalLM.from_pretrained(tmp_path / "torch", attnres_implementation="naive")
    assert naive.config.attnres_implementation == "naive"
    naive.save_pretrained(tmp_path / "naive")
    assert AttnResForCausalLM.from_pretrained(tmp_path / "naive").config.attnres_implementation == "naive"
    prompt = torch.randint(3, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    ours, reference = model.generate(prompt, **kwargs), naive.generate(prompt, **kwargs)
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(reference.logits), atol=1e-5, rtol=1e-5)


def test_the_config_accepts_exactly_the_registered_implementations():
    """`attnres_implementation`'s values are written in the config (which imports no modeling code) and in the ops'
    registry: the two lists are one set, and every implementation with limits (`IMPLEMENTATION_NEEDS`) is in it."""
    import typing

    from attnres_hf.modeling.configuration_attnres import _AttnResConfigFields
    from attnres_hf.modeling.mixing_base import IMPLEMENTATION_NEEDS

    accepted = typing.get_args(_AttnResConfigFields.__dataclass_fields__["attnres_implementation"].type)
    assert set(accepted) == set(ops.IMPLEMENTATIONS) and set(IMPLEMENTATION_NEEDS) <= set(ops.IMPLEMENTATIONS)
