"""How exactly fla checkpoints convert: flash-linear-attention 0.6's `TransformerForCausalLM` against the AttnRes model
`attnres convert` makes of it, for several (layers, block size) pairs and each fla option that maps to a family.

For each case a tiny fla model (hidden 32, GQA 4/2 heads, vocab 99) gets random non-zero pseudo-queries, key-norm and
norm weights (trained-like), is saved, converted with `attnres_hf.conversion.convert`, exported back with `export`;
then on 4 x 32 random tokens: fp32 max |delta logits| against fla's model (run on the CPU with its CUDA-only kernels
replaced by its reference functions, `attnres_hf.conversion.fla_cpu`) over max |logits|; in bf16, the mean |delta|
from fla's fp32 logits, ours against fla's own bf16 (over mean |logits|); and whether the exported tensors equal
fla's originals bit for bit. `--results PATH` writes the table, with how it was measured (`benchmarks/_results.py`).

    python benchmarks/fla_interop.py --results docs/results/fla_interop.md   # about a minute on 2 cores
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import run_cases  # noqa: E402

TINY = dict(hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=99, intermediate_size=64,
            max_position_embeddings=128, fuse_cross_entropy=False)
"""A tiny fla transformer (hidden 32, GQA 4/2 heads, vocab 99); fla's fused norm and SwiGLU stay on (kernels only)."""
CASES = [  # (label, decoder layers, attnres_block_size, fla options)
    ("Full", 3, 1, {}), ("blocks of 2", 3, 2, {}), ("blocks of 4", 4, 4, {}),
    ("blocks of 4, the last partial", 3, 4, {}), ("blocks of 6, the last partial", 5, 6, {}),
    ("one block", 2, 8, {}), ("qkv_bias (qwen2)", 3, 2, {"qkv_bias": True}),
    ("qk_norm (qwen3)", 3, 2, {"qk_norm": True, "norm_eps": 1e-5}), ("window_size 5 (mistral)", 3, 2, {"window_size": 5}),
    ("no AttnRes, converted as depth_mixing residual", 3, None, {"convert": {"depth_mixing": "residual"}}),
    ("no AttnRes, retrofitted into blocks of 4 (rescaled)", 3, None, {"convert": {"attnres_block_size": 4}}),
]
"""A plain fla transformer converts as any source: a retrofit (the rescaled router output, exact; fla cannot compute
it, so no round trip) or the residual model (which goes back)."""


def fla_model(layers=3, block_size=2, seed=0, **options):
    """fla's model with random non-zero pseudo-queries, key-norm and norm weights and biases (trained-like; fla
    initialises pseudo-queries to zero and norms to one); `options`: further `TransformerConfig` fields."""
    from fla.models import TransformerConfig, TransformerForCausalLM

    from attnres_hf.conversion.fla_cpu import fla_reference_kernels

    with fla_reference_kernels():
        torch.manual_seed(seed)
        model = TransformerForCausalLM(TransformerConfig(**(TINY | options), num_hidden_layers=layers,
                                                         attnres_block_size=block_size)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("res_proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def logits(folder, ids, dtype, fla: bool):
    from transformers import AutoModelForCausalLM

    from attnres_hf.conversion.fla_cpu import fla_reference_kernels

    with fla_reference_kernels():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        with torch.no_grad():
            return model(ids).logits.float()


def measure(label, layers, block_size, options, root: Path, seed: int) -> dict:
    from safetensors.torch import load_file

    from attnres_hf.conversion import convert, export

    fla_dir, ours, back = root / f"fla-{seed}", root / f"ours-{seed}", root / f"back-{seed}"
    options = dict(options)
    overrides = options.pop("convert", {})
    fla_model(layers, block_size, seed, **options).save_pretrained(fla_dir)
    report = convert(fla_dir, ours, **overrides)
    goes_back = overrides.get("depth_mixing", "attnres") == "residual" or block_size is not None
    if goes_back:
        export(ours, back)
    ids = torch.randint(3, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(seed))
    reference = logits(fla_dir, ids, torch.float32, fla=True)
    ours_fp32 = logits(ours, ids, torch.float32, fla=False)

    def mean_error(values):
        return ((values - reference).abs().mean() / reference.abs().mean()).item()

    round_trip = None
    if goes_back:
        before, after = load_file(fla_dir / "model.safetensors"), load_file(back / "model.safetensors")
        round_trip = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    return {
        "case": label, "layers": layers, "block": "none" if block_size is None else block_size,
        "max": (ours_fp32 - reference).abs().max().item(),
        "relative": ((ours_fp32 - reference).abs().max() / reference.abs().max()).item(),
        "fla_bf16": mean_error(logits(fla_dir, ids, torch.bfloat16, fla=True)),
        "ours_bf16": mean_error(logits(ours, ids, torch.bfloat16, fla=False)),
        "exact": report["verification"]["exact"],
        "round_trip": round_trip,
    }


def table(rows) -> str:
    lines = ["| case | layers | fla `attnres_block_size` | fp32 max abs delta logits | of max abs logit | report `exact` | "
             "bf16 mean delta from fla fp32: ours / fla's own | fla -> attnres-hf -> fla tensors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['layers']} | {r['block']} | {r['max']:.2g} | {r['relative']:.2g} | "
                     f"{r['exact']} | {r['ours_bf16']:.3g} / {r['fla_bf16']:.3g} | "
                     f"{ {True: 'bit for bit', False: 'DIFFER', None: 'not exportable'}[r['round_trip']] } |")
    worst = max(r["relative"] for r in rows)
    ratio = max(r["ours_bf16"] / r["fla_bf16"] for r in rows)
    lines.append("")
    lines.append(f"Worst fp32 case {worst:.2g} of the logits' scale (the report's `exact` bound: 1e-4); in bf16 the "
                 f"converted model is at most {ratio:.2f} times as far from fla's fp32 logits as fla's own bf16.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_cases(__doc__, __file__, argv, CASES, measure, table)


if __name__ == "__main__":
    sys.exit(main())
