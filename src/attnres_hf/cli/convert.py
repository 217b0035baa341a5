"""`attnres convert SOURCE OUTPUT_DIR`: retrofit a checkpoint of a supported family (HF folder or GGUF file;
`attnres_hf.conversion.SUPPORTED_MODEL_TYPES`, `conversion.families.GGUF_ARCHITECTURES`), or import another
implementation's AttnRes checkpoint (flash-linear-attention, Kimi K3)."""

import argparse

from ._common import add_command, add_writing_options, positive_int


def register(commands: argparse._SubParsersAction) -> None:
    from ..modeling.configuration_attnres import DEPTH_MIXING_METHODS

    parser = add_command(commands, "convert", run_convert,
                         help="retrofit a checkpoint of a supported family into AttnRes")
    parser.add_argument("source", help="an HF model folder, a .gguf file, a flash-linear-attention "
                                       "TransformerForCausalLM folder or a Kimi K3 folder (the released multimodal "
                                       "layout or K3's text layout; AttnRes routers of both imported as trained)")
    parser.add_argument("output_dir", help="folder to write (refused if it exists, unless --force)")
    parser.add_argument("--gguf-file", help="GGUF file name inside SOURCE when SOURCE is a folder")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--block-size", type=positive_int,
                      help="sub-layers per block: 1 (Full AttnRes, as --full) or an even number, so that each block "
                           "starts at an attention sub-layer (default about 8 blocks; an fla or K3 AttnRes checkpoint "
                           "keeps its own)")
    size.add_argument("--full", action="store_true", help="Full AttnRes (block size 1)")
    parser.add_argument("--depth-mixing", default="attnres", choices=list(DEPTH_MIXING_METHODS),
                        help="the method; every one starts exactly as the source (default: attnres)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                        help="dtype of the written weights; auto: the source checkpoint's own, tensor by tensor for "
                             "K3's fp32 tensors in a bf16 checkpoint (default float32)")
    parser.add_argument("--paper-mean", action="store_true",
                        help="routers output the plain mean of their sources (the paper) instead of the rescaled "
                             "mean that reproduces the source's logits to float noise")
    parser.add_argument("--verify-all", action="store_true",
                        help="a GGUF source: compare every weight with the file's dequantised tensors (minutes for a "
                             "large file); default: each kind of tensor in the first and last block, which checks "
                             "every rule of the mapping, and the report says how many of how many")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="a folder of safetensors weights (HF, fla or Kimi K3) or a GGUF file: --stream converts "
                             "it tensor by tensor and verifies it with every module offloaded to disk (memory of about "
                             "one layer in fp32, for a model of any size), --no-stream in memory (about twice its fp32 "
                             "size; faster for small models). "
                             "Default: streamed above 1 GiB of fp32 parameters; conversion_report.json says which ran")
    add_writing_options(parser)


def run_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..conversion import convert

    if args.source.isdigit() and not Path(args.source).exists():  # a value whose option argparse did not know
        raise FileNotFoundError(f"SOURCE {args.source} does not exist: a number there is the value of a misspelt "
                                f"or missing option (--block-size {args.source}?)")
    overrides = {"attnres_rescale_output": False} if args.paper_mean else {}
    report = convert(
        args.source,
        args.output_dir,
        gguf_file=args.gguf_file,
        attnres_block_size=1 if args.full else args.block_size,
        depth_mixing=args.depth_mixing,
        dtype=args.dtype,
        force=args.force,
        max_shard_size=args.max_shard_size,
        trust_remote_code=args.trust_remote_code,
        verify_all=args.verify_all,
        stream="auto" if args.stream is None else args.stream,
        **overrides,
    )
    check = report["verification"]
    if "compared_with" in check:  # an fla source: compared with fla's own model
        print(f"max |delta logits| vs {check['compared_with']['model']} ({check['compared_with']['device']}, "
              "reference kernels): "
              f"{check['max_abs_logit_delta']:.3g} on {check['num_probe_tokens']} tokens, "
              f"{check['relative_max_abs_logit_delta']:.2g} of max |logits|; exact: {check['exact']}"
              + ("" if check["exact"] else " (see conversion_report.json)"))
    elif "max_abs_logit_delta" in check:
        print(f"max |delta logits| vs source: {check['max_abs_logit_delta']:.3g} on {check['num_probe_tokens']} tokens")
    if "tensors_not_written_back" in check:  # a Kimi K3 source: its tensors, written back, against the checkpoint's
        print(f"K3 tensors written back identical: {check['tensors_identical']} ({check['tensors_checked']} "
              "tensors)" + ("; logits not compared (no Kimi K3 runtime runs here)" if "logits_compared" in check
                            else ""))
    elif "tensors_identical" in check:  # streamed, an fla or K3 AttnRes source: the written tensors against its own
        compared = check.get("logits_compared", "no")
        print(f"tensors written identical to the checkpoint's: {check['tensors_identical']} "
              f"({check['tensors_checked']} tensors)"
              + ("" if compared == "yes" else f"; logits not compared ({compared.removeprefix('no: ')})"))
    if "greedy_match" in check:
        print(f"{check['greedy_new_tokens']}-token greedy continuation identical: {check['greedy_match']}")
    if "gguf_tensors_checked" in check:
        sampled = check["gguf_tensors_checked"] < check["gguf_tensors"]
        print(f"weights equal to the GGUF file's tensors: {check['gguf_tensors_checked']} of {check['gguf_tensors']}"
              + (" (sampled: each tensor kind in the first and last block; --verify-all checks every one)"
                 if sampled else "") + f", max |delta| {check['gguf_max_abs_delta']:.3g}")
    print(f"wrote {args.output_dir}")
    return 0
