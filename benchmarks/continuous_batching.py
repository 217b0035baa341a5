"""Continuous-batching throughput of AttnRes against the matching `transformers` Llama, measured in one run.

Both models go through transformers' own continuous batching (`model.generate_batch`: paged KV cache, requests packed
into one row per step, paged attention through `ALL_ATTENTION_FUNCTIONS`). Same shape for both (default: SmolLM2-135M
with `--layers` layers), random weights shared by the backbone, fp32, greedy, no end of sequence, so both produce the
same number of tokens. For each model the batch runs `--repeats` times, alternating models; the median wall time gives
generated tokens per second. Printed: one row per model and the ratio AttnRes / Llama (1.0 = as fast as Llama), a
Markdown table that `--results PATH` also writes, with how it was measured (`benchmarks/_results.py`).

    python benchmarks/continuous_batching.py                          # CPU, a small workload
    python benchmarks/continuous_batching.py --results docs/results/continuous_batching.md   # the docs' table
    python benchmarks/continuous_batching.py --device cuda --requests 256 --new-tokens 128 --layers 30
"""

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from attnres_hf import AttnResConfig, AttnResForCausalLM, default_attnres_block_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)
from overhead import SMOLLM2_135M  # noqa: E402  (the benchmarks' one SmolLM2-135M shape, benchmarks/overhead.py)


def build_models(layers: int, depth_mixing: str, device: str) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    shape = {**SMOLLM2_135M, "num_hidden_layers": layers}
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    config = AttnResConfig(**shape, depth_mixing=depth_mixing, attnres_block_size=default_attnres_block_size(layers))
    attnres = AttnResForCausalLM(config).eval()
    attnres.load_state_dict(llama.state_dict(), strict=False)  # same backbone; mixing parameters at their init
    return {"llama": llama.to(device), f"attnres({depth_mixing})": attnres.to(device)}


def run_batch(model, prompts, new_tokens: int, cb_config: ContinuousBatchingConfig) -> tuple[float, int]:
    generation_config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=generation_config, continuous_batching_config=cb_config)
    seconds = time.perf_counter() - start
    return seconds, sum(len(out.generated_tokens) for out in outputs.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--depth-mixing", default="attnres")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt; lengths vary from a quarter")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the table, with how it was measured, to PATH "
                        "(a Markdown fragment, e.g. docs/results/continuous_batching.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, args.prompt_len // 4), args.prompt_len + 1, (args.requests,), generator=generator)
    prompts = [torch.randint(3, 1000, (int(n),), generator=generator).tolist() for n in lengths]
    pages = args.requests * (args.prompt_len + args.new_tokens + 15) // 16 + 1
    cb_config = ContinuousBatchingConfig(page_size=16, num_blocks=pages, max_batch_tokens=args.max_batch_tokens)
    models = build_models(args.layers, args.depth_mixing, args.device)

    for model in models.values():  # warm-up, not timed
        run_batch(model, prompts[:2], 2, cb_config)
    times = {name: [] for name in models}
    tokens = {}
    for _ in range(args.repeats):
        for name, model in models.items():
            seconds, tokens[name] = run_batch(model, prompts, args.new_tokens, cb_config)
            times[name].append(seconds)

    text = report(args, lengths, models, times, tokens)
    print(text)
    if args.results:
        measured.write(args.results, text, device=args.device)


def report(args, lengths, models, times, tokens) -> str:
    """The printed table (Markdown; also what `--results` writes)."""
    lines = [f"Continuous batching, {args.device}, {args.layers} layers (SmolLM2-135M width), {args.requests} "
             f"requests, prompts {int(lengths.min())}-{int(lengths.max())} tokens, {args.new_tokens} new tokens each, "
             f"median of {args.repeats}:", "", "| model | generated tokens / s | tokens |", "|---|---|---|"]
    throughput = {}
    for name in models:
        throughput[name] = tokens[name] / statistics.median(times[name])
        lines.append(f"| {name} | {throughput[name]:.1f} | {tokens[name]} |")
    llama, attnres = throughput["llama"], throughput[f"attnres({args.depth_mixing})"]
    lines += ["", f"Throughput ratio attnres/llama: {attnres / llama:.3f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
