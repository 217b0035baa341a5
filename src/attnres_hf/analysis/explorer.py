"""The routing explorer: one self-contained HTML page to read a `RoutingRecord` token by token.

The page shows the text as tokens; choosing one (click, or Enter / arrow keys) shows its routing map, rows (routers
or mixing outputs, depth order) by sources, as `record_routing` laid it out for any method of `DEPTH_MIXING`. A
switch shows the depth weights `alpha` or the contributions `alpha * ||v||` (`RoutingRecord.contributions`), a
button the mean over tokens, and for a pair of inputs (A, B) the map of B minus the map of A, each side a token or
its mean. Everything is inlined (data, script, style); the page's Content-Security-Policy lets it load nothing.

The numbers are stored to `SIGNIFICANT_DIGITS` significant digits (relative rounding error at most 5e-5), only at
the source columns a row reads; the page computes means and differences from them.
"""

import html
import json
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .routing import RoutingRecord

TEMPLATE = Path(__file__).parent / "data" / "explorer.html"
SIGNIFICANT_DIGITS = 5
QUANTITIES = ("weights", "contributions")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2 and its descendants, e.g. SmolLM2, Qwen): printable Latin-1
    bytes stand for themselves, the other bytes in order for U+0100 on (so a space is `Ġ`, a newline `Ċ`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


_BYTES = _byte_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def display_tokens(tokens: Sequence[str]) -> list[str]:
    """Readable text of tokenizer tokens, one string per token: byte-level BPE tokens decoded (`Ġthe` -> ` the`,
    `Ċ` -> a newline), SentencePiece's `▁` as a space and its byte tokens (`<0x0A>`) as the ASCII character.
    A token that does not decode to text (part of a multi-byte character, or nothing) is kept as it is.

    Raises:
        TypeError: `tokens` is not a sequence of strings.
    """
    if isinstance(tokens, str) or not all(isinstance(token, str) for token in tokens):
        raise TypeError("tokens must be a list of strings (RoutingRecord.tokens)")
    shown = []
    for token in tokens:
        text = token
        if match := _BYTE_FALLBACK.fullmatch(token):
            byte = int(match[1], 16)
            text = chr(byte) if byte < 0x80 else token
        elif "▁" in token:
            text = token.replace("▁", " ")
        elif token and all(ch in _BYTES for ch in token) and any(ord(ch) > 0x7E for ch in token):
            try:
                text = bytes(_BYTES[ch] for ch in token).decode("utf-8")
            except UnicodeDecodeError:  # part of a character: the raw token says more than a replacement mark
                text = token
        shown.append(text or token)
    return shown


def check_explorer_path(path: str | os.PathLike, force: bool = False) -> Path:
    """`path` as a `Path` if the explorer may be written there (the CLI calls this before any model loads).

    Raises:
        TypeError: `path` is not a path. IsADirectoryError: it is a folder. FileExistsError: it exists and `force`
            is false.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must be a file path for the page, got {path!r}")
    named = os.fspath(path)
    path = Path(path)
    if path.is_dir() or named.endswith(("/", os.sep)):  # (a folder, or a name that says it is one)
        raise IsADirectoryError(f"{path} is a folder; give the page's file path, e.g. {path / 'routing.html'}")
    if path.exists() and not force:
        raise FileExistsError(f"{path} already exists; pass --force (force=True) to replace it")
    return path


def _numbers(values: np.ndarray) -> str:
    """A flat JSON list body of `values` to `SIGNIFICANT_DIGITS` digits, `null` where not finite."""
    text = np.char.mod(f"%.{SIGNIFICANT_DIGITS}g", values.ravel())
    return ",".join(np.where(np.isfinite(values.ravel()), text, "null").tolist())


def _check_records(records, labels, tokens) -> tuple[list[RoutingRecord], list[str], list[list[str]]]:
    if isinstance(records, RoutingRecord):
        records = [records]
    if not isinstance(records, Sequence) or not all(isinstance(r, RoutingRecord) for r in records):
        raise TypeError("records must be a RoutingRecord or a list of one or two (record_routing's result)")
    records = list(records)
    if len(records) not in (1, 2):
        raise ValueError(f"the explorer shows one input or a pair, got {len(records)} records")
    first = records[0]
    for record in records:
        shape = (len(record.routers), len(record.tokens), len(record.sources))
        if not record.tokens:
            raise ValueError("a record has no tokens")
        for name in ("weights", "value_norms"):
            if np.shape(getattr(record, name)) != shape:
                raise ValueError(f"record.{name} has shape {np.shape(getattr(record, name))}; its routers, tokens "
                                 f"and sources make {shape}")
        if record.routers != first.routers or record.sources != first.sources:
            raise ValueError("the two records have different rows or sources: a pair must come from one model "
                             f"({len(first.routers)} x {len(first.sources)} against {shape[0]} x {shape[2]})")
    if labels is None:
        labels = ["A", "B"] if len(records) == 2 else ["input"]
    if (isinstance(labels, str) or len(labels) != len(records) or not all(isinstance(x, str) and x for x in labels)
            or len(set(labels)) != len(labels)):
        raise ValueError(f"labels must be {len(records)} distinct non-empty strings, one per record; got {labels!r}")
    if tokens is None:
        tokens = [display_tokens(record.tokens) for record in records]
    elif (isinstance(tokens, str) or len(tokens) != len(records) or any(
            isinstance(shown, str) or len(shown) != len(r.tokens) or not all(isinstance(x, str) for x in shown)
            for shown, r in zip(tokens, records))):
        raise ValueError("tokens must hold one list of strings per record, as long as the record's tokens")
    return records, list(labels), [list(shown) for shown in tokens]


def explorer_html(records: RoutingRecord | Sequence[RoutingRecord], labels: Sequence[str] | None = None,
                  tokens: Sequence[Sequence[str]] | None = None, title: str | None = None) -> str:
    """The page of `write_routing_explorer` as a string (the same arguments, less the path)."""
    records, labels, tokens = _check_records(records, labels, tokens)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a string, got {type(title).__name__}")
    # the columns each row reads (the same at every token: the method's record fixes them)
    readable = np.concatenate([np.isfinite(r.weights) for r in records], axis=1).any(axis=1)  # (rows, sources)
    columns = [np.flatnonzero(row).tolist() for row in readable]
    inputs = []
    for record, label, shown in zip(records, labels, tokens):
        parts = [f'"label": {json.dumps(label)}', f'"tokens": {json.dumps(record.tokens)}',
                 f'"display": {json.dumps(shown)}']
        for name in QUANTITIES:
            values = np.asarray(getattr(record, name), dtype=np.float64)
            flat = np.concatenate([values[r][:, cols] for r, cols in enumerate(columns)], axis=1)  # (T, stride)
            parts.append(f'"{name}": [{_numbers(flat)}]')
        inputs.append("{" + ", ".join(parts) + "}")
    title = title or ("depth routing" if len(records) == 1 else f"depth routing: {labels[1]} against {labels[0]}")
    meta = {"title": title, "rows": records[0].routers, "sources": records[0].sources, "columns": columns,
            "distribution": all(r.distribution for r in records), "significant_digits": SIGNIFICANT_DIGITS}
    data = json.dumps(meta)[:-1] + ', "inputs": [' + ", ".join(inputs) + "]}"
    # json.dumps writes non-ASCII as \u escapes; <, > and & occur only inside strings, where their escapes mean the
    # same, and without them no token can close the <script> element that holds the data
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    values = {"TITLE": html.escape(title), "DATA": data}
    # one pass, so that a token spelling a placeholder is not filled in
    return re.sub(r"__(TITLE|DATA)__", lambda m: values[m[1]], TEMPLATE.read_text(encoding="utf-8"))


def write_routing_explorer(records: RoutingRecord | Sequence[RoutingRecord], path: str | os.PathLike,
                           labels: Sequence[str] | None = None, tokens: Sequence[Sequence[str]] | None = None,
                           title: str | None = None, force: bool = False) -> Path:
    """Write the routing explorer of one input or a pair to `path` (one self-contained HTML file); returns the path.

    Args:
        records: one `RoutingRecord` (`record_routing`'s result) or a list of one or two from the same model (the
            same rows and sources): `weights` and `value_norms` of shape `(n_rows, seq_len, n_sources)`, float (NaN
            where a row cannot read a source); each record may have its own `seq_len`. With two, the page also
            shows the map of the second minus that of the first.
        labels: a name per record (default `["input"]`, or `["A", "B"]` for a pair).
        tokens: the text shown for each token, one list of `seq_len` strings per record (default: the records'
            tokens through `display_tokens`); the raw tokens are shown on hover.
        title: the page's heading.
        force: replace an existing file at `path`.

    Values are stored to 5 significant digits. The file is written beside `path` and renamed onto it, so a reader
    never sees half a page.

    Raises:
        TypeError: `records` are not `RoutingRecord`s, `path` is not a path, `title` not a string.
        ValueError: no or more than two records, records of different models, arrays whose shapes do not match
            the record's names, an empty record, `labels` or `tokens` that do not match the records.
        FileExistsError: `path` exists and `force` is false. IsADirectoryError: `path` is a folder.
    """
    path = check_explorer_path(path, force)
    page = explorer_html(records, labels, tokens, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, staging = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(page)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes it private; the page is an ordinary file
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return path
