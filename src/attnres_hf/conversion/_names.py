"""Name tables of other implementations' checkpoints (`fla_layout.FLA_KEY_MAP`, `k3_layout.ONE_TO_ONE`): pairs of
name templates, `{i}` standing for a decoder layer's number, read in both directions; and the one tensor both
differ from attnres-hf in by shape alone, the pseudo-query (`query_as_ours`, `query_as_theirs`)."""

import re


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


def rename_tables(pairs) -> tuple[list, list]:
    """`(theirs -> ours, ours -> theirs)` lookup tables of `(their template, our template)` pairs, for `rename`."""
    return [(_pattern(theirs), ours) for theirs, ours in pairs], [(_pattern(ours), theirs) for theirs, ours in pairs]


def rename(name: str, table) -> str | None:
    """`name` renamed by the first template of `table` that matches it (its layer number carried over), or `None`."""
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.group(1)) if match.groups() else template
    return None


def is_pseudo_query(name: str) -> bool:
    """Whether attnres-hf tensor `name` is a depth router's pseudo-query (`...attn_res.query`,
    `model.final_res.query`)."""
    return name.endswith(".query")


def query_as_ours(tensor):
    """fla's and K3's pseudo-query `[1, D]` (a linear layer's weight) as attnres-hf's `[D]`: a view, no value changes.
    Any other shape is returned as it is, for the caller's shape check to name."""
    return tensor.reshape(-1) if tensor.dim() == 2 else tensor


def query_as_theirs(tensor):
    """attnres-hf's pseudo-query `[D]` as fla's and K3's `[1, D]` (a view)."""
    return tensor.reshape(1, -1)
