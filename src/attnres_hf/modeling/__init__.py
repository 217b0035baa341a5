"""The model files that travel with a checkpoint as remote code (`auto_map`)."""

from .configuration_attnres import AttnResConfig, default_attnres_block_size
from .modeling_attnres import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel, naive_attnres

__all__ = [
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
    "default_attnres_block_size",
    "naive_attnres",
]
