"""``python -m vidattn.bench``: argument parsing and the top-level flow. A first argument that
names a mode (modes/__init__.py: ``dense``, ``rope``, ``distributed``, ...) hands the rest of
the command line to that mode; anything else is the case runner's."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import cases as cases_mod
from . import environment, modes, report, shapes as shapes_mod
from .clocks import ClockSampler
from .runner import Plan, run_plan
from .timing import timer_for

DEFAULT_DTYPES = {"cpu": ("fp32", "bf16"), "cuda": ("bf16",)}
DEFAULT_PRESET = {"cpu": "quick", "cuda": "video"}


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    presets = "; ".join(f"{name}: {p.about}" for name, p in shapes_mod.PRESETS.items())
    p = argparse.ArgumentParser(
        prog="python -m vidattn.bench",
        usage="%(prog)s [MODE] [options]",
        description="Time vidattn against its peers (PyTorch SDPA) and check every result "
                    "against a float64 reference. Prints a table, writes JSON and a PNG.",
        epilog="Modes (python -m vidattn.bench MODE --help):\n" + modes.describe()
               + "\n\nWhole model: python -m vidattn.bench --e2e [--help]: one denoising step "
                 "of diffusers'\n  Wan2.1 transformer (1.3B 480p, 14B 720p), inference and "
                 "training, default\n  attention vs SDPA-cuDNN vs vidattn dense and VSA "
                 "(e2e_case.py)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--dtype", type=_csv, default=None,
                   help="comma list of fp32, bf16, fp16, fp64 (default: the preset's, else "
                        "fp32,bf16 on CPU and bf16 on CUDA)")
    p.add_argument("--shapes", type=_csv, default=None,
                   help=f"comma list of presets or shapes like b1h4s1024d64 (k<len> for another "
                        f"kv length, trailing c for causal, trailing sp0.875 for block-sparse at "
                        f"that sparsity). Presets: {presets}. Default: quick on CPU, video on "
                        "CUDA")
    p.add_argument("--directions", type=_csv, default=None,
                   help="comma list of fwd, bwd (default: the preset's, usually both)")
    p.add_argument("--cases", type=_csv, default=None,
                   help="comma list of dense, blocksparse, vsa (default: all; each runs the "
                        "shapes of its kind: plain lengths for dense, lengths with a sparsity "
                        "(sp0.875) for blocksparse, video grids for vsa)")
    p.add_argument("--draw-selection", type=Path, default=None, metavar="PNG",
                   help="also draw the key tiles VSA selects for each query tile (batch 0, "
                        "head 0) on the first video shape, to this PNG")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per row (default: CPU adapts to ~0.5 s a row group, 3-50 "
                        "runs (7+ for cpu-4k); CUDA uses do_bench after 0.5 s of warm-up, "
                        "0.2 s of runs; or CUDA events with this many)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed runs before timing, besides the first (accuracy) run, which "
                        "warms up too (default 0 on CPU, 3 before CUDA events)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for vidattn and the peers alike (torch.set_num_threads; "
                        "default: torch's current setting)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default bench/results/<device>/<preset>[-<cases>]"
                        "[-<directions>].json in the git checkout of the current directory, "
                        "cases and directions named when given); the PNG goes next to it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar; print each row to stderr as it is done instead")
    p.add_argument("--seed", type=int, default=0, help="base seed of the random inputs")
    p.add_argument("--input-scale", type=float, default=1.0,
                   help="standard deviation of q, k, v (the accuracy checks sweep 1, 4, 16)")
    p.add_argument("--ref-heads", type=int, default=None,
                   help="cap the heads the float64 reference covers (default: all that fit a "
                        "FLOP budget, batch 0 only when not all fit)")
    return p


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("repeats", "threads", "ref_heads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    bad = [d for d in (args.directions or []) if d not in ("fwd", "bwd")]
    if bad:
        parser.error(f"--directions: expected fwd and/or bwd, got {bad}")
    bad = [d for d in (args.dtype or []) if d not in cases_mod.DTYPES]
    if bad:
        parser.error(f"--dtype: expected some of {sorted(cases_mod.DTYPES)}, got {bad}")


def default_out(meta: dict, shape_args: Optional[list[str]], default_preset: str,
                case_args: Optional[list[str]] = None,
                direction_args: Optional[list[str]] = None) -> Path:
    """``bench/results/<device>/<preset>.json``: one stable name per (benchmark, device), the
    baseline that bench/results/README.md indexes, so a new run replaces it and git keeps the
    old one. Shape lists are ``custom``; the cases and directions, when given, are part of
    the name (``gpu-suite-fwd``, ``gpu-suite-dense-vsa``), so a partial run does not replace
    the whole one. The date and commit are inside the JSON."""
    names = shape_args or [default_preset]
    tag = names[0] if len(names) == 1 and names[0] in shapes_mod.PRESETS else "custom"
    if case_args and list(case_args) != list(cases_mod.CASE_NAMES):
        tag += "-" + "-".join(case_args)
    if direction_args:
        tag += "-" + "-".join(direction_args)
    return environment.repo_root() / "bench" / "results" / meta["device"] / f"{tag}.json"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--e2e" in argv:  # the whole-model benchmark (e2e_case.py) has its own options
        from .e2e_case import main as e2e_main

        return e2e_main([a for a in argv if a != "--e2e"])
    if argv and argv[0] in modes.MODES:
        return modes.run(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)
        torch.cuda.set_device(device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    try:
        preset = shapes_mod.resolve(args.shapes or [DEFAULT_PRESET[device.type]])
        cases = cases_mod.cases_for(device, args.cases or cases_mod.CASE_NAMES)
    except ValueError as e:
        parser.error(str(e))
    plan = Plan(shapes=preset.shapes,
                dtypes=args.dtype or preset.dtypes or DEFAULT_DTYPES[device.type],
                directions=args.directions or preset.directions, cases=cases, device=device,
                timer=timer_for(device, args.warmup, args.repeats, preset.cpu_min_repeats),
                seed=args.seed, input_scale=args.input_scale, ref_heads=args.ref_heads,
                clocks=ClockSampler.for_device(device))

    meta = environment.metadata(device, threads, argv)
    meta.update(timer=plan.timer.name, seed=args.seed, input_scale=args.input_scale,
                clock_sampling=plan.clocks.description if plan.clocks else None)
    from .peers import fastvideo_info, tk_info

    meta["peers"] = {"fastvideo_kernel": fastvideo_info(), "fastvideo_tk": tk_info(),
                     "flex_attention": f"torch {torch.__version__}"}
    out = args.out or default_out(meta, args.shapes, DEFAULT_PRESET[device.type],
                                  args.cases, args.directions)

    from tqdm import tqdm

    started = time.perf_counter()
    if plan.clocks is not None:
        plan.clocks.start()
    try:
        with tqdm(total=plan.row_count, desc="vidattn.bench", unit="row", file=sys.stderr,
                  disable=args.no_progress, dynamic_ncols=True) as bar:
            rows = run_plan(plan, progress=bar.update,
                            on_rows=(lambda group: print(report.format_rows_brief(group),
                                                         file=sys.stderr, flush=True))
                            if args.no_progress else (lambda group: None))
    finally:
        if plan.clocks is not None:
            plan.clocks.stop()
    meta["wall_s"] = round(time.perf_counter() - started, 3)

    print(report.format_table(rows))
    print()
    print(report.format_notes(rows, meta))
    report.write_json(out, meta, rows)
    print(f"wrote {out}")
    if args.draw_selection is not None:
        from .vsa_case import draw_selection

        videos = [shape for shape in preset.shapes if shape.grid is not None]
        if not videos:
            parser.error("--draw-selection needs a video shape (e.g. --shapes vsa-cpu)")
        draw_selection(videos[0], args.draw_selection, device, seed=args.seed)
        print(f"wrote {args.draw_selection}")
    if not args.no_plot:
        from .plot import write_plot

        png = out.with_suffix(".png")
        title = (f"vidattn.bench on {meta['device']} ({meta['threads']} threads), {meta['date']}, "
                 f"commit {(meta.get('git_commit') or 'unknown')[:10]}")
        write_plot(png, rows, title)
        print(f"wrote {png}")
    return 0
