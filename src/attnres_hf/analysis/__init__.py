"""Reading the depth routing: routing maps, contribution maps, the routing explorer page, paired comparisons and
training dynamics.

Never imported by `modeling/`: plots and hooks live here, outside what travels with a checkpoint.
"""

from .compare import aligned_suffix, compare_pairs, largest_shifts, load_pairs
from .dynamics import DepthDynamicsCallback, layer_magnitudes, run_dynamics
from .explorer import display_tokens, write_routing_explorer
from .inputs import encode_text
from .layout import block_layout, sublayer_names
from .routing import RoutingRecord, record_routing, router_names, routing_maps, source_columns, source_names, summarize

__all__ = [
    "DepthDynamicsCallback",
    "RoutingRecord",
    "aligned_suffix",
    "block_layout",
    "compare_pairs",
    "display_tokens",
    "encode_text",
    "largest_shifts",
    "layer_magnitudes",
    "load_pairs",
    "record_routing",
    "router_names",
    "routing_maps",
    "run_dynamics",
    "source_columns",
    "source_names",
    "sublayer_names",
    "summarize",
    "write_routing_explorer",
]
