"""``python -m vidattn.bench --e2e``: one denoising step of diffusers' Wan transformer, whole.

Builds ``WanTransformer3DModel`` from the published Wan2.1 configs (written below; nothing is
downloaded) with random bf16 weights (the modules diffusers keeps in float32 when it loads a
checkpoint stay float32 here too), and times one step, inference (forward under no_grad) and
training (forward + backward of a fixed output gradient, parameter gradients included), for:

- ``diffusers-default``: diffusers' own processors (``dispatch_attention_fn``, torch SDPA with
  torch's choice of backend);
- ``sdpa-cudnn``: the same processors with SDPA forced to cuDNN
  (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``), the baseline a knowledgeable user picks on
  Hopper;
- ``vidattn-dense``: ``vidattn.integrations.diffusers.enable(model, "dense")``;
- ``vidattn-vsa``: ``enable(model, "vsa", sparsity=...)`` (90% by default; ``retile="auto"``,
  which at the Wan grids, not multiples of the 4 x 4 x 4 tile, tiles in every layer);
- ``vidattn-vsa-tiled`` (not in the default list): the same with ``retile="forward"``, the
  blocks in tile order, tiled once per forward, padding slots included.

Models: ``wan2.1-1.3b-480p`` (latents 1 x 16 x 21 x 60 x 104, 512 text tokens) and
``wan2.1-14b-720p`` (1 x 16 x 21 x 90 x 160); ``tiny`` is a 2-layer toy for the CPU smoke test.

Times are the median of CUDA-event timed repetitions (``timing.CudaTimer``) after warm-up; on
the CPU, ``timing.CpuTimer``. One more step per row runs under ``torch.profiler``: the self
device time of every op, summed by kind (attention: SDPA's and vidattn's attention and VSA ops;
linear; norm; rope: vidattn's op; tiling: vidattn's gathers; other), gives the share of the
step spent in attention. The output of vidattn dense is compared with diffusers' default on the
same weights and inputs.

Depth: ``--e2e-layers N`` builds N blocks instead of the config's (the 14B at 720p does not
train in 80 GB whole); ``--e2e-layers MODEL[:DIRECTION]=N,...`` sets it per model and
direction (the rest at full depth; 0 leaves it out), e.g.
``wan2.1-1.3b-480p:training=8,wan2.1-14b-720p=4``. A 0-layer model (embeddings and output
head only) is timed too, so each row reports the measured step at N layers, the per-layer time
``(T_N - T_0) / N`` and, where N is less than the full depth, the full-depth step
**extrapolated** as ``T_0 + L * per_layer`` (marked ``"full_depth_extrapolated": true`` in the
JSON).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import environment
from .modes.common import result_doc, write_json
from .timing import CpuTimer, CudaTimer

# Published transformer configs (diffusers' transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-
# Diffusers and Wan-AI/Wan2.1-T2V-14B-Diffusers), as dicts so that nothing is downloaded.
WAN21_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                    added_kv_proj_dim=None, rope_max_seq_len=1024)
WAN21_1_3B = dict(WAN21_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN21_14B = dict(WAN21_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# The CPU smoke test's model: every code path of the big ones at a toy size.
TINY = dict(patch_size=(1, 2, 2), attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=64,
            num_attention_heads=2, ffn_dim=48, num_layers=2)

MODELS = {
    "wan2.1-1.3b-480p": dict(config=WAN21_1_3B, latents=(1, 16, 21, 60, 104), text_tokens=512),
    "wan2.1-14b-720p": dict(config=WAN21_14B, latents=(1, 16, 21, 90, 160), text_tokens=512),
    "tiny": dict(config=TINY, latents=(1, 4, 5, 10, 14), text_tokens=9),
}
GPU_MODELS = ("wan2.1-1.3b-480p", "wan2.1-14b-720p")
IMPLS = ("diffusers-default", "sdpa-cudnn", "vidattn-dense", "vidattn-vsa")
# Accepted by --impls, not run by default.
EXTRA_IMPLS = ("vidattn-vsa-tiled",)
# impl -> enable()'s arguments besides the sparsity (None: diffusers' own processors).
VIDATTN_IMPLS = {"vidattn-dense": dict(mode="dense"), "vidattn-vsa": dict(mode="vsa"),
                 "vidattn-vsa-tiled": dict(mode="vsa", retile="forward")}
DIRECTIONS = ("inference", "training")
PEER = "sdpa-cudnn"  # the speedups are against this row, timed in the same run

# Profiler op names by kind (self time, so nested ops are not counted twice).
KINDS = (
    ("attention", re.compile(r"scaled_dot_product|flash_attention|efficient_attention|"
                             r"cudnn_attention|^vidattn::(attention|block_sparse|vsa_fine|"
                             r"vsa_combine|tile_mean_pool|topk_tiles)")),
    ("tiling", re.compile(r"^vidattn::(gather_tokens|vsa_tiling_metadata)")),
    ("rope", re.compile(r"^vidattn::apply_rope")),
    ("linear", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|linear|matmul|_addmm_activation)$")),
    ("norm", re.compile(r"^aten::(native_layer_norm|layer_norm|rms_norm|_fused_rms_norm|"
                        r"native_layer_norm_backward|_fused_rms_norm_backward)")),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vidattn.bench --e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--e2e-models", default=",".join(GPU_MODELS),
                   help=f"comma list of {', '.join(MODELS)} (default: the two Wan2.1 ones)")
    p.add_argument("--e2e-layers", default=None, metavar="N|MODEL[:DIRECTION]=N,...",
                   help="blocks to build and time (default: the config's), for all models or "
                        "per model and direction; below the full depth the full-depth step is "
                        "extrapolated (and marked so)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma list of {', '.join(IMPLS + EXTRA_IMPLS)} (default: "
                        f"{', '.join(IMPLS)})")
    p.add_argument("--directions", default=",".join(DIRECTIONS),
                   help="comma list of inference, training")
    p.add_argument("--sparsity", type=float, default=0.9, help="VSA sparsity (default 0.9)")
    p.add_argument("--device", default=None, help="cuda[:N] (default) or cpu (tiny model only)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps per row (default 5 on CUDA, 1 on the CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before timing (default 2 on CUDA, 0 on the CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiled step (no attention share)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default bench/results/<device>/e2e[-<N>layers].json); the "
                        "PNG goes next to it")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="write <out-dir>/<device>/e2e[-<N>layers].json (bench/results' "
                        "layout elsewhere, e.g. a GPU machine's output folder) instead")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def _csv(text: str, allowed: Sequence[str], what: str, parser) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        parser.error(f"{what}: expected a comma list of {', '.join(allowed)}, got {text!r}")
    return items


def build_model(config: dict, layers: int, device: torch.device, dtype: torch.dtype, seed: int):
    """WanTransformer3DModel with random weights, built on the device in ``dtype`` (a 14B model
    in float32 on the host would need 56 GB), then the modules diffusers keeps in float32 on
    load (``_keep_in_fp32_modules``) put back to float32, as a real checkpoint runs."""
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = WanTransformer3DModel(**dict(config, num_layers=layers))
    finally:
        torch.set_default_dtype(previous)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype != torch.float32:
        # diffusers matches the names' parts: modules (rope, norm1, time_embedder, ...) and
        # parameters (scale_shift_table) alike.
        for name, module in model.named_modules():
            if name and any(part in keep for part in name.split(".")):
                module.float()
        for name, param in model.named_parameters():
            if name.split(".")[-1] in keep:
                param.data = param.data.float()
    return model.eval()


def make_inputs(spec: dict, device, dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    latents = torch.randn(spec["latents"], generator=g).to(device, dtype)
    text = torch.randn(spec["latents"][0], spec["text_tokens"], spec["config"]["text_dim"],
                       generator=g).to(device, dtype)
    timestep = torch.full((spec["latents"][0],), 500, device=device, dtype=torch.long)
    return latents, timestep, text


def _attention_context(impl: str):
    if impl == "sdpa-cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    return contextlib.nullcontext()


def _switch(model, impl: str, sparsity: float) -> None:
    """Puts ``impl``'s processors on the model (diffusers' own for the SDPA rows)."""
    import vidattn.integrations.diffusers as vd

    wanted = VIDATTN_IMPLS.get(impl)
    if wanted is None:
        if vd.enabled_mode(model) is not None:
            vd.disable(model)
    else:  # a switch between two vidattn rows keeps the gates
        vd.enable(model, sparsity=sparsity, **wanted)


def step_fn(model, inputs, direction: str, impl: str, grad_out: Optional[torch.Tensor]):
    """One denoising step as a closure: inference under no_grad, or training: forward and
    backward of ``grad_out`` with the parameter gradients reset first (as
    ``optimizer.zero_grad(set_to_none=True)`` leaves them)."""
    if direction == "inference":
        def run():
            with torch.no_grad(), _attention_context(impl):
                return model(*inputs, return_dict=False)[0]
    else:
        def run():
            model.zero_grad(set_to_none=True)
            with _attention_context(impl):
                out = model(*inputs, return_dict=False)[0]
            out.backward(grad_out)
            return out
    return run


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_breakdown(fn, device) -> dict:
    """One profiled step: self time (device time on CUDA, CPU time on the CPU) of every op,
    summed by kind, in ms; and the attention share of the total."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    kinds = {name: 0.0 for name, _ in KINDS}
    kinds["other"] = 0.0
    for evt in prof.key_averages():
        if device.type == "cuda":
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total
        if not us:
            continue
        kind = next((name for name, pattern in KINDS if pattern.search(evt.key)), "other")
        kinds[kind] += us / 1e3
    total = sum(kinds.values())
    return {"breakdown_ms": kinds, "profiled_total_ms": total,
            "attention_share": kinds["attention"] / total if total > 0 else None,
            "profile_time": "self device time per op" if device.type == "cuda"
                            else "self CPU time per op"}


def _unavailable(impl: str, device) -> Optional[str]:
    if impl == "sdpa-cudnn" and device.type != "cuda":
        return "cuDNN attention is a CUDA backend of SDPA"
    return None


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_model(name: str, layers: Optional[int], impls, directions, device, timer, sparsity,
              seed, profile: bool, log=print) -> dict:
    spec = MODELS[name]
    config = spec["config"]
    full = config["num_layers"]
    timed_layers = full if layers is None else layers
    dtype = torch.bfloat16
    _, _, frames, height, width = spec["latents"]
    pt, ph, pw = config["patch_size"]
    grid = (frames // pt, height // ph, width // pw)
    result = {"name": name, "config": dict(config), "full_layers": full,
              "timed_layers": timed_layers, "latents": list(spec["latents"]),
              "text_tokens": spec["text_tokens"], "grid": list(grid),
              "tokens": math.prod(grid), "dtype": "bf16", "rows": []}
    inputs = make_inputs(spec, device, dtype, seed)

    # The embeddings and the output head alone (0 blocks): the per-layer times subtract it.
    head = build_model(config, 0, device, dtype, seed)
    head_ms = {}
    for direction in directions:
        grad = _grad_like(head, inputs, device, dtype, seed) if direction == "training" else None
        fn = step_fn(head, inputs, direction, "diffusers-default", grad)
        fn()
        head_ms[direction] = timer.measure_group([fn])[0].median_ms
    result["non_block_ms"] = head_ms
    del head
    _free(device)

    model = build_model(config, timed_layers, device, dtype, seed)
    outputs = {}
    for direction in directions:
        grad = _grad_like(model, inputs, device, dtype, seed) if direction == "training" \
            else None
        if direction == "training":
            model.train()
        else:
            model.eval()
        for impl in impls:
            row = {"impl": impl, "direction": direction}
            reason = _unavailable(impl, device)
            if reason is not None:
                row.update(status="unavailable", reason=reason)
                result["rows"].append(row)
                continue
            _switch(model, impl, sparsity)
            fn = step_fn(model, inputs, direction, impl, grad)
            try:
                out = fn()  # first call: compiles nothing, but allocates and warms caches
                if direction == "inference" and impl in ("diffusers-default", "vidattn-dense"):
                    outputs[impl] = out.float()
                del out
                t = timer.measure_group([fn])[0]
            except torch.cuda.OutOfMemoryError as e:
                row.update(status="oom", reason=str(e).splitlines()[0])
                result["rows"].append(row)
                model.zero_grad(set_to_none=True)
                _free(device)
                continue
            row.update(status="ok", step_ms=t.median_ms, step_min_ms=t.min_ms,
                       repeats=t.repeats)
            per_layer = (t.median_ms - head_ms[direction]) / timed_layers \
                if timed_layers else None
            row["per_layer_ms"] = per_layer
            row["full_depth_extrapolated"] = timed_layers != full
            row["full_depth_step_ms"] = t.median_ms if timed_layers == full else (
                head_ms[direction] + full * per_layer if per_layer is not None else None)
            if profile:
                row.update(profile_breakdown(fn, device))
            model.zero_grad(set_to_none=True)
            _free(device)
            result["rows"].append(row)
            log(f"{name} L{timed_layers} {direction:9s} {impl:17s} {t.median_ms:10.3f} ms"
                + (f"  attention {row['attention_share']:.1%}"
                   if row.get("attention_share") is not None else ""))
    _switch(model, "diffusers-default", sparsity)
    _add_speedups(result["rows"])
    if "diffusers-default" in outputs and "vidattn-dense" in outputs:
        ref, got = outputs["diffusers-default"], outputs["vidattn-dense"]
        diff = (got - ref).abs()
        result["dense_vs_default"] = {
            "max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
            "ref_max_abs": ref.abs().max().item(),
            "max_rel": diff.max().item() / max(ref.abs().max().item(), 1e-30),
            "what": "inference output of the timed model (bf16), vidattn dense minus "
                    "diffusers' default, same weights and inputs"}
    del model, outputs
    _free(device)
    return result


def _grad_like(model, inputs, device, dtype, seed):
    """A fixed output gradient of the step's output shape (the latents' shape)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    return torch.randn(inputs[0].shape, generator=g).to(device, dtype)


def _add_speedups(rows) -> None:
    peer = {r["direction"]: r["step_ms"] for r in rows
            if r["impl"] == PEER and r.get("status") == "ok"}
    for r in rows:
        if r.get("status") == "ok" and r["direction"] in peer:
            r[f"speedup_vs_{PEER}"] = peer[r["direction"]] / r["step_ms"]


def write_plot(path: Path, models: Sequence[dict], title: str) -> None:
    """Step time per implementation, one group of bars per (model, direction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(m, d) for m in models for d in dict.fromkeys(r["direction"] for r in m["rows"])]
    # Rows that ran somewhere (an implementation with no bar would still take a colour).
    impls = list(dict.fromkeys(r["impl"] for m in models for r in m["rows"]
                               if r.get("status") == "ok"))
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups)), 4.5))
    for i, impl in enumerate(impls):
        xs, ys, labels = [], [], []
        for g, (m, d) in enumerate(groups):
            row = next((r for r in m["rows"] if r["impl"] == impl and r["direction"] == d
                        and r.get("status") == "ok"), None)
            if row is not None:
                xs.append(g + (i - (len(impls) - 1) / 2) * width)
                ys.append(row["full_depth_step_ms"])
                s = row.get(f"speedup_vs_{PEER}")
                labels.append(f"{s:.2f}x" if s is not None else "")
        bars = ax.bar(xs, ys, width, label=impl)
        for bar, label in zip(bars, labels):
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m['name']}\n{d}" + (f"\n(extrapolated from {m['timed_layers']} "
                                               f"layers)" if m["timed_layers"] != m["full_layers"]
                                               else "") for m, d in groups], fontsize=7)
    from .plot import save_bar_chart

    save_bar_chart(fig, ax, path, f"step time, ms (median); speedup vs {PEER}", title)


def parse_layers(text: Optional[str], models: Sequence[str], directions: Sequence[str],
                 parser) -> dict:
    """--e2e-layers -> {(model, direction): blocks or None (the config's); 0: not run}."""
    layers = {(m, d): None for m in models for d in directions}
    if text is None:
        return layers

    def count(value: str, least: int) -> int:
        try:
            n = int(value)
        except ValueError:
            n = -1
        if n < least:
            parser.error(f"--e2e-layers: expected a block count >= {least}, got {value!r}")
        return n

    if "=" not in text:
        n = count(text.strip(), 1)
        return {key: n for key in layers}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        target, _, value = item.partition("=")
        name, _, direction = target.strip().partition(":")
        if name not in MODELS or (direction and direction not in DIRECTIONS):
            parser.error(f"--e2e-layers: expected MODEL[:DIRECTION]=N with MODEL one of "
                         f"{', '.join(MODELS)} and DIRECTION one of {', '.join(DIRECTIONS)}, "
                         f"got {item!r}")
        n = count(value.strip(), 0)  # 0 leaves that model's direction out
        for d in ([direction] if direction else directions):
            if (name, d) in layers:
                layers[(name, d)] = n
    return layers


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    models = _csv(args.e2e_models, tuple(MODELS), "--e2e-models", parser)
    impls = _csv(args.impls, IMPLS + EXTRA_IMPLS, "--impls", parser)
    directions = _csv(args.directions, DIRECTIONS, "--directions", parser)
    layers = parse_layers(args.e2e_layers, models, directions, parser)
    if args.out is not None and args.out_dir is not None:
        parser.error("--out and --out-dir: give one of them")
    if not 0.0 <= args.sparsity < 1.0:
        parser.error(f"--sparsity must be in [0, 1), got {args.sparsity}")
    for name in ("repeats", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "repeats" else 0):
            parser.error(f"--{name} must be >= {1 if name == 'repeats' else 0}, got {value}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    big = [m for m in models if m != "tiny"]
    if device.type == "cpu" and big:
        parser.error(f"--e2e-models {','.join(big)}: the Wan2.1 steps need a CUDA GPU (this "
                     "machine has none, or --device cpu was given); the CPU runs only "
                     "--e2e-models tiny (the smoke test)")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        parser.error("--e2e needs diffusers (requirements/dev.txt pins diffusers==0.42.1)")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)
        torch.cuda.set_device(device)
        timer = CudaTimer(2 if args.warmup is None else args.warmup, args.repeats or 5)
    else:
        timer = CpuTimer(0 if args.warmup is None else args.warmup, args.repeats or 1)

    started = time.perf_counter()
    results = []
    import diffusers

    def document(complete: bool) -> dict:
        return result_doc("e2e", argv, device=device, timer=timer.name, sparsity=args.sparsity,
                          diffusers_version=diffusers.__version__,
                          vsa_tile=[4, 4, 4], peer=PEER, models=results, complete=complete,
                          step="one call of WanTransformer3DModel (one denoising step, batch 1, "
                               "one CFG branch); training adds the backward of a fixed output "
                               "gradient",
                          wall_s=round(time.perf_counter() - started, 3))

    out = args.out
    if out is None:
        depths = set(layers.values()) - {0}
        tag = "e2e" + (f"-{depths.pop()}layers" if len(depths) == 1 and None not in depths
                       else "")
        root = args.out_dir if args.out_dir is not None else \
            environment.repo_root() / "bench" / "results"
        out = Path(root) / document(complete=False)["device"] / f"{tag}.json"

    for m in models:
        # One model build per depth: the directions timed at the same depth share it.
        depths = dict.fromkeys(layers[(m, d)] for d in directions if layers[(m, d)] != 0)
        for depth in depths:
            chosen = [d for d in directions if layers[(m, d)] == depth]
            results.append(run_model(m, depth, impls, chosen, device, timer, args.sparsity,
                                     args.seed, not args.no_profile))
            # The models done so far, in case a time limit stops the run before the end.
            write_json(out, document(complete=False))
    doc = document(complete=True)
    write_json(out, doc)
    print(f"wrote {out}")
    if not args.no_plot:
        png = Path(out).with_suffix(".png")
        write_plot(png, results, f"Wan transformer step on {doc['device']}, {doc['date']}, "
                                 f"commit {(doc.get('git_commit') or 'unknown')[:10]}")
        print(f"wrote {png}")
    return 0
