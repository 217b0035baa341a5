"""Paired inputs that differ in one place: how does the depth routing shift after the difference?

Each pair `(a, b)` is tokenised; the positions after the first differing token are aligned from the end (the
shared suffix), so position `k` of the suffix is the same text in both. Per router and source, the shift is the mean
over pairs of (mean alpha over the aligned suffix in `b`) minus (the same in `a`), with a percentile bootstrap
interval over pairs; `values="contributions"` compares `alpha_i * ||v_i||` (what reaches the router's output) instead.
"""

import json
import os
from pathlib import Path

import numpy as np

from .._checks import check_int
from ..modeling.depth_mixing import DEPTH_MIXING, ROUTER_METHODS, has_routers
from .inputs import encode_text
from .routing import record_routing

EXAMPLE_PAIRS = Path(__file__).parent / "data" / "routing_pairs.jsonl"
"""Shipped example: 12 short texts, each with one word changed so that the rest of the text reads as consistent
(`a`) or contradicted (`b`) by what came before."""


def load_pairs(path: str | Path) -> list[dict]:
    """Read a `.jsonl` file of `{"a": text, "b": text}` lines (an optional `"name"` is kept).

    Raises:
        FileNotFoundError: no such file.
        TypeError: `path` is not a path.
        ValueError: a line that is not JSON or lacks `a`/`b`, or an empty file.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a .jsonl file path, got {type(path).__name__}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such pairs file")
    pairs = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            pair = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(pair, dict) or not isinstance(pair.get("a"), str) or not isinstance(pair.get("b"), str):
            raise ValueError(f'{path}:{number}: expected {{"a": "...", "b": "..."}}')
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path} has no pairs")
    return pairs


def aligned_suffix(ids_a: list[int], ids_b: list[int]) -> int:
    """Length of the shared token suffix after the first difference (0 if the texts never re-align).

    Raises:
        TypeError: the ids are not lists of integers.
    """
    for ids in (ids_a, ids_b):
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
            raise TypeError("aligned_suffix takes two lists of token ids (tensor.tolist())")
    prefix = 0
    while prefix < min(len(ids_a), len(ids_b)) and ids_a[prefix] == ids_b[prefix]:
        prefix += 1
    if prefix == len(ids_a) == len(ids_b):  # identical: every position after the start is "after the difference"
        return len(ids_a) - 1
    suffix = 0
    limit = min(len(ids_a), len(ids_b)) - prefix - 1  # at least the differing token stays out
    while suffix < limit and ids_a[-1 - suffix] == ids_b[-1 - suffix]:
        suffix += 1
    return suffix


VALUES = ("weights", "contributions")
"""What `compare_pairs` compares: the depth weights alpha, or the contributions alpha * ||v|| (`RoutingRecord`)."""


def compare_pairs(
    model, tokenizer, pairs: list[dict], bootstrap: int = 2000, seed: int = 0, chat: bool = False,
    values: str = "weights",
) -> dict:
    """Shift of the depth weights (b minus a) after the difference, per router and source (`values="contributions"`:
    of `alpha_i * ||v_i||`, in the units of the value norms, L2 per token).

    Each text is encoded with `encode_text` (`chat=True`: as the user turn of the chat template). Returns `routers`,
    `sources`, `shift` (`(n_routers, n_sources)`, NaN where a router cannot read a source), `low`/`high` (95%
    bootstrap interval over pairs), `aligned_tokens` per pair, `pairs_used` and `max_abs_shift`.

    Raises:
        TypeError: `pairs` is not a list of `{"a": str, "b": str}` dicts, or `bootstrap`/`seed` not integers.
        ValueError: no pairs, `bootstrap < 1`, `values` not one of `VALUES`, or no pair with aligned tokens after its
            difference (and the errors of `record_routing` for a model without routers).
    """
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, dict) and isinstance(p.get("a"), str) and isinstance(p.get("b"), str) for p in pairs):
        raise TypeError('pairs must be a list of {"a": text, "b": text} dicts (load_pairs reads a .jsonl file)')
    if not pairs:
        raise ValueError("pairs is empty")
    check_int("bootstrap", bootstrap, 1, "resample")
    check_int("seed", seed)
    if values not in VALUES:
        raise ValueError(f"values must be one of {VALUES}, got {values!r}")
    depth_mixing = getattr(model.config, "depth_mixing", None)
    if depth_mixing not in DEPTH_MIXING or not has_routers(depth_mixing):
        raise ValueError(f"routing maps need a model with depth routers (depth_mixing one of {ROUTER_METHODS}); "
                         f"this one has none (depth_mixing {depth_mixing!r})")
    per_pair, aligned, record = [], [], None
    for pair in pairs:
        ids_a = encode_text(tokenizer, pair["a"], chat=chat)
        ids_b = encode_text(tokenizer, pair["b"], chat=chat)
        suffix = aligned_suffix(ids_a.tolist(), ids_b.tolist())
        aligned.append(suffix)
        if suffix == 0:
            continue
        record_a = record_routing(model, ids_a, tokenizer)
        record = record_routing(model, ids_b, tokenizer)
        read_a, read_b = (r.weights if values == "weights" else r.contributions for r in (record_a, record))
        mean_a = read_a[:, -suffix:].mean(axis=1)
        mean_b = read_b[:, -suffix:].mean(axis=1)
        per_pair.append(mean_b - mean_a)
    if not per_pair:
        raise ValueError("no pair has tokens after its difference that align in both texts")
    diffs = np.stack(per_pair)  # (pairs, routers, sources)
    rng = np.random.default_rng(seed)
    samples = rng.integers(0, len(diffs), size=(bootstrap, len(diffs)))
    boot = diffs[samples].mean(axis=1)  # (bootstrap, routers, sources)
    shift = diffs.mean(axis=0)
    return {
        "routers": record.routers,
        "sources": record.sources,
        "shift": shift,
        "low": np.percentile(boot, 2.5, axis=0),
        "high": np.percentile(boot, 97.5, axis=0),
        "aligned_tokens": aligned,
        "pairs_used": len(per_pair),
        "max_abs_shift": float(np.nanmax(np.abs(shift))),
    }


def largest_shifts(result: dict) -> list[dict]:
    """Per router of a `compare_pairs` result, the source whose weight shifted most: `{"router", "source", "shift",
    "low", "high"}` (the shift b minus a and its 95% bootstrap interval)."""
    rows = []
    for r, router in enumerate(result["routers"]):
        shift = result["shift"][r]
        c = int(np.nanargmax(np.abs(shift)))
        rows.append({"router": router, "source": result["sources"][c], "shift": float(shift[c]),
                     "low": float(result["low"][r, c]), "high": float(result["high"][r, c])})
    return rows
