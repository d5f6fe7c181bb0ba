"""Benchmark reports: hardware line, tables (rich and markdown), dated docs row sets, plots, JSON."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def hardware_info() -> dict[str, Any]:
    """GPU name and count, and torch / CUDA / NCCL / JAX versions (JAX read from metadata only)."""
    from importlib import metadata

    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["gpu_count"] = n
        info["gpu"] = torch.cuda.get_device_name(0) if n else "none"
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version()) if n else None
        except Exception:
            info["nccl"] = None
    except ImportError:
        info["torch"] = None
    for pkg in ("jax", "jaxlib"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


def hardware_line(info: Mapping[str, Any]) -> str:
    """One-line hardware / software summary for a docs row set."""
    return (f"{info.get('gpu_count', 0)}× {info.get('gpu', '?')}; torch {info.get('torch')}, "
            f"CUDA {info.get('cuda')}, NCCL {info.get('nccl')}, JAX {info.get('jax')}, "
            f"Python {info.get('python')}")


def fmt_ms(value: float | None) -> str:
    """Milliseconds with 3 significant decimals, or ``n/a``."""
    return "n/a" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.2f}")


def fmt_ratio(value: float | None) -> str:
    """A ratio as ``×1.23``, or ``n/a``."""
    return "n/a" if value is None else f"×{value:.2f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """GitHub markdown table; ValueError if a row's width differs from the header's."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: row has {len(row)} cells, expected {len(headers)}: {row}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a table with rich (wide console, no wrapping); plain markdown if rich is missing."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n{markdown_table(headers, rows)}", flush=True)
        return
    table = Table(title=title, show_lines=False)
    for h in headers:
        table.add_column(h, no_wrap=True)
    for row in rows:
        table.add_row(*[str(c) for c in row])
    Console(width=250, force_terminal=False).print(table)
    sys.stdout.flush()


DOC_HEADER = "# Benchmarks\n\nRow sets are appended by the benchmark scripts, newest last.\n"


def append_row_set(doc_path: Path, title: str, info: Mapping[str, Any], body: str,
                   when: _dt.datetime | None = None) -> str:
    """Append a dated section (``## <date> — title``, hardware line, ``body``) to ``doc_path``.

    Creates the file with a header if it does not exist. Returns the appended text.
    """
    when = when or _dt.datetime.now()
    text = f"\n## {when:%Y-%m-%d %H:%M} — {title}\n\nHardware: {hardware_line(info)}.\n\n{body.rstrip()}\n"
    doc_path = Path(doc_path)
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    if not doc_path.exists():
        doc_path.write_text(DOC_HEADER)
    with doc_path.open("a") as fh:
        fh.write(text)
    return text


def plot_grouped_bars(paths: Sequence[Path], panels: Sequence[tuple[str, list[str], dict[str, list[float | None]]]],
                      ylabel: str = "× limit") -> list[Path]:
    """Save one PNG (to every path) with one bar-chart panel per ``(title, groups, series)``.

    ``series`` maps a variant name to one value per group (None = missing, drawn as no bar).
    A dashed line marks 1.0. Returns the paths written; [] if matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.5 * len(panels)), squeeze=False)
    for ax, (title, groups, series) in zip(axes[:, 0], panels, strict=True):
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            xs = [g + i * width for g, v in enumerate(values) if v is not None]
            ys = [v for v in values if v is not None]
            ax.bar(xs, ys, width=width, label=name)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    written = []
    for path in paths:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        written.append(Path(path))
    plt.close(fig)
    return written


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
