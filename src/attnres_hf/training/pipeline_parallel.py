"""Pipeline-parallel training of Block AttnRes with the paper's cross-stage caching (Kimi Team, "Attention
Residuals", arXiv:2603.15031, §4 and Figure 3), on `torch.distributed.pipelining`.

**Split.** The decoder layers are cut at layer boundaries into `S = P * V` virtual stages: `P` ranks, `V >= 2` stages
per rank, stage `s` on rank `s % P`. `ScheduleInterleaved1F1B` runs them, so every micro-batch passes each rank `V`
times. Stage 0 also holds the embedding; stage `S - 1` the final router, `model.norm` and `lm_head`.

**What crosses a stage boundary.** Block AttnRes routes each sub-layer over all completed block sources (Eq. 6), so a
hand-off carries the micro-batch's depth state: the `n_s` completed sources `b_0 .. b_{n_s - 1}` (embedding and block
sums, `(b, T, n_s, d)` in the model dtype, plus their fp32 key-norm statistics `(b, T, n_s)`) and the current block's
partial sum `(b, T, d)`. After stage `s` (decoder layers `0 .. e_s - 1` done, `2 e_s` sub-layers, block size `S_b`),
`n_s = 1 + floor((2 e_s - 1) / S_b)`: a block closes when the next sub-layer reads it.

**Cross-stage caching (paper §4).** Completed sources never change. When a micro-batch reaches stage `s`, its rank
already holds every source that stage `s - P` (the rank's previous visit) produced for it: the rank keeps them, and
stage `s - 1` sends only the sources completed since (`b_{n_{s-P}} .. b_{n_{s-1} - 1}`) and the partial sum. Bytes
sent per micro-batch in each direction (activations forward; their gradients backward, the same shapes), with `E`
the activation element size (4 fp32, 2 bf16) and `n_s = 0` for `s < 0`:

    without caching:  b T [ sum_{s=0}^{S-2} n_s (d E + 4)               + (S - 1) d E ]
    with caching:     b T [ sum_{s=0}^{S-2} (n_s - n_{s+1-P}) (d E + 4) + (S - 1) d E ]
                    = b T [ sum_{s=S-P}^{S-2} n_s (d E + 4)             + (S - 1) d E ]   (the sum telescopes)

With `N` blocks the source term is about `N S / 2` source copies per token without caching and at most
`(P - 1) (N + 1)` with it (the embedding counts as a source): each source reaches each other rank once.
`PipelinePlan.bytes_per_micro_batch` evaluates both; `benchmarks/pipeline_bytes.py` compares them with the bytes the
stages actually send.

**Backward.** Stage `s + P` reads the kept sources as detached leaves, so its backward (run by the schedule like any
other) leaves their gradient in the leaves' `.grad`. Stage `s`'s outputs went through an identity autograd function
(`_ReturnKeptGradients`) whose backward hands that gradient to the sources in stage `s`'s own graph, next to the
gradients received for what it sent. In any schedule stage `s + P`'s backward of a micro-batch precedes stage `s`'s
(stage `s` needs the input gradients of `s + 1`, which needs those of `s + 2`, ...), so the gradient is there in time;
a missing one is an error, not a silent zero. This needs schedules whose backward is one autograd pass per stage and
micro-batch (`ScheduleInterleaved1F1B`, used here); zero-bubble schedules that split off the weight gradients compute
input gradients with `torch.autograd.grad`, which leaves no `.grad` on the kept sources.

Loss: each micro-batch's token-summed cross-entropy divided by the global batch's number of predicted tokens
(transformers' `num_items_in_batch`), so the summed micro-batch losses and gradients equal one step on the whole
batch, also with `-100` labels. Tied embeddings (`tie_word_embeddings`, e.g. SmolLM2): stage 0 and stage `S - 1` sit
on different ranks, and their gradients of the shared matrix are summed after each step (as Megatron-LM does).

Code: `pipeline_plan.py` (the depth state as tensors, `StateCodec`; the split and what each hand-off sends,
`plan_pipeline`), `pipeline_stages.py` (the kept sources, the stages and `AttnResPipeline`); this module holds the
torchrun entry point (`main`) and re-exports the public names.

Use (every rank, after `torch.distributed.init_process_group`; full example in docs/pipeline-parallelism.md)::

    pipeline = AttnResPipeline(model, micro_batch_size=2, seq_len=128, num_micro_batches=4, virtual_stages=2)
    optimizer = torch.optim.AdamW(pipeline.parameters(), lr=1e-4)
    loss = pipeline.step(input_ids)          # (8, 128) on every rank; the global mean loss on every rank
    optimizer.step(); optimizer.zero_grad()
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._checks import check_int
from .pipeline_plan import PipelinePlan, StateCodec, plan_pipeline
from .pipeline_stages import AttnResPipeline, AttnResStageModule, CrossStageCache

# ---------------------------------------------------------------------------------------------------------------
# torchrun entry point: `torchrun --nproc-per-node P -m attnres_hf.training.pipeline_parallel MODEL --data FILE ...`
# ---------------------------------------------------------------------------------------------------------------


def _parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node P -m attnres_hf.training.pipeline_parallel",
        description="Train an AttnRes checkpoint (all parameters, AdamW) with pipeline parallelism over the torchrun "
                    "processes and the paper's cross-stage caching; rank 0 writes the trained model to --output-dir.")
    parser.add_argument("model", help="AttnRes model folder (with its tokenizer), e.g. the output of `attnres convert`")
    parser.add_argument("--data", nargs="+", required=True,
                        help=".txt/.jsonl/.json/.parquet files (see `attnres train`)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (packed)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--virtual-stages", type=int, default=2, help="stages per rank (>= 2)")
    parser.add_argument("--no-cache", action="store_true", help="send the full depth state at every hand-off")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run under torchrun; returns the exit status. Bad arguments fail before any model loads."""
    import json
    import os
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import packed_lm_dataset

    args = _parser().parse_args(argv)
    for name in ("seq_len", "micro_batch_size", "micro_batches", "steps"):
        check_int(name, getattr(args, name), minimum=2 if name == "seq_len" else 1)
    check_int("virtual_stages", args.virtual_stages, minimum=2)
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if not (Path(args.model) / "config.json").is_file():
        raise FileNotFoundError(f"no model folder (config.json) at {args.model}")
    for path in args.data:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data file not found: {path}")
    if "RANK" not in os.environ:
        raise RuntimeError("run this under torchrun, e.g. torchrun --nproc-per-node 2 -m "
                           "attnres_hf.training.pipeline_parallel MODEL --data FILE --output-dir OUT")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, device = dist.get_rank(), torch.device("cpu")
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        torch.manual_seed(args.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).train()
        data = packed_lm_dataset(args.data, tokenizer, seq_len=args.seq_len)["train"]
        pipeline = AttnResPipeline(model, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                                   num_micro_batches=args.micro_batches, virtual_stages=args.virtual_stages,
                                   cache=not args.no_cache)
        optimizer = torch.optim.AdamW(pipeline.parameters(), lr=args.lr)
        batch = args.micro_batch_size * args.micro_batches
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
        losses = []
        for step in range(args.steps):
            rows = [order[(step * batch + i) % len(order)] for i in range(batch)]  # the same rows on every rank
            examples = data.select(rows)
            loss = pipeline.step(torch.tensor(examples["input_ids"]), torch.tensor(examples["labels"]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if rank == 0:
                print(json.dumps({"step": step + 1, "loss": round(losses[-1], 6)}), flush=True)

        pipeline.save_pretrained(args.output_dir, tokenizer=tokenizer)
        sent = torch.tensor([pipeline.bytes_sent["forward"], pipeline.bytes_sent["backward"]], dtype=torch.float64,
                            device=device)
        dist.all_reduce(sent)
        if rank == 0:
            (Path(args.output_dir) / "pipeline_summary.json").write_text(json.dumps(
                {"steps": args.steps, "losses": losses, "ranks": dist.get_world_size(),
                 "virtual_stages": args.virtual_stages, "cache": not args.no_cache,
                 "bytes_sent": {"forward": int(sent[0]), "backward": int(sent[1])}}, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


__all__ = ["AttnResPipeline", "AttnResStageModule", "CrossStageCache", "PipelinePlan", "StateCodec", "plan_pipeline"]


if __name__ == "__main__":
    raise SystemExit(main())
