"""Bytes sent per training step by the AttnRes pipeline (`attnres_hf.training.pipeline_parallel`), with and without
the paper's cross-stage caching (arXiv:2603.15031, §4), next to the formula's prediction.

The bytes are counted on the send ops the pipeline stages actually post (activations forward, their gradients
backward), summed over all ranks, for one `ScheduleInterleaved1F1B` step. Default shape: SmolLM2-135M (30 layers,
hidden 576, vocab 49152, tied embeddings; random weights, fp32 on CPU, or `--dtype bfloat16`) with
`attnres_block_size` from `default_attnres_block_size` (8 sub-layers: 8 blocks), 2 ranks x 3 virtual stages of 5
layers. The step's loss is
printed for both runs (caching changes what is sent, not the numbers). A last line gives the formula for bf16
training at the same split and `--formula-seq-len` tokens per micro-batch. `--results PATH` writes the same table,
with how it was measured, as a Markdown fragment (`benchmarks/_results.py`).

    python benchmarks/pipeline_bytes.py                                   # spawns 2 gloo processes on CPU
    torchrun --nproc-per-node 2 benchmarks/pipeline_bytes.py --layers 8   # or under torchrun (any rank count)
    python benchmarks/pipeline_bytes.py --results docs/results/pipeline_bytes.md   # the docs' table
    python benchmarks/pipeline_bytes.py --dtype bfloat16 --layers 8 --virtual-stages 2 --seq-len 32 \\
        --results docs/results/pipeline_bytes_bf16.md                   # the docs' bf16 table
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from attnres_hf import AttnResConfig, AttnResForCausalLM, default_attnres_block_size
from attnres_hf.training.pipeline_parallel import AttnResPipeline, plan_pipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)
from overhead import SMOLLM2_135M  # noqa: E402  (the benchmarks' one SmolLM2-135M shape, benchmarks/overhead.py)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"],
                        help="decoder layers (default: SmolLM2-135M's)")
    parser.add_argument("--block-size", type=int, default=None, help="attnres_block_size (default: ~8 blocks)")
    parser.add_argument("--ranks", type=int, default=2, help="processes to spawn when not under torchrun")
    parser.add_argument("--virtual-stages", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--formula-seq-len", type=int, default=4096)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and activations")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the table, with how it was measured, to PATH "
                        "(a Markdown fragment, e.g. docs/results/pipeline_bytes.md)")
    args = parser.parse_args(argv)
    args.measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    return args


def config_for(args) -> AttnResConfig:
    block = args.block_size or default_attnres_block_size(args.layers)
    return AttnResConfig(**{**SMOLLM2_135M, "num_hidden_layers": args.layers}, depth_mixing="attnres",
                         attnres_block_size=block)


def run(rank: int, world_size: int, args) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    config = config_for(args)
    torch.manual_seed(0)
    model = AttnResForCausalLM(config).to(getattr(torch, args.dtype)).train()
    batch = args.micro_batch_size * args.micro_batches
    input_ids = torch.randint(0, config.vocab_size, (batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    rows = []
    for cache in (False, True):
        pipeline = AttnResPipeline(model, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                                   num_micro_batches=args.micro_batches, virtual_stages=args.virtual_stages,
                                   cache=cache)
        loss = pipeline.step(input_ids)
        model.zero_grad(set_to_none=True)
        sent = torch.tensor([pipeline.bytes_sent["forward"], pipeline.bytes_sent["backward"]], dtype=torch.float64)
        dist.all_reduce(sent)
        predicted = args.micro_batches * pipeline.plan.bytes_per_micro_batch(
            args.micro_batch_size, args.seq_len, config.hidden_size, model.dtype.itemsize)
        rows.append((cache, int(sent[0]), int(sent[1]), predicted, loss.item(), pipeline.plan))
    if rank:
        return
    bf16 = {cache: plan_pipeline(config, world_size, args.virtual_stages, cache).bytes_per_micro_batch(
        1, args.formula_seq_len, config.hidden_size, 2) for cache in (False, True)}
    text = report(config, args, world_size, rows, bf16)
    print(text)
    if args.results:
        args.measured.write(args.results, text)


def report(config, args, world_size: int, rows: list, bf16: dict) -> str:
    """The printed table (Markdown; also what `--results` writes): the shape and split, bytes sent per direction with
    and without caching beside the formula, and the formula for bf16 at `--formula-seq-len` tokens."""
    plan = rows[0][-1]
    lines = [
        f"- shape: SmolLM2-135M's, {config.num_hidden_layers} layers, hidden {config.hidden_size}, block "
        f"{config.attnres_block_size} sub-layers ({config.num_attnres_blocks} blocks + embedding), {args.dtype}",
        f"- split: {world_size} ranks x {args.virtual_stages} virtual stages = {plan.num_stages} stages, layers "
        f"{[end - first for first, end in plan.layer_ranges]}, sources after each stage {list(plan.sources_after)}",
        f"- step: {args.micro_batches} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, "
        "ScheduleInterleaved1F1B", "",
        "| caching | sent forward | sent backward | formula (each direction) | loss |", "|---|---|---|---|---|"]
    for cache, forward, backward, predicted, loss, _ in rows:
        lines.append(f"| {'on' if cache else 'off'} | {forward:,} B | {backward:,} B | {predicted:,} B | {loss:.5f} |")
    off, on = rows[0][1] + rows[0][2], rows[1][1] + rows[1][2]
    lines += ["", f"Caching sends {on / off:.3f} of the bytes ({off / on:.2f}x fewer). Formula, bf16, 1 x "
              f"{args.formula_seq_len} tokens per micro-batch, each direction: off {bf16[False] / 2**20:.1f} MiB, on "
              f"{bf16[True] / 2**20:.1f} MiB."]
    return "\n".join(lines)


def _spawned(rank: int, world_size: int, store: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        run(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    config_for(args)  # bad shapes fail here, before any process starts
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_spawned, args=(args.ranks, os.path.join(folder, "store"), args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
