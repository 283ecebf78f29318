"""Restart and watch at scale on the run database: kit's reads against plain sqlite3 loops.

    python bench/bench_scale_restart.py [--records 1000000] [--workdir /tmp/scale_restart]
                                        [--tokenizer data/models/SmolLM2-135M-Instruct]

Builds (once; reused while its marker exists) a run database of --records records written
with RunStore (8 datasets, 25% more prompts than records, completions of a few words,
flush_every 20,000). Then each step runs in a fresh interpreter and prints its wall time,
CPU time, the process's peak RSS and, for kit's steps, the ratio to its plain baseline
(each baseline runs first):
  done            kit.run.reader.done_frame: the stored keys and counts a restart reads
  plain_done      the same columns by a plain sqlite3 loop into a Python list
  prompts         kit.run.reader.prompts_frame(text=False): the prompt keys a restart reads
  plain_prompts   the same columns (dataset, prompt_id) by a plain sqlite3 loop
  watch           kit.run.progress.progress, first read, nothing writing
  watch_writing   the same while a writer process commits records (every 256 or 1 s)
  plain_watch     the totals table by a plain sqlite3 query (what watch needs at least)
  restart         kit.run.runner.Runner.create(None, config): read the stored prompts, check
                  the fingerprint, read the done keys, guard (with --tokenizer; its cache in
                  run.sqlite filled by a first, untimed, restart), queues: everything before
                  the first request (the store's close is not timed)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = [
    "plain_done",
    "done",
    "plain_prompts",
    "prompts",
    "plain_watch",
    "watch",
    "watch_writing",
    "restart",
]
BASELINE = {
    "done": "plain_done",
    "prompts": "plain_prompts",
    "watch": "plain_watch",
    "watch_writing": "plain_watch",
}
NAMES = [f"ds{i}" for i in range(8)]


def _msgs(ds: str, i: int) -> list[dict]:
    return [{"role": "user", "content": f"{ds} question {i}: answer in a few words"}]


def build(run_dir: Path, n: int, tokenizer: str | None) -> None:
    """n records over 8 datasets (25% more prompts), written with RunStore and closed."""
    import random

    import polars as pl

    from kit.data.sources import source_hashes
    from kit.run.store import RunStore
    from kit.tokens import chat_template_hash
    from kit.types import Record, RunConfig, Sampling

    rng = random.Random(0)
    per = n // len(NAMES)
    spare = int(per * 1.25)
    ids = {ds: [f"{rng.getrandbits(64):016x}" for _ in range(spare)] for ds in NAMES}
    frame = pl.DataFrame(
        {
            "dataset": [ds for ds in NAMES for _ in range(spare)],
            "prompt_id": [p for ds in NAMES for p in ids[ds]],
            "messages": [_msgs(ds, i) for ds in NAMES for i in range(spare)],
            "n_turns": [1] * (spare * len(NAMES)),
            "row": [i for _ in NAMES for i in range(spare)],
        }
    )
    extra = {"tokenizer": tokenizer, "max_context": 8192} if tokenizer else {}
    config = RunConfig(
        model="fake",
        endpoints="http://127.0.0.1:9/v1",
        budgets=dict.fromkeys(NAMES, 10**9),
        sampling=Sampling(max_tokens=64),
        source_hashes=source_hashes(frame),
        chat_template_hash=chat_template_hash(tokenizer) if tokenizer else None,
        **extra,
    )
    store = RunStore(run_dir, flush_every=20_000, flush_interval=1e9)
    store.init(config, frame)
    t0 = time.time() - n
    for k in range(per * len(NAMES)):
        ds, i = NAMES[k % len(NAMES)], k // len(NAMES)
        tokens = 5 + (i * 7919) % 60
        store.append(
            Record(
                dataset=ds,
                prompt_id=ids[ds][i],
                sample=0,
                messages=_msgs(ds, i),
                completion="ok " * 4,
                finish_reason="length" if tokens >= 60 else "stop",
                completion_tokens=tokens,
                count_source="usage",
                prompt_tokens=20,
                endpoint="http://127.0.0.1:9/v1",
                latency_s=0.5,
                t_done=t0 + k,
            )
        )
    store.close()


def child(step: str, run_dir: str) -> None:
    """One step in this fresh process; prints a JSON line."""
    import polars  # noqa: F401 - imported before the timing

    from kit.run.progress import progress
    from kit.run.reader import done_frame, open_db, prompts_frame, read_config
    from kit.run.runner import Runner

    plain = f"file:{Path(run_dir) / 'run.sqlite'}?mode=ro"
    w0, c0 = time.perf_counter(), time.process_time()
    if step == "done":
        with open_db(run_dir) as conn:
            n = done_frame(conn).height
    elif step == "plain_done":
        conn = sqlite3.connect(plain, uri=True)
        n = len(
            conn.execute(
                "SELECT dataset, prompt_id, sample, completion_tokens, finish_reason FROM records"
            ).fetchall()
        )
    elif step == "prompts":
        n = prompts_frame(run_dir, text=False).height
    elif step == "plain_prompts":
        conn = sqlite3.connect(plain, uri=True)
        n = len(conn.execute("SELECT dataset, prompt_id FROM prompts").fetchall())
    elif step.startswith("watch"):
        n = sum(p.samples_done for p in progress(run_dir))
    elif step == "plain_watch":
        conn = sqlite3.connect(plain, uri=True)
        n = sum(s for (s,) in conn.execute("SELECT samples FROM totals"))
    else:
        runner = Runner.create(
            None, read_config(run_dir), run_dir=run_dir, force=False, expected_tokens=None
        )
        n = sum(len(d.queue) for d in runner.datasets.values())
        w1, c1 = time.perf_counter(), time.process_time()
        runner.store.close()
        w0, c0 = w0 + time.perf_counter() - w1, c0 + time.process_time() - c1  # close not timed
    doc = {
        "wall": time.perf_counter() - w0,
        "cpu": time.process_time() - c0,
        "rss_mb": _peak_mb(),
        "n": n,
    }
    print(json.dumps(doc))


def writer(run_dir: str, ready: str) -> None:
    """Commit records (sample 1 of stored keys) ~1,000/s until SIGTERM; `ready` after 512."""
    from kit.run.reader import read_config
    from kit.run.store import RunStore
    from kit.types import Record

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    store = RunStore(run_dir, flush_every=256, flush_interval=1.0)
    store.init(read_config(run_dir))
    keys = store.conn.execute("SELECT dataset, prompt_id FROM records LIMIT 100000").fetchall()
    k = 0
    while not stop and k < len(keys):
        for ds, pid in keys[k : k + 100]:
            store.append(
                Record(
                    dataset=ds,
                    prompt_id=pid,
                    sample=1,
                    messages=[],
                    completion="ok",
                    finish_reason="stop",
                    completion_tokens=1,
                    count_source="usage",
                    endpoint="http://127.0.0.1:9/v1",
                    latency_s=0.1,
                    t_done=time.time(),
                )
            )
        k += 100
        if k >= 512 and not Path(ready).exists():
            Path(ready).write_text(str(k))
        time.sleep(0.1)
    store.close()


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM): ru_maxrss would also count the parent's RSS at the
    fork (Linux keeps the larger across exec), and the parent built the run dir."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_step(step: str, run_dir: Path) -> dict:
    bg = _start_writer(run_dir) if step == "watch_writing" else None
    cmd = [sys.executable, __file__, "--step", step, "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if bg is not None:
        bg.send_signal(signal.SIGTERM)
        bg.wait(60)
        _drop_written(run_dir)
    if out.returncode:
        raise SystemExit(f"{step} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _start_writer(run_dir: Path) -> subprocess.Popen:
    ready = run_dir.parent / "writer_ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--writer", str(ready), "--run-dir", str(run_dir)], cwd=ROOT
    )
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit("the writer did not start")
        time.sleep(0.05)
    return proc


def _drop_written(run_dir: Path) -> None:
    """Remove what the writer added (sample 1 records) and take their counts off the totals."""
    conn = sqlite3.connect(run_dir / "run.sqlite", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    added = conn.execute(
        "SELECT dataset, count(*), sum(completion_tokens), sum(finish_reason = 'length') FROM records WHERE sample = 1 GROUP BY dataset"
    ).fetchall()
    for ds, s, t, x in added:
        conn.execute(
            "UPDATE totals SET samples = samples - ?, tokens = tokens - ?, truncated = truncated - ? WHERE dataset = ?",
            (s, t, x, ds),
        )
    conn.execute("DELETE FROM records WHERE sample = 1")
    conn.execute("COMMIT")
    conn.close()


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
    p.add_argument("--writer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.writer:
        return writer(args.run_dir, args.writer)
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
        run_step("restart", run_dir)  # untimed: fills the guard cache (a first start renders once)
    size = sum(f.stat().st_size for f in run_dir.glob("run.sqlite*"))
    print(
        f"{args.records:,} records, run.sqlite {size / 1e6:,.0f} MB; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'step':<14}{'wall s':>8}{'cpu s':>8}{'peak MB':>9}{'result':>10}{'x plain':>9}")
    got: dict[str, dict] = {}
    for step in args.steps:
        d = got[step] = run_step(step, run_dir)
        base = got.get(BASELINE.get(step, ""))
        ratio = f"{d['wall'] / base['wall']:>9.2f}" if base else f"{'-':>9}"
        print(
            f"{step:<14}{d['wall']:>8.2f}{d['cpu']:>8.2f}{d['rss_mb']:>9,.0f}{d['n']:>10,}{ratio}",
            flush=True,
        )


if __name__ == "__main__":
    main()
