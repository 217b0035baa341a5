"""Name tables of other implementations' checkpoints (`fla_layout.FLA_KEY_MAP`, `k3_layout.ONE_TO_ONE`): pairs of
name templates, `{i}` standing for a decoder layer's number, read in both directions."""

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
