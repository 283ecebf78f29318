"""Restart and watch at scale: the resume index (kit/run/index.py) against a full read.

    python bench/bench_scale_restart.py [--records 1000000] [--workdir /tmp/scale_restart]
                                        [--tokenizer data/models/SmolLM2-135M-Instruct]

Builds (once; reused while its marker exists) a run dir of --records records written with
RunStore (8 datasets, 5% spare prompts, completions of a few words), closed cleanly so each
records file has its index. Then each step runs in a fresh interpreter and prints its wall
time, CPU time and the process's peak RSS:
  scan_before    RunStore.scan() as it was: lines.scan_heads of every whole file
  scan_full      RunStore.scan() with no index (kit.run.index.load -> None): the fallback
  scan_index     RunStore.scan() from the index (+ the bytes after it)
  frame_index    RunStore.scan_frame() from the index (what a restart uses)
  watch_full     ProgressReader(run_dir).read(), first read, no index
  watch_index    the same from the index
  restart        kit.run.runner._Runner.create(None, config): read prompts.parquet, check the
                 fingerprint, scan, guard (with --tokenizer; its cache in guard.json filled
                 by a first, untimed, restart), queues: everything before the first request
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = ["scan_before", "scan_full", "scan_index", "frame_index", "watch_full", "watch_index", "restart"]  # fmt: skip


def build(run_dir: Path, n: int, tokenizer: str | None) -> None:
    """n records over 8 datasets, written with RunStore and closed (which writes the index)."""
    import random

    import polars as pl

    from kit.data.sources import source_hashes
    from kit.run.store import RunStore
    from kit.tokens import chat_template_hash
    from kit.types import Record, RunConfig, Sampling

    names, rng = [f"ds{i}" for i in range(8)], random.Random(0)
    per = n // len(names)
    spare = int(per * 1.05)
    ids = {ds: [f"{rng.getrandbits(64):016x}" for _ in range(spare)] for ds in names}
    msgs = lambda ds, i: [{"role": "user", "content": f"{ds} question {i}: answer in a few words"}]  # noqa: E731
    frame = pl.DataFrame({
        "dataset": [ds for ds in names for _ in range(spare)],
        "prompt_id": [p for ds in names for p in ids[ds]],
        "messages": [msgs(ds, i) for ds in names for i in range(spare)],
        "n_turns": [1] * (spare * len(names)), "row": [i for _ in names for i in range(spare)],
    })  # fmt: skip
    extra = {"tokenizer": tokenizer, "max_context": 8192} if tokenizer else {}
    config = RunConfig(
        model="fake", endpoints="http://127.0.0.1:9/v1", budgets=dict.fromkeys(names, 10**9),
        sampling=Sampling(max_tokens=64), source_hashes=source_hashes(frame),
        chat_template_hash=chat_template_hash(tokenizer) if tokenizer else None, **extra,
    )  # fmt: skip
    store = RunStore(run_dir, flush_every=20_000, flush_interval=1e9)
    store.init(config, frame)
    t0 = time.time() - n
    for k in range(per * len(names)):
        ds, i = names[k % len(names)], k // len(names)
        tokens = 5 + (i * 7919) % 60
        store.append(Record(
            dataset=ds, prompt_id=ids[ds][i], sample=0, messages=msgs(ds, i), completion="ok " * 4,
            finish_reason="length" if tokens >= 60 else "stop", completion_tokens=tokens,
            count_source="usage", prompt_tokens=20, endpoint="http://127.0.0.1:9/v1",
            latency_s=0.5, t_done=t0 + k,
        ))  # fmt: skip
    store.close()


def child(step: str, run_dir: str) -> None:
    """One step in this fresh process; prints a JSON line."""
    from kit.run import index
    from kit.run.lines import record_files, scan_heads
    from kit.run.progress import ProgressReader
    from kit.run.runner import _Runner
    from kit.run.store import RunStore, read_config

    if step.endswith("_full"):
        index.load = lambda path: (
            None
        )  # no valid index: what a first restart after kit's update does
    w0, c0 = time.perf_counter(), time.process_time()
    if step == "scan_before":
        out: dict = {}
        for path in record_files(Path(run_dir)).values():
            for head in scan_heads(path, []):
                out.setdefault(head[:3], head[3:5])
        n = len(out)
    elif step.startswith("scan_"):
        n = len(RunStore(run_dir).scan())
    elif step == "frame_index":
        n = RunStore(run_dir).scan_frame().height
    elif step.startswith("watch_"):
        n = sum(p.samples_done for p in ProgressReader(run_dir).read())
    else:
        runner = _Runner.create(None, read_config(run_dir), run_dir=run_dir, force=False, expected_tokens=None)  # fmt: skip
        n = sum(len(d.queue) for d in runner.datasets.values())
        w1, c1 = time.perf_counter(), time.process_time()
        runner.store.close()
        w0, c0 = w0 + time.perf_counter() - w1, c0 + time.process_time() - c1  # close not timed
    rss = _peak_mb()
    doc = {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "rss_mb": rss, "n": n}
    print(json.dumps(doc))


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM): ru_maxrss would also count the parent's RSS at the
    fork (Linux keeps the larger across exec), and the parent built the run dir."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_step(step: str, run_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--step", step, "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode:
        raise SystemExit(f"{step} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--workdir", default="/tmp/scale_restart")
    p.add_argument(
        "--tokenizer", default=None, help="a local tokenizer: the restart runs the guard"
    )
    p.add_argument("--steps", nargs="+", default=STEPS, choices=STEPS)
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step:
        return child(args.step, args.run_dir)
    tag = f"n{args.records}" + ("_tok" if args.tokenizer else "")
    run_dir, marker = Path(args.workdir) / tag, Path(args.workdir) / f"{tag}.done"
    if not marker.exists():
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        build(run_dir, args.records, args.tokenizer)
        marker.write_text("")
        print(f"built {run_dir} in {time.perf_counter() - t0:.0f} s", flush=True)
    if "restart" in args.steps:
        run_step("restart", run_dir)  # untimed: fills guard.json (a first start renders once)
    size = sum(f.stat().st_size for f in (run_dir / "records").iterdir())
    print(f"{args.records:,} records, records files {size / 1e6:,.0f} MB; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"{'step':<14}{'wall s':>8}{'cpu s':>8}{'peak MB':>9}{'result':>10}")
    for step in args.steps:
        d = run_step(step, run_dir)
        print(f"{step:<14}{d['wall']:>8.2f}{d['cpu']:>8.2f}{d['rss_mb']:>9,.0f}{d['n']:>10,}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
