"""The no-grad reads as single-query attention (`attnres_inference.SdpaLayout`: one `scaled_dot_product_attention`
call per read, softmax scores, at most `SDPA_TOKENS` tokens): the read against the reference `ops_naive.attnres` in
float64, with and without a partial sum (written in place, `write`), and the models' generation against the path
that computes the depth weights (the ops' reads).

Tolerances, from measured errors (relative to the output's largest element, `test_ops.relative`, on a 2-core AMD
EPYC): fp32 within 7.6e-7 of float64 (bound 2e-6); bf16 sources (an fp32 read, then the output rounded to bf16)
within 3.6e-3, test_ops' bf16 bound for the reads (2e-2). A bf16 model does not read through it (`sdpa_serves`):
its generation through the attention reads, partial sums in fp32, moved the logits by 2.2% of their scale from the
depth-weights path's (partial sums rounded to bf16 at each sub-layer, as in training), the other reads' by 0.5%.
"""

import pytest
import torch

from attnres_hf.modeling import attnres_inference, ops_naive
from attnres_hf.modeling.attnres_inference import SdpaLayout
from attnres_hf.modeling.mixing_attnres import AttnResState
from test_ops import EPS, SHAPES, inputs, relative
from utils import tiny_model

BOUND = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
READ_SHAPES = dict(SHAPES, wide=(8, 2, 3, 576, True), **{"wide-full": (9, 2, 3, 576, False)})


def sdpa_read(sources, partial, query, weight, key_norm):
    """The read over an `SdpaLayout` of the `(n, B, T, D)` sources, the partial sum written in two steps (a block's
    first output, then `partial + output` in place)."""
    n = len(sources)
    bank = (query * weight if key_norm else query).unsqueeze(0)  # (1, D) fp32, the key-norm weight folded in
    layout = SdpaLayout.build(sources.new_empty(sources.shape), bank, key_norm, EPS)
    for slot, source in enumerate(sources):
        attnres_inference.close(layout, slot, source, None)
    if partial is not None:
        half = partial * 0.5
        attnres_inference.write(layout, n, attnres_inference.write(layout, n, None, half), partial - half)
    return attnres_inference.read(layout, n + (partial is not None), layout.queries[0], None if partial is None else n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("key_norm", [True, False], ids=["softmax", "no-key-norm"])
@pytest.mark.parametrize("shape", list(READ_SHAPES))
def test_sdpa_read_equals_the_reference(shape, key_norm, dtype):
    sources, partial, query, weight = inputs(READ_SHAPES[shape], dtype, "softmax" if key_norm else "no-key-norm")
    reference, _ = ops_naive.attnres(sources.double(), query.double(), weight.double() if key_norm else None,
                                     partial=None if partial is None else partial.double(), key_norm=key_norm, eps=EPS)
    hidden = sdpa_read(sources, partial, query, weight, key_norm)
    assert hidden.dtype == dtype and hidden.shape == reference.shape and torch.isfinite(hidden).all()
    assert relative(hidden, reference) <= BOUND[dtype]


def layouts(model, input_ids):
    """The layout types of a no-grad forward's depth state (read at the final router)."""
    seen = []
    hook = model.model.final_res.register_forward_pre_hook(lambda _, args: seen.append(type(args[0].constants.layout)))
    with torch.no_grad():
        model(input_ids)
    hook.remove()
    return seen


def test_the_attention_reads_serve_softmax_forwards_of_few_tokens(input_ids, monkeypatch):
    assert layouts(tiny_model(attnres_block_size=2), input_ids) == [SdpaLayout]
    assert layouts(tiny_model(attnres_block_size=2, attnres_score_fn="sigmoid"), input_ids) != [SdpaLayout]
    for dtype in (torch.bfloat16, torch.float16):  # (their partial sums rounded as in training: `sdpa_serves`)
        assert layouts(tiny_model(attnres_block_size=2).to(dtype), input_ids) != [SdpaLayout]
    assert layouts(tiny_model(attnres_block_size=2).double(), input_ids) == [SdpaLayout]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # (traced: inductor fuses the other reads)
    assert layouts(tiny_model(attnres_block_size=2), input_ids) != [SdpaLayout]
    monkeypatch.undo()
    monkeypatch.setattr(attnres_inference, "SDPA_TOKENS", input_ids.numel() - 1)
    assert layouts(tiny_model(attnres_block_size=2), input_ids) != [SdpaLayout]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("knobs", [{}, dict(attnres_rescale_output=True)], ids=["default", "rescale"])
@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_generate_gives_the_tokens_and_logits_of_the_depth_weights_path(block_size, knobs, dtype, input_ids,
                                                                        monkeypatch):
    """Greedy generation through the KV cache: the attention reads (prefill and decode) against the reads that
    compute the depth weights (the state started as for `output_depth_weights=True`, which `generate` does not pass:
    the ops' reads): the same tokens, and logits within fp32 round-off (bf16, the other no-grad reads: within 5% of
    the logits' scale, test_two_phase's bound for bf16 decoding; measured 0.5%)."""
    model = tiny_model(attnres_block_size=block_size, routers=True, **knobs).to(dtype).eval()
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ours = model.generate(input_ids, **greedy)
        start = AttnResState.start.__func__
        monkeypatch.setattr(AttnResState, "start", classmethod(
            lambda cls, embeddings, config, keep_weights=False, model=None: start(cls, embeddings, config, True,
                                                                                  model)))
        reference = model.generate(input_ids, **greedy)
    logits, expected = torch.stack(ours.logits).float(), torch.stack(reference.logits).float()
    assert torch.isfinite(logits).all()
    if dtype == torch.float32:
        torch.testing.assert_close(ours.sequences, reference.sequences, atol=0, rtol=0)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    else:  # (a bf16 near-tie may pick another token, after which the inputs differ: the steps up to the first)
        differ = (ours.sequences != reference.sequences).any(0)[input_ids.shape[1]:].tolist()
        steps = differ.index(True) + 1 if True in differ else len(differ)
        scale = expected.abs().max().item()
        torch.testing.assert_close(logits[:steps], expected[:steps], atol=0.05 * scale, rtol=0)


def test_hidden_states_are_contiguous_as_the_familys(input_ids):
    """A read's output over an `SdpaLayout` is a strided view (the pad dropped); `output_hidden_states` returns each
    contiguous, as Llama's are (code that `.view()`s them keeps working)."""
    model = tiny_model(attnres_block_size=2).eval()
    assert layouts(model, input_ids) == [SdpaLayout]
    with torch.no_grad():
        hidden = model(input_ids, output_hidden_states=True).hidden_states
    assert all(h.is_contiguous() for h in hidden) and hidden[1].view(-1, hidden[1].shape[-1]).shape[0] == input_ids.numel()
