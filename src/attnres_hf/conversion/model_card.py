"""The model card (`README.md`) of a converted folder: what was converted, how, and how exactly, from the conversion
report (`convert`'s `conversion_report.json`)."""

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .. import __version__
from ..modeling.depth_mixing import DEPTH_MIXING

CITATION = """@article{kimi2026attnres,
  title   = {Attention Residuals},
  author  = {Kimi Team},
  journal = {arXiv preprint arXiv:2603.15031},
  year    = {2026}
}"""


def model_card(report: dict) -> ModelCard:
    """A model card (huggingface_hub `ModelCard`) describing the conversion and its verification."""
    source = report["source"]
    config = report["config"]
    verification = report["verification"]
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=source["name"] if source["name"] and not Path(source["name"]).exists() else None,
        tags=["attnres", "attention-residuals", "depth-mixing", "retrofit"],
    )
    if config["depth_mixing"] != "attnres":
        method = DEPTH_MIXING[config["depth_mixing"]].card.rstrip(".") + f' (`depth_mixing="{config["depth_mixing"]}"`)'
    elif config["attnres_block_size"] == 1:
        method = "Full Attention Residuals (every sub-layer output is a depth source)"
    else:
        method = (
            f"Block Attention Residuals, {config['attnres_block_size']} sub-layers per block "
            f"({config['num_attnres_blocks']} blocks over {config['num_sublayers']} sub-layers)"
        )
    if source.get("imported_routers") and source.get("format") == "k3":
        start = (
            "Imported from a Kimi K3 checkpoint: every text tensor, its trained routers included, copied unchanged "
            "(K3's\n  `[1, hidden]` pseudo-queries as `[hidden]`, its q/k/v convolutions as one, its experts "
            f"stacked{', dequantised exactly from MXFP4' if source.get('mxfp4_experts') else ''}), with "
            "`attnres_block_size`\n  twice K3's `attn_res_block_size` (K3 counts decoder layers, "
            "attnres-hf sub-layers) and the plain mean\n  (`attnres_rescale_output=False`). Layer 0's attention "
            "router reads one source, so its weights never act;\n  they are kept so that `attnres export --to "
            "k3-layout` gives them back."
        )
    elif source.get("imported_routers"):
        start = (
            "Imported from a flash-linear-attention checkpoint with AttnRes: every tensor, its trained routers "
            "included, copied\n  unchanged (fla's `[1, hidden]` pseudo-queries stored as `[hidden]`), with fla's "
            "block size and its plain mean\n  (`attnres_rescale_output=False`). Layer 0's attention router reads one "
            "source, so its weights never act;\n  they are kept so that `attnres export --to fla` gives them back."
        )
    elif config["depth_mixing"] == "attnres":
        rescaled = ", rescaled by their number" if config["attnres_rescale_output"] else ""
        start = (
            "Every backbone weight is copied unchanged; the depth routers' pseudo-queries are zero, so at conversion "
            f"time the\n  model computes the source's function (routers output the mean of their sources{rescaled}; "
            "RMSNorm makes that the residual\n  stream). Training the routers makes it depart from the source."
        )
    else:
        start = (
            "Every backbone weight is copied unchanged and every depth-mixing parameter is at the initialisation "
            "under which\n  the method is the residual model, so at conversion time the model computes the source's "
            "function. Training\n  the mixing parameters makes it depart from the source."
        )
    compared = verification.get("compared_with")
    compared_row = (
        f"| compared with | {compared['model']} on {compared['device']}, its CUDA-only kernels replaced by reference "
        f"functions (`conversion_report.json`) |\n| exact (max delta within 1e-4 of max abs logit, same top tokens) | "
        f"{verification['exact']} |\n" if compared else ""
    )
    gguf_row = ""
    if "gguf_tensors_checked" in verification:
        checked, held = verification["gguf_tensors_checked"], verification["gguf_tensors"]
        sample = "" if checked == held else " (a sample: each tensor kind in the first and last block)"
        gguf_row = (f"| GGUF tensors equal to the file's (dequantised) | {checked} of {held}{sample}, max abs delta "
                    f"{verification['gguf_max_abs_delta']:.3g} |\n")
    if "max_abs_logit_delta" in verification:
        rows = (f"| max abs logit delta vs source | {verification['max_abs_logit_delta']:.3g} |\n"
                f"| mean abs logit delta | {verification['mean_abs_logit_delta']:.3g} |\n"
                f"| top-1 agreement | {verification['argmax_agreement']:.4f} |\n"
                f"| {verification['greedy_new_tokens']}-token greedy continuation identical | "
                f"{verification['greedy_match']} |\n")
    elif "tensors_not_written_back" in verification:  # a Kimi K3 AttnRes checkpoint: no K3 runtime to compare
        # logits with; the mapping is checked
        rows = (f"| K3 tensors written back identical (of {verification['tensors_checked']}) | "
                f"{verification['tensors_identical']} |\n| logits compared with K3's own code | no (none runs here; "
                "the forward is tested against an independent reference of K3's equations) |\n")
    else:  # a streamed conversion of an fla or K3 AttnRes checkpoint: its written tensors against the checkpoint's
        rows = (f"| tensors written identical to the checkpoint's (of {verification['tensors_checked']}) | "
                f"{verification['tensors_identical']} |\n| logits compared with the source's own code | no (a "
                "streamed check) |\n")
    made = "imported" if source.get("imported_routers") else "retrofitted"
    # a tokenizer that is the folder's own code (Kimi's) loads only with trust_remote_code
    trusted = ", trust_remote_code=True" if source.get("tokenizer_code") else ""
    body = f"""
# {Path(report["output_dir"]).name}

An [Attention Residuals](https://arxiv.org/abs/2603.15031) (AttnRes) model {made} from
`{source["name"]}` ({source["model_type"]}) with attnres-hf {__version__}.

- Method: {method}.
- {start}
- dtype: `{report["dtype"]}`.

## Verification (fp32, at conversion time)

| check | value |
|---|---|
| probe tokens | {verification["num_probe_tokens"]} |
{rows}{compared_row}{gguf_row}
## Use

```python
import attnres_hf  # registers the model with the Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{Path(report["output_dir"]).name}")  # this folder or its Hub id
tokenizer = AutoTokenizer.from_pretrained("{Path(report["output_dir"]).name}"{trusted})
```

Without attnres-hf installed, the folder's own modeling files run: pass `trust_remote_code=True` to both
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` (the tokenizer reads this folder's
`config.json`, whose `attnres` model type transformers does not know, and otherwise asks).

Serve it behind transformers' OpenAI-compatible server (`/v1/chat/completions`, `/v1/completions`):

```bash
pip install "attnres-hf[serve]"
attnres serve {Path(report["output_dir"]).name} --port 8000   # options of `transformers serve`, e.g. --continuous-batching
```

Load it in 4 bits (NF4; the depth-mixing parameters stay fp32) and fine-tune it:

```python
import attnres_hf
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")  # load_in_4bit=True alone is FP4
model = AutoModelForCausalLM.from_pretrained("{Path(report["output_dir"]).name}", quantization_config=nf4)
```

```bash
attnres train {Path(report["output_dir"]).name} --data train.txt --method lora --output-dir out   # or routers, qlora, full
```

## Citation

```bibtex
{CITATION}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
