"""The routing explorer (`write_routing_explorer`): the page holds the record's numbers, and a real headless browser
(Debian's chromium, driven by playwright) shows them for the token chosen, as alpha or alpha * ||v||, as the mean
over tokens and as a pair's difference, for every depth-mixing method that returns depth weights."""

import importlib.util
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_hf.analysis import display_tokens, record_routing, write_routing_explorer
from attnres_hf.analysis.explorer import SIGNIFICANT_DIGITS, explorer_html
from attnres_hf.modeling.depth_mixing import DEPTH_MIXING
from utils import METHODS, variant_model

CHROMIUM = Path("/usr/bin/chromium")
# headless and offline: the machine's network is closed, and the page must need none
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# Tolerance: the page stores each number to 5 significant digits, so a stored value is within 5e-5 of the record's
# relative to its own magnitude; a mean over tokens or a difference the page computes from stored values is then
# within 5e-5 times the sum of the magnitudes it combines (float64 arithmetic adds ~1e-16 of it). The tests allow
# twice that: 1e-4 times those magnitudes, per cell.
RELATIVE = 1e-4
assert SIGNIFICANT_DIGITS == 5

# One tiny model per method with depth weights (generic over DEPTH_MIXING: a method added later is tested too), with
# Full and Block AttnRes and per-head AttnRes rows.
PAGE_VARIANTS = {"attnres-full": {"attnres_block_size": 1}, "attnres-block2": {"attnres_block_size": 2},
                 "attnres-heads2": {"attnres_block_size": 2, "attnres_num_heads": 2}} | {
    name: overrides for name, overrides in METHODS.items() if name != "attnres" and DEPTH_MIXING[name].routing_maps}


def pair_of_records(overrides: dict):
    model = variant_model(overrides)
    return (record_routing(model, torch.tensor([5, 9, 14, 20, 31, 47, 60])),
            record_routing(model, torch.tensor([5, 9, 70, 20, 31])))


def expected(record, quantity: str, token):
    """`(map, bound)` the page must show for `token` (an index or "mean"): `(rows, sources)`, NaN where unread."""
    values = getattr(record, quantity)
    if token == "mean":
        with warnings.catch_warnings():  # all-NaN cells (sources a row cannot read) stay NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(values, axis=1), RELATIVE * np.nanmean(np.abs(values), axis=1)
    return values[:, token], RELATIVE * np.abs(values[:, token])


def assert_close(shown: np.ndarray, want: tuple[np.ndarray, np.ndarray]):
    value, bound = want
    assert shown.shape == value.shape
    assert np.array_equal(np.isnan(shown), np.isnan(value)), "the page greys other cells than the record leaves out"
    finite = ~np.isnan(value)
    worst = np.abs(shown - value)[finite] - bound[finite]
    assert (worst <= 0).all(), f"off by up to {worst.max():.3g} beyond the bound"


def page_data(page: str) -> dict:
    """The data the page holds (its JSON script element)."""
    (data,) = re.findall(r'<script type="application/json" id="explorer-data">(.*?)</script>', page, re.DOTALL)
    return json.loads(data)


def stored_map(data: dict, input: int, quantity: str, token: int) -> np.ndarray:
    """The page's stored numbers for one token, laid out `(rows, sources)` as the page does."""
    flat, columns = data["inputs"][input][quantity], data["columns"]
    stride = sum(len(c) for c in columns)
    out = np.full((len(data["rows"]), len(data["sources"])), np.nan)
    offset = 0
    for r, cols in enumerate(columns):
        for k, c in enumerate(cols):
            value = flat[token * stride + offset + k]
            out[r, c] = np.nan if value is None else value
        offset += len(cols)
    return out


@pytest.mark.parametrize("name", list(PAGE_VARIANTS))
def test_the_page_stores_the_records_numbers_to_five_digits(name, tmp_path):
    """Without a browser too: every stored number is the record's to 5 significant digits, in the page's layout."""
    records = pair_of_records(PAGE_VARIANTS[name])
    data = page_data(write_routing_explorer(records, tmp_path / "page.html").read_text())
    assert data["rows"] == records[0].routers and data["sources"] == records[0].sources
    for i, record in enumerate(records):
        assert data["inputs"][i]["tokens"] == record.tokens and data["inputs"][i]["label"] == "AB"[i]
        for quantity in ("weights", "contributions"):
            for t in range(len(record.tokens)):
                values = getattr(record, quantity)[:, t]  # each stored number: within 5e-5 of its magnitude
                assert_close(stored_map(data, i, quantity, t), (values, 0.5 * RELATIVE * np.abs(values)))


@pytest.mark.parametrize("tokens, shown", [
    (["Ġthe", "Ċ", "ĠâĢĶ", "âĢ", "<s>", "w5"], [" the", "\n", " —", "âĢ", "<s>", "w5"]),  # byte-level BPE
    (["▁the", "<0x0A>", "<0xE2>", "café", ""], [" the", "\n", "<0xE2>", "café", ""]),  # SentencePiece; as written
], ids=["byte-level", "sentencepiece"])
def test_display_tokens_decodes_what_decodes_and_keeps_the_rest(tokens, shown):
    assert display_tokens(tokens) == shown


NASTY = ['</script><b id="injected">x</b>', "a & b", "\"quoted\" 'single'", "two\nlines", "<!--", "__DATA__", "Ġ<"]


def test_the_page_is_self_contained_and_keeps_token_text_as_text(tmp_path):
    record = pair_of_records({"attnres_block_size": 2})[0]
    page = explorer_html(record, tokens=[NASTY], title="<b>my</b> & model")
    assert not re.search(r"https?:|<link|\ssrc=|@import|url\(", page), "the page must load nothing"
    assert page.count("</script>") == 2 and '<b id="injected"' not in page  # the data's and the script's ends only
    assert "<title>&lt;b&gt;my&lt;/b&gt; &amp; model</title>" in page
    data = page_data(page)
    assert data["inputs"][0]["display"] == NASTY and data["title"] == "<b>my</b> & model"
    # the data once (the token "__DATA__" is not filled in), the title filled in
    assert page.count('"significant_digits": 5') == 1 and page.count("__DATA__") == 1 and "__TITLE__" not in page


@pytest.mark.parametrize("records, kwargs, error, message", [
    ("a string", {}, TypeError, "must be a RoutingRecord or a list"),
    ("none", {}, ValueError, "one input or a pair, got 0"),
    ("three", {}, ValueError, "one input or a pair, got 3"),
    ("two models", {}, ValueError, "different rows or sources"),
    ("pair", {"labels": ["a"]}, ValueError, "labels must be 2 distinct"),
    ("pair", {"labels": ["a", "a"]}, ValueError, "labels must be 2 distinct"),
    ("pair", {"tokens": [["x"], ["y"]]}, ValueError, "as long as the record's tokens"),
    ("pair", {"title": 5}, TypeError, "title must be a string"),
    ("pair", {"path": "existing.html"}, FileExistsError, "already exists; pass --force"),
    ("pair", {"path": "."}, IsADirectoryError, "is a folder"),
    ("pair", {"path": "new_folder/"}, IsADirectoryError, "is a folder"),  # (a name that says it is one)
], ids=["not-records", "none", "three", "two-models", "one-label", "same-labels", "token-count", "title", "exists",
        "folder", "folder-name"])
def test_write_routing_explorer_refuses_bad_input(records, kwargs, error, message, tmp_path):
    a, b = pair_of_records({"attnres_block_size": 2})
    other = pair_of_records(METHODS["denseformer"])[0]
    records = {"a string": "a", "none": [], "three": [a, b, a], "two models": [a, other], "pair": [a, b]}[records]
    (tmp_path / "existing.html").write_text("mine")
    kwargs = {"path": "new.html"} | kwargs
    with pytest.raises(error, match=message):
        path = kwargs.pop("path")  # (a string keeps a trailing slash, which a Path drops)
        write_routing_explorer(records, f"{tmp_path}/{path}" if path.endswith("/") else tmp_path / path, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.html"]  # nothing written, no staging file left
    assert (tmp_path / "existing.html").read_text() == "mine"
    write_routing_explorer([a, b], tmp_path / "existing.html", force=True)
    assert page_data((tmp_path / "existing.html").read_text())["inputs"][1]["tokens"] == b.tokens


# ---------------------------------------------------------------------------------------------------------------
# In the browser
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium under playwright (which downloads no browser of its own with `executable_path`)."""
    missing = [what for what, present in (
        (f"the chromium executable {CHROMIUM} (apt-get install chromium)", CHROMIUM.is_file()),
        ("the playwright package (pip install playwright; the test extra)", importlib.util.find_spec("playwright")),
    ) if not present]
    if missing:
        pytest.skip("the browser test needs " + " and ".join(missing))
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Explorer:
    """One open page, collecting console errors and uncaught exceptions."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1200, "height": 900})
        self.errors = []
        self.page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(path.resolve().as_uri())

    def shown(self) -> np.ndarray:
        """The map's cells as numbers: each cell's `data-value` (what the page computed), NaN for a greyed cell."""
        cells = self.page.eval_on_selector_all(
            "#map td.cell", "cells => cells.map(c => [+c.dataset.row, +c.dataset.col, c.dataset.value ?? null])")
        out = np.full((max(r for r, _, _ in cells) + 1, max(c for _, c, _ in cells) + 1), np.nan)
        for r, c, value in cells:
            out[r, c] = np.nan if value is None else float(value)
        return out

    def choose(self, input: int, token):
        self.page.click(f"#input-{input} [data-token='{token}']")

    def caption(self) -> str:
        return self.page.text_content("#caption")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PAGE_VARIANTS))
def test_the_page_shows_the_chosen_tokens_map_contributions_mean_and_difference(name, browser, tmp_path):
    a, b = pair_of_records(PAGE_VARIANTS[name])
    page = Explorer(browser, write_routing_explorer([a, b], tmp_path / "page.html"))
    assert_close(page.shown(), expected(a, "weights", len(a.tokens) - 1))  # opens on A's last token
    page.choose(0, 2)
    assert_close(page.shown(), expected(a, "weights", 2))
    assert "A, token 2" in page.caption()
    page.page.check("input[name=quantity][value=contributions]")
    assert_close(page.shown(), expected(a, "contributions", 2))
    page.choose(0, "mean")
    assert_close(page.shown(), expected(a, "contributions", "mean"))
    page.choose(1, 3)  # a token of B shows B's map
    assert_close(page.shown(), expected(b, "contributions", 3))
    page.page.check("input[name=view][value=diff]")  # B's token 3 minus A's mean
    (want_b, bound_b), (want_a, bound_a) = expected(b, "contributions", 3), expected(a, "contributions", "mean")
    assert_close(page.shown(), (want_b - want_a, bound_b + bound_a))
    page.choose(0, 4)
    page.page.check("input[name=quantity][value=weights]")
    (want_b, bound_b), (want_a, bound_a) = expected(b, "weights", 3), expected(a, "weights", 4)
    assert_close(page.shown(), (want_b - want_a, bound_b + bound_a))
    shown_a, shown_b = display_tokens(a.tokens), display_tokens(b.tokens)
    assert page.caption() == f"α: B, token 3 “{shown_b[3]}”  minus  A, token 4 “{shown_a[4]}”"
    page.choose(1, "mean")
    page.choose(0, "mean")
    (want_b, bound_b), (want_a, bound_a) = expected(b, "weights", "mean"), expected(a, "weights", "mean")
    assert_close(page.shown(), (want_b - want_a, bound_b + bound_a))
    page.page.screenshot(path=tmp_path / "explorer.png", full_page=True)
    assert (tmp_path / "explorer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "explorer.png").stat().st_size > 10_000
    assert page.errors == []


@pytest.mark.slow
def test_one_input_shows_no_pair_switch_and_renders_token_text_as_text(browser, tmp_path):
    record = pair_of_records({"attnres_block_size": 2})[0]
    page = Explorer(browser, write_routing_explorer(record, tmp_path / "one.html", tokens=[NASTY]))
    assert page.page.is_hidden("#view") and page.page.query_selector("#injected") is None
    texts = page.page.eval_on_selector_all("#input-0 .tok", "spans => spans.map(s => s.textContent)")
    assert texts == [t.replace("\n", "↵") for t in NASTY]
    assert page.page.get_attribute("#input-0 .tok[data-token='0']", "title") == "0: " + record.tokens[0]
    page.choose(0, 1)
    page.page.focus("#input-0 .tok[data-token='1']")
    page.page.keyboard.press("ArrowRight")  # the keyboard moves the choice too
    assert_close(page.shown(), expected(record, "weights", 2))
    page.page.screenshot(path=tmp_path / "one.png")
    assert (tmp_path / "one.png").stat().st_size > 5_000 and page.errors == []
