"""`attnres export --to fla MODEL OUTPUT_DIR`: write an AttnRes folder as another implementation's checkpoint
(`attnres_hf.conversion.export`; `EXPORT_FORMATS`)."""

import argparse

from ._common import add_command, add_writing_options


def register(commands: argparse._SubParsersAction) -> None:
    parser = add_command(commands, "export", run_export,
                         help="write an AttnRes model as flash-linear-attention's or Kimi K3's checkpoint")
    parser.add_argument("model", help="an AttnRes model folder (written by attnres convert or save_pretrained)")
    parser.add_argument("output_dir", help="folder to write (refused if it exists, unless --force)")
    # No `choices=EXPORT_FORMATS`: reading it imports the conversion package (and fla through Kimi K3's module) at
    # every `attnres` start; `export` refuses another value in one line.
    parser.add_argument("--to", required=True, metavar="FORMAT",
                        help="fla: flash-linear-attention's TransformerForCausalLM (config, names, [1, hidden] "
                             "pseudo-queries); k3-layout: Kimi K3's text checkpoint (a kimi_k3 model)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="--stream writes the export tensor by tensor and checks it by reading it back as attnres "
                             "convert does, every tensor against the folder's, then fla's logits with both models "
                             "offloaded to disk; --no-stream in memory, fla's logits compared. Default: streamed above "
                             "1 GiB of fp32 tensors; export_report.json says which ran")
    parser.add_argument("--experts", metavar="FORMAT", default=None,
                        help="k3-layout: how routed experts are written: mxfp4 (compressed-tensors' MXFP4, as K3's "
                             "release stores them; refused by name for an expert whose values are not MXFP4 values, "
                             "e.g. fine-tuned) or unquantized (.weight, values unchanged). Default: mxfp4 when the "
                             "experts were imported from MXFP4, else unquantized")
    add_writing_options(parser)


def run_export(args: argparse.Namespace) -> int:
    from ..conversion.export import export

    report = export(args.model, args.output_dir, to=args.to, force=args.force, max_shard_size=args.max_shard_size,
                    trust_remote_code=args.trust_remote_code, stream="auto" if args.stream is None else args.stream,
                    experts=args.experts)
    check = report["verification"]
    if args.to == "k3-layout":
        print(f"read back by attnres convert: every tensor identical ({check['tensors_identical']}); logits not "
              "compared (no Kimi K3 runtime runs here)")
        print(f"wrote {args.output_dir} ({report['tensors']} tensors, {report['dtype']}); K3's text config: "
              f"{report['k3_text_config_source']}")
        print(f"routed experts: {report['experts']['format']} ({report['experts']['why']})")
        if report["k3_remote_code_files"]:
            print(f"K3's own code loads it with trust_remote_code=True once its {', '.join(report['k3_remote_code_files'])} "
                  "(Moonshot's, in the K3 release; not shipped by attnres-hf) are copied into the folder")
        return 0
    if "tensors_identical" in check:  # streamed: read back tensor by tensor, then the logits offloaded
        print(f"read back by attnres convert: every tensor identical ({check['tensors_identical']})")
    print(f"max |delta logits| vs fla's model ({check['compared_with']['device']}): {check['max_abs_logit_delta']:.3g} "
          f"on {check['num_probe_tokens']} tokens ({check['relative_max_abs_logit_delta']:.2g} of max |logits|; "
          f"exact: {check['exact']})")
    print(f"wrote {args.output_dir} ({report['tensors']} tensors, {report['dtype']})")
    return 0
