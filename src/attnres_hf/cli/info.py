"""`attnres info PATH`: depth mixing, block layout (which sub-layers form each block, paper Eq. 6), router counts."""

import argparse
import json
from pathlib import Path

from ._common import add_command


def register(commands: argparse._SubParsersAction) -> None:
    parser = add_command(commands, "info", run_info,
                         help="describe an AttnRes checkpoint or config (folder or config.json)")
    parser.add_argument("path", help="a folder with config.json, or the config.json itself")


def run_info(args: argparse.Namespace) -> int:
    from ..analysis.layout import block_layout
    from ..modeling import AttnResConfig
    from ..modeling.depth_mixing import num_depth_mixing_parameters

    path = Path(args.path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json at {args.path}")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ValueError(f"{config_file} is not a JSON config ({error}); give a model folder or its config.json") from None
    if model_type != AttnResConfig.model_type:
        raise ValueError(f"{args.path} is not an AttnRes checkpoint (model_type {model_type!r}); "
                         f"`attnres convert {args.path} OUTPUT_DIR` converts a checkpoint of a supported family, flash-linear-attention or Kimi K3")
    config = AttnResConfig.from_pretrained(args.path)
    print(f"model_type          {config.model_type}")
    print(f"backbone            {config.backbone.model_type} ({type(config.backbone).__name__})")
    print(f"depth_mixing        {config.depth_mixing}")
    print(f"layers / sub-layers {config.num_hidden_layers} / {config.num_sublayers}")
    print(f"hidden_size         {config.hidden_size}")
    print(f"mixing parameters   {num_depth_mixing_parameters(config):,} (built from the method's record)")
    if config.depth_mixing == "attnres":
        kind = "Full AttnRes" if config.attnres_block_size == 1 else "Block AttnRes"
        size = config.attnres_block_size
        last = config.num_sublayers - size * (config.num_attnres_blocks - 1)
        layout = f"{config.num_attnres_blocks} blocks" + (f", the last of {last}" if last != size else "")
        print(f"block size          {size} sub-layer{'s' if size > 1 else ''} ({kind}, {layout})")
        print(f"routers             {config.num_sublayers + 1} (attn_res and mlp_res per layer, final_res)")
        # sub-layer 0 reads the embedding alone: its weight is 1 whatever the router's parameters (paper Eq. 2)
        print("inert               layer 0's attn_res: one source (the embedding), weight 1 whatever its "
              "pseudo-query and key norm; kept, as other implementations (fla, Kimi K3) store it too")
        for index, block in enumerate(block_layout(config), start=1):
            print(f"  block {index:>3}: {' '.join(block)}")
    return 0
