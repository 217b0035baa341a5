"""`attnres demo`: the main job on the real SmolLM2-135M-Instruct (`make demo`)."""

import argparse

from ._common import add_command


def register(commands: argparse._SubParsersAction) -> None:
    parser = add_command(commands, "demo", run_demo,
                         help="convert the real SmolLM2-135M-Instruct and check it (make demo)")
    parser.add_argument("--output-dir", default="outputs/demo", help="an earlier demo output there is replaced")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--eval-questions", type=int, default=100,
                        help="MMLU and ARC-Challenge questions each for the lm-eval step (0 skips it)")


def run_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    run_demo(args.output_dir, attnres_block_size=args.block_size, ppl_tokens=args.ppl_tokens,
             eval_questions=args.eval_questions)
    return 0
