"""Matplotlib figures of depth routing (the paper's Figure 8 heatmaps) and of training dynamics (Figure 5 b/c)."""

import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .routing import RoutingRecord  # noqa: E402


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    """Mean over `axis` ignoring NaN; all-NaN cells (sources a router cannot read) stay NaN, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=axis)


def _router_label(name: str) -> str:
    """Row labels come from the method's record (`L0 attn`, `L0 attn h1`, `L2 mudd q`, `final`); module-style names
    of older records (`layers.0.attn_res`, `final_res`) are shortened the same way."""
    if name == "final_res":
        return "final"
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers":
        return f"L{parts[1]} {parts[2].removesuffix('_res')}"
    return name


def _heatmap(ax, matrix: np.ndarray, rows: list[str], columns: list[str], title: str, cmap: str, label: str,
             limits: tuple[float, float] | None = None):
    masked = np.ma.masked_invalid(matrix)
    colormap = plt.get_cmap(cmap).with_extremes(bad="#e8e8e8")  # grey: sources a router cannot read
    vmin, vmax = limits if limits is not None else (None, None)
    image = ax.imshow(masked, aspect="auto", cmap=colormap, interpolation="nearest", vmin=vmin, vmax=vmax)
    ax.set_yticks(range(len(rows)), [_router_label(r) for r in rows], fontsize=_fontsize(len(rows)))
    ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=_fontsize(len(columns)))
    ax.set_xlabel("source")
    ax.set_ylabel("router / mixing output (depth order)")
    ax.set_title(title, fontsize=10)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label=label)


def _fontsize(n: int) -> float:
    return max(4.0, min(9.0, 360.0 / max(n, 1)))


def _relative_to_uniform(weights: np.ndarray) -> np.ndarray:
    """`log2(alpha * n_sources)` per router row: 0 is uniform, +1 twice the uniform weight, -1 half of it."""
    readable = np.isfinite(weights).sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.log2(np.clip(weights * readable, 1e-6, None))


def _three_panels(fig_axes, weights: np.ndarray, contributions: np.ndarray, record: RoutingRecord, what: str):
    fig, axes = fig_axes
    _heatmap(axes[0, 0], weights, record.routers, record.sources, f"depth weights alpha, {what}", "viridis", "alpha")
    relative = _relative_to_uniform(weights)
    bound = max(0.25, float(np.nanmax(np.abs(relative[1:])))) if len(relative) > 1 else 1.0
    _heatmap(axes[0, 1], relative, record.routers, record.sources, "alpha relative to uniform: log2(alpha * n)",
             "RdBu_r", "log2(alpha * n_sources)", limits=(-bound, bound))
    _heatmap(axes[0, 2], contributions, record.routers, record.sources, "contribution alpha * ||v||", "magma",
             "alpha * ||v||")


def _figure(n_rows: int, n_cols: int, panels: int = 2):
    width = min(30.0, 3.0 + panels * (2.5 + 0.22 * n_cols))
    height = min(30.0, 2.5 + 0.2 * n_rows)
    return plt.subplots(1, panels, figsize=(width, height), squeeze=False)


def plot_average_routing(record: RoutingRecord, path: str | Path, title: str = "") -> Path:
    """Token-averaged depth weights, the same relative to uniform (`log2(alpha * n)`, so that routers with many
    sources are readable too), and the token-averaged contributions `alpha_i * ||v_i||`."""
    fig_axes = _figure(len(record.routers), len(record.sources), panels=3)
    _three_panels(fig_axes, _nanmean(record.weights, axis=1), _nanmean(record.contributions, axis=1), record,
                  f"mean over {len(record.tokens)} tokens")
    fig = fig_axes[0]
    fig.suptitle(title or "AttnRes depth routing")
    return _save(fig, path)


def plot_token_routing(record: RoutingRecord, path: str | Path, start: int, end: int | None = None, title: str = "") -> Path:
    """Depth weights and contributions for token `start` (or the mean over the span `[start, end)`): input-specific
    jumps that averages over a whole text hide."""
    end = start + 1 if end is None else end
    if not 0 <= start < end <= len(record.tokens):
        raise ValueError(f"token span [{start}, {end}) is outside the {len(record.tokens)} tokens")
    span = "".join(record.tokens[start:end]).replace("Ġ", " ").replace("Ċ", "\\n")
    fig_axes = _figure(len(record.routers), len(record.sources), panels=3)
    _three_panels(fig_axes, _nanmean(record.weights[:, start:end], axis=1),
                  _nanmean(record.contributions[:, start:end], axis=1), record, f"tokens [{start}, {end})")
    fig = fig_axes[0]
    fig.suptitle(f"{title or 'AttnRes depth routing, per token'}\ntokens [{start}, {end}): {span[:60]!r}")
    return _save(fig, path)


def plot_shift(routers: list[str], sources: list[str], shift: np.ndarray, path: str | Path, title: str = "") -> Path:
    """Heatmap of the change of mean depth weights (b minus a) per router and source, centred at zero."""
    fig, axes = _figure(len(routers), len(sources), panels=1)
    ax = axes[0, 0]
    limit = np.nanmax(np.abs(shift)) if np.isfinite(shift).any() and np.nanmax(np.abs(shift)) > 0 else 1.0
    masked = np.ma.masked_invalid(shift)
    colormap = plt.get_cmap("RdBu_r").with_extremes(bad="#e8e8e8")
    image = ax.imshow(masked, aspect="auto", cmap=colormap, vmin=-limit, vmax=limit, interpolation="nearest")
    ax.set_yticks(range(len(routers)), [_router_label(r) for r in routers], fontsize=_fontsize(len(routers)))
    ax.set_xticks(range(len(sources)), sources, rotation=60, ha="right", fontsize=_fontsize(len(sources)))
    ax.set_xlabel("source")
    ax.set_ylabel("router")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label="mean alpha shift (b - a)")
    ax.set_title(title or "depth-weight shift after the difference", fontsize=10)
    return _save(fig, path)


def plot_dynamics(histories: dict[str, dict], path: str | Path) -> Path:
    """Per-layer magnitudes at the last recorded step, one line per model (the paper's Figure 5 b/c).

    `histories[name]` is a `DepthDynamicsCallback.history`: `steps`, and per recorded step one value per layer of
    `hidden_rms`, `output_rms` and `grad_norm`.
    """
    panels = (("hidden_rms", "stream magnitude: RMS after each layer (before the final norm)"),
              ("output_rms", "output magnitude: RMS of each layer's attention + MLP output"),
              ("grad_norm", "gradient magnitude: norm of each layer's parameter gradients"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for name, history in histories.items():
            ax.plot(range(1, len(history[key][-1]) + 1), history[key][-1], marker="o",
                    label=f"{name}, step {history['steps'][-1]}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
