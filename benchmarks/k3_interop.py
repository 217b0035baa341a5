"""How exactly Kimi K3 checkpoints convert: the AttnRes model `attnres convert` makes of a K3-layout folder against an
independent float64 forward of K3's equations (`tests/k3_reference.py`, written from K3's technical report and
released code, not through attnres-hf), for several (layers, `attn_res_block_size`) pairs and layouts.

Each case writes a tiny K3 checkpoint with random weights (every K3 piece on: SiTU-GLU, the latent MoE with its
norm, grouped sigmoid routing, two shared experts, gated MLA, KDA's full-rank output gate and safe forget gate;
random pseudo-queries, so routing is not uniform; hidden 32, vocab 96), converts it, exports it back with
`--to k3-layout`; then on 4 x 24 random tokens: fp32 max |delta logits| against the reference over max |logits|, the
same for the depth weights of every read, and whether the exported text tensors equal the originals bit for bit.
`--results PATH` writes the table, with how it was measured (`benchmarks/_results.py`).

    python benchmarks/k3_interop.py --results docs/results/k3_interop.md   # under a minute on 2 cores
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from _results import run_cases  # noqa: E402

CASES = [  # (label, K3 text-config overrides, write_k3_checkpoint options; "convert": convert's options)
    ("5 layers, blocks of 2 (the last partial)", {}, {}),
    ("5 layers, blocks of 1", {"attn_res_block_size": 1}, {}),
    ("5 layers, blocks of 3 (the last partial)", {"attn_res_block_size": 3}, {}),
    ("5 layers, one block", {"attn_res_block_size": 8}, {}),
    ("text layout", {}, {"layout": "text"}),
    ("bf16 weights (fp32 where K3 keeps fp32), --dtype auto", {}, {"dtype": torch.bfloat16, "convert": {"dtype": "auto"}}),
    ("MXFP4 experts (hidden 64)", "mxfp4", {"mxfp4_experts": True}),
    ("no AttnRes, converted as depth_mixing residual", {"attn_res_block_size": "delete"},
     {"convert": {"depth_mixing": "residual"}}),
]


def measure(label, overrides, options, root: Path, seed: int) -> dict:
    import k3_reference as ref
    from safetensors.torch import load_file

    from attnres_hf import AttnResForCausalLM
    from attnres_hf.conversion import convert, export

    overrides = ref.MXFP4_OVERRIDES if overrides == "mxfp4" else {
        name: ref.DELETE if value == "delete" else value for name, value in overrides.items()}
    config = ref.tiny_k3_text_config(**overrides)
    source, ours, back = root / f"k3-{seed}", root / f"ours-{seed}", root / f"back-{seed}"
    options = dict(options)
    convert_options = options.pop("convert", {})
    state = ref.write_k3_checkpoint(source, config, seed=seed, **options)
    convert(source, ours, **convert_options)
    export(ours, back, to="k3-layout")
    ids = torch.randint(3, config["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(seed))
    model = AttnResForCausalLM.from_pretrained(ours, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(ids, output_depth_weights=model.config.depth_mixing == "attnres")
    expected = ref.k3_reference_logits(state, config, ids)
    weights_delta = None
    if out.depth_weights is not None:
        reads = [w for _, _, w in ref.k3_reference_depth_weights(state, config, ids)]
        mine = [w for w in out.depth_weights if w.shape[-1] > 1]  # layer 0's attention read has one source
        weights_delta = max((a.double() - b).abs().max().item() for a, b in zip(mine, reads, strict=True))
    text = {n.replace("language_model.", "", 1): t for n, t in state.items()
            if not n.startswith(("vision_tower.", "mm_projector."))}
    written = {}
    for path in sorted(back.glob("*.safetensors")):
        written |= load_file(path)
    same = not options.get("mxfp4_experts") and sorted(written) == sorted(text) and all(
        written[n].dtype == text[n].dtype and torch.equal(written[n], text[n]) for n in text)
    return {"case": label, "layers": config["num_hidden_layers"],
            "block": config.get("attn_res_block_size", "none"),
            "max": (out.logits.double() - expected).abs().max().item(), "scale": expected.abs().max().item(),
            "weights": weights_delta,
            "round_trip": "dequantised (bf16 values)" if options.get("mxfp4_experts") else same}


def table(rows) -> str:
    lines = ["| case | layers | K3 `attn_res_block_size` | fp32 max abs delta logits | of max abs logit | "
             "max abs delta depth weights | K3 -> attnres-hf -> K3 text tensors |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        weights = "no AttnRes" if r["weights"] is None else f"{r['weights']:.2g}"
        trip = {True: "bit for bit", False: "DIFFER"}.get(r["round_trip"], r["round_trip"])
        lines.append(f"| {r['case']} | {r['layers']} | {r['block']} | {r['max']:.2g} | {r['max'] / r['scale']:.2g} | "
                     f"{weights} | {trip} |")
    worst = max(r["max"] / r["scale"] for r in rows)
    lines += ["", f"Worst fp32 case {worst:.2g} of the logits' scale against K3's equations in float64."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_cases(__doc__, __file__, argv, CASES, measure, table)


if __name__ == "__main__":
    sys.exit(main())
