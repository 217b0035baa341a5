"""Argument checks shared by the public functions: a one-line `TypeError`/`ValueError` that names the rule."""

import os


def check_int(name: str, value, minimum: int | None = None, unit: str = "") -> int:
    """`value` if it is an integer (not a bool) of at least `minimum`; `unit` names what it counts (e.g. "tokens")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}{' ' + unit if unit else ''}, got {value}")
    return value


def check_paths(name: str, value) -> list[str]:
    """A path or a list of paths as a non-empty list of strings."""
    paths = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise TypeError(f"{name} must be a path or a list of paths, got {value!r}")
    if not paths:
        raise ValueError(f"{name} needs at least one path")
    return [os.fspath(p) for p in paths]
