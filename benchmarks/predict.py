"""Cost-model predictions of the collective-matmul benchmark for TP=4 and TP=8 (nothing runs).

    python3 -m benchmarks.predict                        # print; append a dated section to docs/benchmarks.md
    python3 -m benchmarks.predict --no-append --tp 2 4 8 --dtype bf16

For each benchmark shape (M, K, N) and each side (all-gather→matmul, matmul→reduce-scatter)
``spmd.passes.cost_model.predict_table`` gives the predicted time of the serial baseline (the
collective, then the GEMM) and of the unidirectional / bidirectional windowed einsum, and what
``windowed_einsum="auto"`` would pick. The machine is ``cost_model.H200_NVLINK``: rates
measured on 2×H200, assumed to hold per device on a switched (NVSwitch) 4- or 8-GPU node.
Running the script twice on one day with the same table appends nothing the second time.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spmd.passes.cost_model import H200_NVLINK, MachineProfile, PredictionRow, format_table, predict_table

SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 12288, 49152), (8192, 8192, 28672), (16384, 8192, 4096),
    (2048, 24576, 24576), (4096, 4096, 4096), (1024, 24576, 24576),
)
HEADING = "## Predictions for TP=4 and TP=8"
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def predict(tps: Sequence[int] = (4, 8), dtype: str = "bf16",
            profile: MachineProfile = H200_NVLINK) -> list[PredictionRow]:
    """``predict_table`` rows for the benchmark ``SHAPES`` at each tp in ``tps`` (each >= 2).

    Raises ValueError for a tp < 2, a tp that does not divide K and N, or a dtype the profile lacks.
    """
    for tp in tps:
        if not isinstance(tp, int) or tp < 2:
            raise ValueError(f"tps: expected ints >= 2, got {tp!r}")
        bad = [s for s in SHAPES if s[1] % tp or s[2] % tp or s[0] % tp]
        if bad:
            raise ValueError(f"tps: {tp} does not divide M, K and N of {bad}")
    return predict_table(profile, tps=tuple(tps), shapes=SHAPES, dtype=dtype)


def summary_lines(rows: Sequence[PredictionRow]) -> list[str]:
    """Per (tp, side): at how many shapes decomposition is predicted to win, and the range of best / serial."""
    out = []
    for tp in sorted({r.tp for r in rows}):
        for side in ("all-gather", "reduce-scatter"):
            sel = [r for r in rows if r.tp == tp and r.collective == side]
            if not sel:
                continue
            wins = sum(r.decision.decompose for r in sel)
            ratios = [min(r.decision.predicted_us.values()) / r.decision.predicted_us["serial"] for r in sel]
            out.append(f"- TP={tp}, {side}: windowed einsum picked at {wins} of {len(sel)} shapes; "
                       f"best / serial from {min(ratios):.2f} to {max(ratios):.2f}.")
    return out


def section(rows: Sequence[PredictionRow], dtype: str, profile: MachineProfile, today: datetime.date) -> str:
    """The markdown section appended to docs/benchmarks.md (heading, assumptions, table, summary)."""
    tps = sorted({r.tp for r in rows})
    rates = (f"{dtype} GEMM {profile.gemm_tflops.get(dtype, float('nan')):.0f} TFLOP/s at large sizes "
             f"(half of it at {profile.gemm_half_efficiency_elems:.1e} output elements), peer copies "
             f"{profile.link_gbps_unidirectional:.0f} GB/s one way and {profile.link_gbps_bidirectional:.0f} GB/s "
             f"both ways, NCCL all-gather / reduce-scatter {profile.collective_gbps:.0f} GB/s per device, "
             f"{profile.launch_us:.0f} µs per kernel launch, {profile.event_us:.0f} µs per event record + wait, "
             f"{profile.per_step_overhead_us:.0f} µs per ring step")
    lines = [
        f"{HEADING} ({today.isoformat()}, cost model" + ("" if tps == [4, 8] else f", TP={tps}") + ")",
        "",
        _fill(f"Predicted by `python3 -m benchmarks.predict` with `spmd.passes.cost_model` and the profile "
        f"\"{profile.device_name}\". Assumed: H200 GPUs on NVLink through NVSwitch (every GPU reaches every "
        f"peer at the same rate, so a ring step is bound by one device's send + receive bandwidth), "
        f"with the link and GEMM rates measured on 2×H200: {rates}. Not run: no 4- or 8-GPU machine was "
        "used; these are model outputs, not measurements. Compare them with "
        "`OUT=/tmp/out TP=4 benchmarks/run_gpu.sh cm` (and TP=8) when such a machine is lent."),
        "",
        _fill("Per-device GEMMs: all-gather side `[M,K] @ [K,N/tp]`, reduce-scatter side `[M,K/tp] @ [K/tp,N]`. "
        "Columns: predicted ms of serial (collective, then GEMM), uni / bi (windowed einsum, uni- or "
        "bidirectional ring); pick = what `windowed_einsum=\"auto\"` would choose (ring / compute streams)."),
        "",
        "```text",
        format_table(rows),
        "```",
        "",
        *summary_lines(rows),
        "",
    ]
    return "\n".join(lines)


def _fill(text: str) -> str:
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def append_section(path: str | Path, text: str) -> bool:
    """Append ``text`` to the markdown file at ``path`` unless it already holds it; returns whether it wrote.

    Raises FileNotFoundError when ``path`` does not exist (the doc is never created here).
    """
    p = Path(path)
    old = p.read_text()
    if text.strip() in old:
        return False
    sep = "" if old.endswith("\n\n") else ("\n" if old.endswith("\n") else "\n\n")
    p.write_text(old + sep + text)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the predictions; append them to the doc unless ``--no-append``."""
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.predict", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[4, 8], help="tensor-parallel sizes (default: 4 8)")
    ap.add_argument("--dtype", default="bf16", help="GEMM element type of the profile (default: bf16)")
    ap.add_argument("--doc", default=str(DOC), help="markdown file to append to (default: docs/benchmarks.md)")
    ap.add_argument("--no-append", action="store_true", help="only print")
    args = ap.parse_args(argv)
    try:
        rows = predict(args.tp, args.dtype)
    except ValueError as e:
        ap.error(str(e))
    text = section(rows, args.dtype, H200_NVLINK, datetime.date.today())
    print(text)
    if not args.no_append:
        wrote = append_section(args.doc, text)
        print(f"{'appended to' if wrote else 'already in'} {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
