"""Records that name classes and functions of modules imported on first use, and the tables that hold them.

A table of records (`backbones.BACKBONES`: the backbone families; `depth_mixing.DEPTH_MIXING`: the depth-mixing
methods) is built when its module is imported, and importing it must import nothing heavy: not every family's
modeling code, nor fla (which transformers' Kimi Linear module imports where it is installed), nor the modules of
every depth-mixing method (the AttnRes read's implementations import Triton's dispatch and the two-phase path). So a
record names such a class as `LazyModule(...).ClassName`, a `LazyReference`, and `LazyTable[key]` resolves the
record's references the first time the record is read (importing what it names); `LazyTable.declared(key)` is the
record as written, for what a configuration reads (its fields of plain values), with nothing imported.

Travels with checkpoints as remote code (a relative import of `backbones_base.py` and `depth_mixing.py`): imports
only the standard library.
"""

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass


class LazyModule:
    """A module imported on first use: `LazyModule(name).Attr` is a `LazyReference` (nothing is imported), `load()`
    the module itself, imported once (by `loader()` when given: Kimi Linear's wraps the import; a sibling module of
    this package is imported by a loader holding a relative import statement, the form transformers' remote-code
    loader follows to copy the file along)."""

    def __init__(self, name: str, loader: Callable | None = None):
        self.name, self._loader, self._module = name, loader, None

    def load(self):
        if self._module is None:
            self._module = self._loader() if self._loader is not None else importlib.import_module(self.name)
        return self._module

    def __getattr__(self, attr: str) -> "LazyReference":
        if attr.startswith("_"):  # dunders (`__deepcopy__`, ...) and private names are never module references
            raise AttributeError(attr)
        return LazyReference(self, attr)

    def __repr__(self) -> str:
        return f"LazyModule({self.name!r})"


@dataclass(frozen=True)
class LazyReference:
    """`module.attr` of a `LazyModule`, imported by `resolve()`; calling it calls the resolved object (what a
    factory such as `scaled_embedding` does at model construction)."""

    module: LazyModule
    attr: str

    def resolve(self):
        return getattr(self.module.load(), self.attr)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


def resolve(value):
    """`value` with its `LazyReference`s resolved: a reference, or an `OutputRecorder`, list, tuple or dict of them
    (a record's `record_outputs`); anything else is returned as it is."""
    if isinstance(value, LazyReference):
        return value.resolve()
    if isinstance(value, dict):
        return {key: resolve(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(item) for item in value)
    if dataclasses.is_dataclass(value) and isinstance(getattr(value, "target_class", None), LazyReference):
        return dataclasses.replace(value, target_class=value.target_class.resolve())  # an `OutputRecorder`
    return value


class LazyTable(Mapping):
    """`key -> record` (a frozen dataclass of `record_type`, keyed by its field `key_field`) whose records are resolved
    on first use: iterating, `len` and `in` import nothing; `table[key]` resolves the record's `LazyReference`s once
    (importing the modules they name) and keeps the resolved record; `declared(key)` is the record as written.

    `records` maps each key to its record, or to a function returning it (a record that lives in a module that is
    itself imported on first use: Kimi K3's backbone).

    Raises:
        TypeError: a table class without `record_type`.
        KeyError: `table[key]` / `declared(key)` of a key the table does not hold.
        ValueError: a record loaded by a function whose key is not the one it was filed under.
    """

    record_type: type | None = None  # set by each table
    key_field: str = "name"

    def __init__(self, records: dict):
        if self.record_type is None:
            raise TypeError(f"{type(self).__name__} must set record_type (the class of its records)")
        self._records, self._resolved = dict(records), {}

    def declared(self, key: str):
        record = self._records[key]
        if not isinstance(record, self.record_type):
            record = self._records[key] = record()
            if getattr(record, self.key_field) != key:
                raise ValueError(f"the record loaded for {key!r} is {getattr(record, self.key_field)!r}'s")
        return record

    def __getitem__(self, key: str):
        if key not in self._resolved:
            record = self.declared(key)
            self._resolved[key] = dataclasses.replace(
                record, **{f.name: resolve(getattr(record, f.name)) for f in dataclasses.fields(record)})
        return self._resolved[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key) -> bool:
        return key in self._records

    def immediate(self) -> tuple:
        """The records declared in the table's own modules, read without importing anything (not those behind a
        loader, such as Kimi K3's, until it has run), in table order."""
        return tuple(record for record in self._records.values() if isinstance(record, self.record_type))

    def resolved(self) -> tuple[str, ...]:
        """The keys resolved so far, in table order."""
        return tuple(key for key in self._records if key in self._resolved)


__all__ = ["LazyModule", "LazyReference", "LazyTable", "resolve"]
