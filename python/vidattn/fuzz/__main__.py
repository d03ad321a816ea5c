"""python -m vidattn.fuzz: random configurations of every op against the float64 reference,
and the catalogue of bad inputs, all run in worker processes so that a crash is counted.

    python -m vidattn.fuzz --device cpu --count 200 --seed 1 --json summary.json
    python -m vidattn.fuzz --device cuda --count 10000 --sanitizer 40 --json $OUT/fuzz.json

Configuration i of op o uses seed (seed + i); a failure prints its one-line repro. The exit
status is 1 when a configuration failed, a worker crashed, an unexpected catalogue result came
back or the sanitizer reported an error; else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from . import catalogue, configs

# ---- the worker: reads one job per line on stdin, writes one JSON result per line ---------


def _run_job(job: dict, device: str) -> dict:
    if job["type"] == "config":
        try:
            configs.run_config(job["op"], job["seed"], device)
            return {"status": "pass"}
        except configs.Unsupported as e:
            return {"status": "unsupported", "detail": str(e)[:200]}
        except Exception as e:  # noqa: BLE001 - every other outcome is a failure to report
            return {"status": "fail", "detail": f"{type(e).__name__}: {e}"[:2000]}
    entry = {e.name: e for e in catalogue.ENTRIES}[job["name"]]
    scope = {}
    try:
        exec(compile(catalogue.PRELUDE.replace("DEVICE", repr(device)), "prelude", "exec"), scope)
    except Exception as e:  # noqa: BLE001
        return {"status": "fail", "detail": f"prelude: {type(e).__name__}: {e}"}
    try:
        exec(compile(entry.code, entry.name, "exec"), scope)
        if device == "cuda":
            import torch
            torch.cuda.synchronize()
    except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError) as e:
        if entry.kind == catalogue.OK:
            return {"status": "fail", "detail": f"{type(e).__name__}: {e}"[:500]}
        return {"status": "pass", "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    except Exception as e:  # noqa: BLE001 - an assert, or an exception of no clear kind
        return {"status": "fail", "detail": f"{type(e).__name__}: {e}"[:500]}
    if entry.kind == catalogue.RAISE:
        return {"status": "fail", "detail": "returned without an exception"}
    return {"status": "pass"}


def worker(device: str) -> None:
    import torch
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    import vidattn  # noqa: F401 - the op library, once per worker
    for line in sys.stdin:
        job = json.loads(line)
        try:
            result = _run_job(job, device)
        except Exception:  # noqa: BLE001
            result = {"status": "fail", "detail": traceback.format_exc()[-2000:]}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


# ---- the driver ----------------------------------------------------------------------------


class Pool:
    """One worker process at a time, restarted after a crash; `prefix` wraps it (e.g. with
    compute-sanitizer)."""

    def __init__(self, device: str, prefix=()):
        self.device, self.prefix, self.proc = device, list(prefix), None

    def _start(self):
        cmd = self.prefix + [sys.executable, "-m", "vidattn.fuzz", "--worker", "--device",
                             self.device]
        # The worker imports this very vidattn, wherever it was found (an install, or a
        # checkout on sys.path).
        import vidattn
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(vidattn.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)

    def run(self, job: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line)
        code = self.proc.wait()
        self.proc = None
        return {"status": "crash", "detail": f"worker exited with {code}"
                + (f" (signal {-code})" if code < 0 else "")}

    def close(self) -> int:
        if self.proc is None:
            return 0
        self.proc.stdin.close()
        code = self.proc.wait()
        self.proc = None
        return code


def config_jobs(count: int, seed: int, ops):
    for i in range(count):
        op = ops[i % len(ops)]
        yield {"type": "config", "op": op, "seed": seed + i}


def describe(job: dict, device: str) -> str:
    if job["type"] == "config":
        return f"config {job['op']} seed {job['seed']}: repro: " + configs.repro(
            job["op"], job["seed"], device)
    return f"catalogue {job['name']} ({device})"


def run(args) -> dict:
    start = time.monotonic()
    summary = {"device": args.device, "seed": args.seed, "configurations": 0, "passed": 0,
               "unsupported": 0, "failures": 0, "crashes": 0, "catalogue": 0,
               "catalogue_failures": 0, "expected_failures": [], "unexpected_passes": [],
               "sanitizer_runs": 0, "sanitizer_errors": 0, "failed": [], "by_op": {},
               "timed_out": False}
    pool = Pool(args.device)
    ops = args.ops.split(",") if args.ops else list(configs.OPS)
    for job in config_jobs(args.count, args.seed, ops):
        if args.time_budget and time.monotonic() - start > args.time_budget:
            summary["timed_out"] = True
            break
        res = pool.run(job)
        per = summary["by_op"].setdefault(job["op"], {"pass": 0, "fail": 0, "crash": 0,
                                                      "unsupported": 0})
        summary["configurations"] += 1
        status = res["status"]
        per[status] += 1
        if status == "pass":
            summary["passed"] += 1
        elif status == "unsupported":
            summary["unsupported"] += 1
        else:
            summary["failures" if status == "fail" else "crashes"] += 1
            line = describe(job, args.device)
            summary["failed"].append({"job": job, "status": status, "detail": res.get("detail"),
                                      "repro": line})
            print(f"FUZZ {status.upper()}: {line}\n    {res.get('detail', '')[:300]}",
                  flush=True)
    if not args.no_catalogue:
        for entry in catalogue.entries_for(args.device):
            job = {"type": "entry", "name": entry.name}
            res = pool.run(job)
            summary["catalogue"] += 1
            ok = res["status"] == "pass"
            reason = entry.expected_failure(args.device)
            if reason and res["status"] != "crash":
                (summary["unexpected_passes"] if ok else summary["expected_failures"]).append(
                    {"name": entry.name, "reason": reason, "detail": res.get("detail")})
                continue
            if not ok:
                key = "crashes" if res["status"] == "crash" else "catalogue_failures"
                summary[key] += 1
                summary["failed"].append({"job": job, "status": res["status"],
                                          "detail": res.get("detail"),
                                          "repro": describe(job, args.device)})
                print(f"FUZZ {res['status'].upper()}: {describe(job, args.device)}\n    "
                      f"{res.get('detail', '')[:300]}", flush=True)
    pool.close()
    if args.sanitizer:
        sanitize(args, summary, ops)
    summary["seconds"] = round(time.monotonic() - start, 1)
    return summary


def sanitize(args, summary, ops):
    """A subset of the configurations (and the catalogue's "ok" entries) in one worker under
    compute-sanitizer memcheck; its error summary is added to the run's."""
    tool = shutil.which("compute-sanitizer")
    if args.device != "cuda" or tool is None:
        summary["sanitizer_skipped"] = "needs --device cuda and compute-sanitizer on PATH"
        return
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "memcheck.log")
        # vidattn's kernels only (as tools/gpu/gpu_runner.sh): the reference's torch kernels
        # are not under test and would slow memcheck down.
        pool = Pool("cuda", [tool, "--tool", "memcheck", "--kernel-name", "kns=vidattn",
                             "--log-file", log, "--print-limit", "20"])
        jobs = list(config_jobs(args.sanitizer, args.seed + 1_000_000, ops))
        jobs += [{"type": "entry", "name": e.name} for e in catalogue.entries_for("cuda")
                 if e.kind == catalogue.OK]
        seen = 0
        for job in jobs:
            res = pool.run(job)
            summary["sanitizer_runs"] += 1
            # memcheck writes each error as it finds it: new lines name this job's errors
            text = open(log).read() if os.path.exists(log) else ""
            if "Invalid" in text[seen:] or "Error" in text[seen:]:
                summary.setdefault("sanitizer_jobs", []).append(describe(job, "cuda"))
            seen = len(text)
            if res["status"] == "crash":
                summary["crashes"] += 1
                summary["failed"].append({"job": job, "status": "crash (sanitizer)",
                                          "detail": res.get("detail"),
                                          "repro": describe(job, "cuda")})
        pool.close()
        text = open(log).read() if os.path.exists(log) else ""
        errors = memcheck_errors(text)
        if errors is None:  # memcheck never finished: its silence is no evidence
            summary["sanitizer_incomplete"] = True
            summary["sanitizer_log"] = "no ERROR SUMMARY in memcheck's log:\n" + text[-20000:]
            return
        summary["sanitizer_errors"] = errors
        if errors:
            summary["sanitizer_log"] = text[-20000:]


def memcheck_errors(text: str):
    """The errors memcheck's log reports (the sum of its ERROR SUMMARY lines), or None where
    the log has no summary (the tool did not run to its end)."""
    counts = [int(line.split("ERROR SUMMARY:")[1].split()[0])
              for line in text.splitlines() if "ERROR SUMMARY:" in line]
    return sum(counts) if counts else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vidattn.fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--count", type=int, default=60, help="random configurations (all ops)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", default="", help=f"comma-separated subset of {','.join(configs.OPS)}")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds for the configurations; 0 = no limit")
    ap.add_argument("--sanitizer", type=int, default=0, metavar="N",
                    help="also run N configurations under compute-sanitizer memcheck (CUDA)")
    ap.add_argument("--no-catalogue", action="store_true")
    ap.add_argument("--json", default="", help="write the summary here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.device)
        return 0
    summary = run(args)
    text = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    incomplete = (" (memcheck did not finish: no ERROR SUMMARY)"
                  if summary.get("sanitizer_incomplete") else "")
    print(f"fuzz {args.device}: {summary['configurations']} configurations, "
          f"{summary['passed']} passed, {summary['unsupported']} unsupported, "
          f"{summary['failures']} failed, {summary['crashes']} crashes; catalogue "
          f"{summary['catalogue']} entries, {summary['catalogue_failures']} failed, "
          f"{len(summary['expected_failures'])} expected failures, "
          f"{len(summary['unexpected_passes'])} now pass; sanitizer "
          f"{summary['sanitizer_runs']} runs, {summary['sanitizer_errors']} errors{incomplete} "
          f"({summary['seconds']} s)")
    bad = (summary["failures"] or summary["crashes"] or summary["catalogue_failures"]
           or summary["sanitizer_errors"] or summary.get("sanitizer_incomplete"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
