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


def check_fraction(name: str, value) -> float:
    """`value` if it is a number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name} must be between 0 and 1, got {value!r}")
    return value


def check_learning_rate(name: str, value) -> float | None:
    """`value` if it is `None` or a finite positive number (a learning rate)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or None, got {value!r}")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive finite learning rate, got {value!r}")
    return value


def check_model_source(path: str, what: str = "model folder") -> None:
    """Raise `FileNotFoundError` unless `path` is an existing folder or reads as a Hub id (`owner/name`, loaded
    from the local Hub cache when offline)."""
    if not os.path.isdir(path) and (os.path.isabs(path) or path.startswith(".") or path.count("/") != 1):
        raise FileNotFoundError(f"{what} not found: {path}")
