import math

import pytest
import torch

from attnres_hf.eval.perplexity import perplexity, sliding_windows
from utils import tiny_model


@pytest.mark.parametrize("n, window, stride", [(10, 4, 3), (10, 4, 1), (4096, 512, 511), (3, 8, 7), (513, 512, 256)])
def test_sliding_windows_score_every_position_once_within_the_window(n, window, stride):
    windows = sliding_windows(n, window, stride)
    scored = [p for _, first, end in windows for p in range(first, end)]
    assert scored == list(range(1, n))
    assert all(0 <= begin < first and end - begin <= window for begin, first, end in windows)


def test_perplexity_equals_a_single_full_forward_when_the_text_fits(input_ids):
    model = tiny_model()
    ids = input_ids[0]
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    expected = math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())
    result = perplexity(model, ids, window=64, progress=False)
    assert result["tokens"] == ids.numel() - 1
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)
    windowed = perplexity(model, ids, window=4, stride=2, progress=False)
    assert windowed["tokens"] == ids.numel() - 1 and windowed["perplexity"] != pytest.approx(expected, rel=1e-5)


def test_perplexity_rejects_bad_arguments():
    model = tiny_model()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, torch.tensor([5]))
    with pytest.raises(ValueError, match="stride must be between 1 and window - 1"):
        perplexity(model, torch.arange(3, 20), window=4, stride=4)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"stride": 0}, ValueError, "stride must be between 1"),
    ({"stride": -1}, ValueError, "stride must be between 1"),
    ({"window": 1}, ValueError, "window must be at least 2"),
    ({"window": "64"}, TypeError, "window must be int"),
    ({"stride": 2.5}, TypeError, "stride must be int"),
    ({"input_ids": torch.rand(10)}, TypeError, "integer token ids"),
    ({"input_ids": [1, 2, 3]}, TypeError, "input_ids must be Tensor"),
    ({"input_ids": torch.arange(20).reshape(2, 10)}, ValueError, "one sequence"),
    ({"model": "not a model"}, TypeError, "model must be Module"),
])
def test_perplexity_names_each_bad_argument(kwargs, error, message):
    arguments = {"model": tiny_model(), "input_ids": torch.arange(3, 20), "window": 8, "progress": False} | kwargs
    with pytest.raises(error, match=message):
        perplexity(**arguments)


@pytest.mark.parametrize("ids", [[5, 99, 7], [5, -1, 7], [5, 10_000, 7]])
def test_perplexity_rejects_ids_outside_the_vocabulary(ids):
    """Ids from another tokenizer are named as such, not an `IndexError` from inside the embedding."""
    model = tiny_model().eval()  # vocab_size 99
    with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, 98\]"):
        perplexity(model, torch.tensor(ids), progress=False)
