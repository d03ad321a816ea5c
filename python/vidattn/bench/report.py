"""The printed table and the JSON file."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

SCHEMA = "vidattn-bench/1"

COLUMNS = ("shape", "impl", "dtype", "dir", "median ms", "TFLOP/s", "x peer", "max abs err",
           "ref")


def _num(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _cells(row: dict) -> list[str]:
    head = [row["shape_label"], row["impl"], row["dtype"], row["direction"]]
    if row["status"] != "ok":
        return head + [row["status"], "-", "-", "-", "-"]
    if row["ratio_to_peer"] is not None:
        r = row["ratio_to_peer"]
        ratio = f"{r:.2f}" if r >= 0.1 else f"{r:.2g}"
    else:
        ratio = "peer" if row["impl"] == row.get("peer") else "-"
    err = row["max_abs_err"]
    return head + [_num(row["median_ms"]), _num(row["tflops"]), ratio,
                   f"{err:.2e}" if math.isfinite(err) else str(err), row["ref_scope"]["label"]]


def _clock_cell(row: dict) -> str:
    clocks = row.get("clocks")
    return f"{clocks['sm_mhz_median']:.0f}" if clocks else "-"


def format_table(rows: Sequence[dict]) -> str:
    """One line a row; an "SM MHz" column (the median SM clock while the row was timed) when
    the run sampled clocks."""
    with_clocks = any(r.get("clocks") for r in rows)
    header = list(COLUMNS) + (["SM MHz"] if with_clocks else [])
    cells = [header] + [_cells(r) + ([_clock_cell(r)] if with_clocks else []) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    numeric = {4, 5, 6, 7, 9}
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_rows_brief(rows: Sequence[dict]) -> str:
    """One line a row, for logs while the bench runs."""
    lines = []
    for r in rows:
        what = f"{r['case']} {r['shape_label']} {r['dtype']} {r['direction']} {r['impl']}:"
        if r["status"] == "ok":
            clocks = r.get("clocks")
            lines.append(f"{what} {r['median_ms']:.4g} ms, {r['tflops']:.4g} TFLOP/s, "
                         f"max abs err {r['max_abs_err']:.3g}"
                         + (f", SM {clocks['sm_mhz_median']:.0f} MHz" if clocks else ""))
        else:
            lines.append(f"{what} {r['status']} ({r['note']})")
    return "\n".join(lines)


def format_notes(rows: Sequence[dict], meta: dict) -> str:
    peers = sorted({r["peer"] for r in rows if r.get("peer")})
    notes = [
        f"device {meta['device']} ({meta['device_description']}), {meta['threads']} threads, "
        f"torch {meta['torch_version']}, commit {(meta.get('git_commit') or 'unknown')[:12]}"
        + (" (dirty)" if meta.get("git_dirty") else "") + f"; timer: {meta['timer']}",
        f"x peer = peer's median time / this row's (> 1: faster); peer: {', '.join(peers) or '-'}",
        "max abs err: vs a float64 reference on the same inputs (bwd: max over dq, dk, dv); "
        "ref = the batches/heads it covers ('all' or bX/B hY/H)",
    ]
    ours = [r for r in rows if r["is_ours"] and r.get("ratios_to_peers")]
    for r in ours:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios_to_peers"].items())
        notes.append(f"{r['impl']} {r['shape_label']} {r['dtype']} {r['direction']}: "
                     f"vs every peer: {ratios}")
    clocked = [r for r in rows if r.get("clocks")]
    if clocked:
        capped = sum("power cap" in r["clocks"]["reasons"] for r in clocked)
        notes.append(f"SM MHz: median SM clock while the row was timed "
                     f"({meta.get('clock_sampling')}); the power cap limited it in {capped} of "
                     f"{len(clocked)} rows")
    fastvideo = meta.get("peers", {}).get("fastvideo_kernel")
    if fastvideo is not None:
        notes.append("fastvideo-kernel: " + (
            f"{fastvideo.get('version')} (compiled extension: "
            f"{'yes' if fastvideo.get('compiled_extension') else 'no, Triton only'})"
            if fastvideo.get("available") else fastvideo.get("reason", "not available")))
    skipped = [(r["status"], r["note"]) for r in rows if r["status"] != "ok"]
    notes += [f"{status}: {n}" for status, n in dict.fromkeys(skipped)]  # once each, in order
    return "\n".join(notes)


def json_safe(value):
    """Strict JSON: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, meta: dict, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, **meta, "rows": list(rows)}
    path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
