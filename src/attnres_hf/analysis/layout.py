"""Where each sub-layer sits: names of the sub-layers and the blocks of Block AttnRes (paper Eq. 6)."""


def sublayer_names(config) -> list[str]:
    """Sub-layers in depth order: `["0.attn", "0.mlp", "1.attn", ...]`; sub-layer `2 i` is the attention of layer `i`
    and `2 i + 1` its MLP (`2 * num_hidden_layers` in all)."""
    return [f"{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}" for i in range(config.num_sublayers)]


def block_layout(config) -> list[list[str]]:
    """Sub-layer names per block, e.g. `[["0.attn", "0.mlp"], ["1.attn", "1.mlp"]]` for block size 2.

    Block `n` holds sub-layers `[n S, (n + 1) S)` with `S = config.attnres_block_size`, the last block possibly
    partial; Full AttnRes (`S = 1`) has one block per sub-layer.
    """
    names = sublayer_names(config)
    size = config.attnres_block_size
    return [names[start : start + size] for start in range(0, len(names), size)]
