"""The full-size run and the scale table: budgets at 92M tokens, run-dir readers at 1M records.

Part A (the simulated full-size run): kit.generate over 8 synthetic datasets (bench/fleet.py:
lognormal completion lengths with long tails, medians 150 to 1500 tokens, max_tokens 4096)
against 4 fake OpenAI-compatible endpoints, each its own process, concurrency 256, a budget
of --budget-millions tokens per dataset (11.5: 92M in all) and more prompts than the budgets
need. Prints per dataset: budget, tokens, overshoot, records, and whether the count landed
in [budget, budget + max(1%, max_tokens)]; whether records were lost or duplicated (each
answer the endpoints gave is exactly one record line, the lines' keys are unique and their
counts are the runner's); wall time, records/s; bytes per record of the records files and
"before": the same records with their prompt's messages and tools in each line.

Part B (the scale table): for each of --sizes records, a run directory written directly
(RunStore.init + RunStore.append, the same datasets, lengths and texts as part A, one sample
per prompt, 5% more prompts than records; kept under --workdir and reused while complete,
put back as written before each use), then each step in a fresh interpreter, measuring the
wall time of the call and the peak RSS of the process (its VmHWM, see measure()):
restart to first request (kit.generate(None, ...) with budgets 2000 tokens higher: from the
call to the first request at a fake endpoint), watch's first read (progress()), audit,
export specforge, export token_ids, validate of each export, and a plain baseline of each
export (orjson read + json.dumps write, no kit; the token_ids one renders the chat template
and tokenizes with the same tokenizer), and a write floor for the specforge export (as many
bytes as it wrote, written from one buffer as kit writes them, synced and dropped from the
page cache every 64 MB, and written plainly: the ceiling this machine's page cache and disk
put on any exporter; this VM's memory is slow to touch fresh past a few GB, so plain writes
move between runs and the ratio to the floor is the figure to read). A step over --rss-limit-gb or --step-timeout is
killed (its row says so, with the highest RSS sampled). Every measurement is kept in
workdir/results.json; --table-only prints the table again from it.

    python bench/bench_scale.py --quick                       # both parts, small (minutes)
    python bench/bench_scale.py --part a                      # 92M tokens
    python bench/bench_scale.py --part b --sizes 40000 200000 1000000
    nohup python bench/bench_scale.py --part b > /tmp/scale/b.txt 2>&1 &

Goals (issue 13): every step under 1.5 GB peak RSS at 1M records; restart under 10 s and
audit under 60 s at 1M; specforge export >= 20K records/s; memory flat from 40K to 1M (here:
peak RSS at the largest size <= 1.5x the smallest). Data go under --workdir (/tmp/scale).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fleet  # noqa: E402

MODEL = "SmolLM2-135M-Instruct (fake fleet)"
SPARE = 1.05  # part B: prompts per record (spare prompts give a restart work to do)
STEPS = ["watch", "audit", "restart", "export_specforge", "floor_specforge", "validate_specforge",
         "plain_specforge", "export_token_ids", "validate_token_ids", "plain_token_ids"]  # fmt: skip
LABELS = {"imports": "imports only (no call)", "watch": "watch first read", "audit": "audit",
          "restart": "restart to 1st request", "export_specforge": "export specforge",
          "validate_specforge": "validate specforge", "plain_specforge": "plain specforge",
          "floor_specforge": "write floor (baseline)",
          "export_token_ids": "export token_ids", "validate_token_ids": "validate token_ids",
          "plain_token_ids": "plain token_ids"}  # fmt: skip


def prompt_frame(counts: dict[str, int]):
    """The prompt frame (kit.types columns + tools) of counts[dataset] prompts per dataset."""
    import polars as pl

    from kit.data.sources import MESSAGE_TYPE, prompt_id

    parts = []
    for ds, n in counts.items():
        msgs, tools = zip(*(fleet.prompt(ds, i) for i in range(n)), strict=True)
        parts.append(pl.DataFrame(
            {"dataset": [ds] * n, "prompt_id": [prompt_id(m, t) for m, t in zip(msgs, tools, strict=True)],
             "messages": list(msgs), "n_turns": [len(m) for m in msgs], "row": list(range(n)),
             "tools": list(tools)},
            schema_overrides={"messages": MESSAGE_TYPE, "tools": pl.String, "row": pl.Int64}))  # fmt: skip
    return pl.concat(parts)


def lines(path: Path):
    """Complete lines of a file, read in 8 MB pieces (a torn tail is never read)."""
    rest = b""
    with open(path, "rb") as f:
        while data := f.read(8 << 20):
            data = rest + data
            end = data.rfind(b"\n")
            rest = data[end + 1 :]
            if end >= 0:
                yield from (x for x in data[:end].split(b"\n") if x)


def old_line(row: dict, messages: list, tools) -> bytes:
    """A record line as it was before issue 13: every Record field, messages and tools too."""
    from kit.run.lines import HEAD_FIELDS, RECORD_FIELDS

    row = dict(row, messages=row.get("messages", messages), tools=row.get("tools", tools))
    order = HEAD_FIELDS + [f for f in RECORD_FIELDS if f not in HEAD_FIELDS]
    return orjson.dumps({f: row.get(f) for f in order}) + b"\n"


# ---------------------------------------------------------------- part A


def part_a(args) -> None:
    from kit.run.generate import generate
    from kit.types import RunConfig, Sampling

    budget = int(args.budget_millions * 1e6)
    counts = {d: math.ceil(budget / fleet.mean_length(d) * 1.3) + 50 for d in fleet.DATASETS}
    print(f"== part A: {len(counts)} datasets x {budget:,} tokens, {sum(counts.values()):,} "
          f"prompts, {args.endpoints} fake endpoints, concurrency {args.concurrency}", flush=True)  # fmt: skip
    frame = prompt_frame(counts)
    run_dir = Path(args.workdir) / "full_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    with fleet.Fleet(args.endpoints, args.latency_ms) as endpoints:
        config = RunConfig(model=MODEL, endpoints=endpoints.urls, budgets=budget,
                           sampling=Sampling(max_tokens=fleet.MAX_TOKENS), concurrency=args.concurrency)  # fmt: skip
        t0 = time.perf_counter()
        run = asyncio.run(generate(frame, config, run_dir=run_dir))
        wall = time.perf_counter() - t0
        rss_run = _status_kb("self", "VmHWM:") / 1024  # prompt frame + the runner, not the checks
        answered = endpoints.answered()
    summary = {r["dataset"]: r for r in run.summary().to_dicts()}
    index = {(ds, pid): (row, m, t) for ds, pid, row, m, t in frame.select(
        "dataset", "prompt_id", "row", "messages", "tools").iter_rows()}  # fmt: skip
    del frame
    seen, found, sample = set(), {}, []
    size = before = 0
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        for line in lines(path):
            row = orjson.loads(line)
            ds, pid = row["dataset"], row["prompt_id"]
            seen.add((ds, pid, row["sample"]))
            got = found.setdefault(ds, {"records": 0, "tokens": 0, "rows": []})
            got["records"] += 1
            got["tokens"] += row["completion_tokens"]
            prow, messages, tools = index.get((ds, pid), (None, [], None))
            got["rows"].append(prow)
            if len(sample) < 1000 and len(seen) % 97 == 0:
                sample.append((row["completion"], row["completion_tokens"]))
            size += len(line) + 1
            before += len(old_line(row, messages, json.loads(tools) if tools else None))
    n = sum(g["records"] for g in found.values())
    print(f"{'dataset':<12}{'budget':>12}{'tokens':>12}{'over %':>8}{'records':>9}  within max(1%, max_tokens)")  # fmt: skip
    ok_all = True
    for ds in fleet.DATASETS:
        s, g = summary[ds], found.get(ds, {"records": 0, "tokens": 0, "rows": []})
        slack = max(0.01 * s["budget"], fleet.MAX_TOKENS)
        within = s["budget"] <= g["tokens"] <= s["budget"] + slack
        ok_all &= within
        print(f"{ds:<12}{s['budget']:>12,}{g['tokens']:>12,}{100 * (g['tokens'] / s['budget'] - 1):>8.2f}"
              f"{g['records']:>9,}  {'yes' if within else 'NO'} ({s['state']})")  # fmt: skip
    checks = {
        "record keys unique (lines == keys)": n == len(seen),
        "every line's prompt is in prompts": all(None not in g["rows"] for g in found.values()),
        "records and tokens == the runner's counts": all(
            found.get(ds, {}).get("records") == summary[ds]["samples_done"]
            and found.get(ds, {}).get("tokens") == summary[ds]["tokens_done"] for ds in summary),
        "each endpoint answer is one record (none lost, none twice)": all(
            sorted(answered.get(ds, [])) == sorted(g["rows"]) for ds, g in found.items())
            and sum(map(len, answered.values())) == n,
        f"completion_tokens == SmolLM2 re-tokenized count ({len(sample)} records)": _retokenized(sample),
    }  # fmt: skip
    for name, ok in checks.items():
        print(f"  {name}: {'PASS' if ok else 'FAIL'}")
    tokens = sum(g["tokens"] for g in found.values())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"run: {wall:.1f} s wall, {n:,} records, {n / wall:,.0f} records/s, {tokens / wall:,.0f} "
          f"tokens/s; stop_reason {run.stop_reason}; bench process peak RSS {rss_run:,.0f} MB at the "
          f"run's end (prompt frame + runner), {rss:,.0f} MB after the checks")  # fmt: skip
    print(f"records files: {size / 1e6:,.1f} MB, {size / max(n, 1):,.0f} bytes/record; before "
          f"(lines with messages and tools): {before / max(n, 1):,.0f} bytes/record "
          f"({before / max(size, 1):.2f}x)")  # fmt: skip
    print(f"budgets: {'all within' if ok_all else 'SOME OUTSIDE'} [budget, budget + max(1%, {fleet.MAX_TOKENS})]\n", flush=True)  # fmt: skip


def _retokenized(sample: list[tuple[str, int]]) -> bool:
    """Whether each completion text re-tokenizes (SmolLM2) to its completion_tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fleet.TOKENIZER / "tokenizer.json"))
    got = tok.encode_batch([text for text, _ in sample], add_special_tokens=False)
    return all(len(e.ids) == n for e, (_, n) in zip(got, sample, strict=True))


# ---------------------------------------------------------------- part B: the run dirs


def record_counts(n: int) -> dict[str, int]:
    """Records per dataset for n in all, in part A's mix (equal budgets: counts ~ 1/mean)."""
    w = {d: 1 / fleet.mean_length(d) for d in fleet.DATASETS}
    out = {d: int(n * v / sum(w.values())) for d, v in w.items()}
    out[next(iter(out))] += n - sum(out.values())
    return out


def synthesize(run_dir: Path, n: int) -> dict:
    """Write a run dir of n records (RunStore.init + append) and return its marker doc."""
    import random

    from kit.data.sources import source_hashes
    from kit.run.store import RunStore
    from kit.types import Record, RunConfig, Sampling

    t0 = time.perf_counter()
    shutil.rmtree(run_dir, ignore_errors=True)
    counts = record_counts(n)
    frame = prompt_frame({d: math.ceil(c * SPARE) + 10 for d, c in counts.items()})
    order = [(d, i) for d, c in counts.items() for i in range(c)]
    random.Random(n).shuffle(order)
    ids = dict(
        zip(zip(frame["dataset"], frame["row"], strict=True), frame["prompt_id"], strict=True)
    )
    tokens = dict.fromkeys(counts, 0)
    for d, i in order:
        tokens[d] += fleet.completion(fleet.prompt(d, i)[0], None, fleet.MAX_TOKENS)[1]
    config = RunConfig(model=MODEL, endpoints=["http://127.0.0.1:9/v1"], budgets=tokens,
                       sampling=Sampling(max_tokens=fleet.MAX_TOKENS), concurrency=256,
                       source_hashes=source_hashes(frame))  # fmt: skip
    store = RunStore(run_dir, flush_every=20_000, flush_interval=1e9)
    store.init(config, frame)
    del frame
    t_done = time.time() - 86_400
    for k, (d, i) in enumerate(order):
        messages, tools = fleet.prompt(d, i)
        text, tok, finish = fleet.completion(messages, None, fleet.MAX_TOKENS)
        store.append(Record(
            dataset=d, prompt_id=ids[(d, i)], sample=0, messages=messages, completion=text,
            finish_reason=finish, completion_tokens=tok, count_source="usage",
            prompt_tokens=sum(len(m["content"].split()) + 4 for m in messages),
            endpoint=f"http://127.0.0.1:{8001 + k % 4}/v1", latency_s=round(0.02 + tok / 400, 4),
            t_done=round(t_done + k * 0.004, 3), tools=json.loads(tools) if tools else None))  # fmt: skip
    store.close()
    files = {str(p.relative_to(run_dir)): p.stat().st_size for p in (run_dir / "records").iterdir()}
    disk = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    return {"records": n, "files": files, "config": (run_dir / "config.json").read_text(),
            "disk_bytes": disk, "synth_s": time.perf_counter() - t0}  # fmt: skip


def _small_files(run_dir: Path) -> list[str]:
    """Every file of a run dir but the records files and prompts.parquet (config, index...)."""
    big = {"prompts.parquet"}
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()
                  and str(p.relative_to(run_dir)) not in big and p.parent != run_dir / "records")  # fmt: skip


def snapshot(run_dir: Path, snap: Path, meta: dict) -> None:
    """Keep a copy of the run dir's small files (config.json, the resume index ...)."""
    shutil.rmtree(snap, ignore_errors=True)
    meta["small_files"] = _small_files(run_dir)
    for rel in meta["small_files"]:
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(run_dir / rel, snap / rel)


def restore(run_dir: Path, meta: dict, snap: Path) -> None:
    """Put a run dir back as written: a restart appended records and rewrote config.json
    and the resume index. Records files are cut back to their sizes, files added since are
    removed, the small files copied back from the snapshot. A snapshot that is missing
    (an older marker) is made again: config.json from the marker, the index rewritten by a
    RunStore's clean close, as after the writing."""
    for p in (run_dir / "records").iterdir():
        rel = str(p.relative_to(run_dir))
        if rel not in meta["files"]:
            p.unlink()
        elif p.stat().st_size != meta["files"][rel]:
            os.truncate(p, meta["files"][rel])
    if snap.exists() and "small_files" in meta:
        keep = set(meta["small_files"])
        for rel in _small_files(run_dir):
            if rel not in keep:
                (run_dir / rel).unlink()
        for rel in keep:
            shutil.copy2(snap / rel, run_dir / rel)
        return
    from kit.run.store import RunStore, read_config

    (run_dir / "config.json").write_text(meta["config"])
    for name in ("status.json", "errors.jsonl", "skipped.jsonl", "repair.log"):
        (run_dir / name).unlink(missing_ok=True)
    store = RunStore(run_dir)
    store.init(read_config(run_dir))
    store.scan()
    store.close()
    snapshot(run_dir, snap, meta)


def run_dir_for(workdir: Path, n: int) -> tuple[Path, dict, Path]:
    """(run dir of n records, its marker doc, its snapshot): reused when its marker says
    complete (and put back as written), else written."""
    run_dir, marker = workdir / "runs" / f"n{n}", workdir / "runs" / f"n{n}.json"
    snap = workdir / "runs" / f"n{n}.snapshot"
    if marker.exists():
        meta = json.loads(marker.read_text())
        restore(run_dir, meta, snap)
        marker.write_text(json.dumps(meta))
        print(f"-- {n:,} records: reusing {run_dir} ({meta['disk_bytes'] / 1e9:.2f} GB)", flush=True)  # fmt: skip
        return run_dir, meta, snap
    print(f"-- {n:,} records: writing {run_dir} ...", flush=True)
    meta = synthesize(run_dir, n)
    snapshot(run_dir, snap, meta)
    marker.write_text(json.dumps(meta))
    print(f"   written in {meta['synth_s']:.0f} s, {meta['disk_bytes'] / 1e9:.2f} GB on disk "
          f"({meta['disk_bytes'] / n:,.0f} bytes/record incl. prompts.parquet)", flush=True)  # fmt: skip
    return run_dir, meta, snap


# ---------------------------------------------------------------- part B: the steps (child side)


def _plain_specforge(run_dir: Path, out: Path, tok=None) -> int:
    """The baseline: orjson read of the records files, json.dumps write; prompts joined from
    prompts.parquet one dataset at a time when the lines lack them. With tok: token-id rows
    (the chat template rendered and tokenized in batches) instead of conversations."""
    import polars as pl

    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        for path in sorted((run_dir / "records").glob("*.jsonl")):
            prompts, batch = None, []
            for line in lines(path):
                r = orjson.loads(line)
                if "messages" not in r:
                    if prompts is None:
                        part = pl.scan_parquet(run_dir / "prompts.parquet").filter(
                            pl.col("dataset") == r["dataset"]).select("prompt_id", "messages", "tools").collect()  # fmt: skip
                        prompts = {p: (m, t) for p, m, t in part.iter_rows()}
                    r["messages"], tools = prompts[r["prompt_id"]]
                    r["tools"] = json.loads(tools) if tools else None
                batch.append(r)
                if len(batch) == 1000:
                    n += _plain_write(f, batch, tok)
                    batch = []
            n += _plain_write(f, batch, tok)
    return n


def _write_floor(export_dir: Path, out: Path) -> dict:
    """The other baseline: write as many bytes as the export wrote (its files, in 16 MB
    pieces of one random buffer), nothing else: what writing its output alone costs on this
    machine's page cache and disk, with no reading, parsing or rendering. Written twice:
    as kit's JSONL sinks write (kit.report.writers.WriteBehind: synced and dropped from the
    page cache every 64 MB; "seconds", the floor), and plainly ("plain_seconds": write(2)
    alone, the page cache filling with the whole file)."""
    from kit.report.writers import WriteBehind

    size = sum(p.stat().st_size for p in export_dir.rglob("*") if p.is_file())
    out.mkdir(parents=True, exist_ok=True)
    piece = os.urandom(16 << 20)
    took = {}
    for how in ("plain", "behind"):
        t0 = time.perf_counter()
        with open(out / f"floor-{how}.bin", "wb") as f:
            behind = WriteBehind(f) if how == "behind" else None
            for at in range(0, size, len(piece)):
                n = f.write(piece[: min(len(piece), size - at)])
                if behind is not None:
                    behind.wrote(n)
            if behind is not None:
                behind.sync()
        took[how] = time.perf_counter() - t0
        (out / f"floor-{how}.bin").unlink()
    return {
        "seconds": took["behind"],
        "plain_seconds": took["plain"],
        "bytes": size,
        "records": None,
    }


def _plain_write(f, batch: list[dict], tok) -> int:
    rows = []
    for r in batch:
        conv = r["messages"] + [{"role": "assistant", "content": r["completion"]}]
        rows.append({"id": f"{r['dataset']}-{r['prompt_id']}-{r['sample']}", "conversations": conv}
                    | ({"tools": r["tools"]} if r.get("tools") else {}))  # fmt: skip
    if tok is not None:
        render = tok.apply_chat_template
        pre = [render(r["conversations"][:-1], tools=r.get("tools"), tokenize=False, add_generation_prompt=True) for r in rows]  # fmt: skip
        full = [render(r["conversations"], tools=r.get("tools"), tokenize=False) for r in rows]
        p_ids = tok(pre, add_special_tokens=False)["input_ids"] if rows else []
        f_ids = tok(full, add_special_tokens=False)["input_ids"] if rows else []
        rows = [{"id": r["id"], "input_ids": ids, "loss_mask": [0] * len(p) + [1] * (len(ids) - len(p)),
                 "ids_source": "retokenized"} for r, p, ids in zip(rows, p_ids, f_ids, strict=True)]  # fmt: skip
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return len(rows)


def child(args) -> None:
    """Run one step in this (fresh) process; write {"seconds", ...} to args.result."""
    import polars  # noqa: F401 - imported before the timing, like every step's modules

    import kit
    import kit.report.audit  # noqa: F401
    import kit.report.export  # noqa: F401
    import kit.run.generate  # noqa: F401
    from kit.run.progress import progress

    run_dir, out, step, info = Path(args.run_dir), Path(args.out), args.step, {}
    t0 = time.perf_counter()
    if step == "imports":
        pass  # the modules above, nothing called: the floor every step's RSS stands on
    elif step == "watch":
        info["records"] = sum(p.samples_done for p in progress(run_dir))
    elif step == "audit":
        report = kit.audit(run_dir)
        report.summary()
        info |= {
            "records": int(report.datasets["records"].sum()),
            "findings": report.findings.height,
        }
    elif step == "restart":
        info |= _restart(run_dir, args)
    elif step.startswith("export_"):
        fmt = step.removeprefix("export_")
        tok = str(fleet.TOKENIZER) if fmt == "token_ids" else None
        result = kit.export(run_dir, out, formats=(fmt,), tokenizer=tok)
        info["records"] = sum(c.get("records", 0) for c in result.counts.values())
    elif step.startswith("validate_"):
        v = kit.validate(out)
        info |= {"ok": v.ok, "problems": v.problems[:3]}
    elif step == "floor_specforge":
        info |= _write_floor(out.parent / "specforge", out)
    elif step.startswith("plain_"):
        tok = None
        if step == "plain_token_ids":
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(fleet.TOKENIZER)
            t0 = time.perf_counter()  # the tokenizer load is not the baseline's work
        info["records"] = _plain_specforge(run_dir, out, tok)
    info["seconds"] = info.get("seconds", 0.0 if step == "imports" else time.perf_counter() - t0)
    info["hwm_mb"] = _status_kb("self", "VmHWM:") / 1024  # this interpreter's own peak
    Path(args.result).write_text(json.dumps(info))


def _restart(run_dir: Path, args) -> dict:
    """kit.generate(None, ...) on the run dir, budgets + 2000 tokens each; seconds = from the
    call to the first request at the endpoint (which records its time)."""
    import urllib.request
    from dataclasses import replace

    import kit
    from kit.run.store import read_config

    root = args.url.removesuffix("/v1")
    urllib.request.urlopen(urllib.request.Request(root + "/reset", data=b"{}"), timeout=10).read()  # noqa: S310
    config = read_config(run_dir)
    config = replace(config, endpoints=[args.url],
                     budgets={d: b + 2000 for d, b in config.budgets.items()})  # fmt: skip
    t_call = time.time()
    run = kit.generate_sync(None, config, run_dir=run_dir)
    total = time.time() - t_call
    stats = orjson.loads(urllib.request.urlopen(root + "/stats", timeout=10).read())  # noqa: S310
    first = stats["first_t"]
    return {"seconds": None if first is None else first - t_call, "total_s": total,
            "from_exec_s": None if first is None else first - args.spawn_t,
            "new_records": int(run.summary()["samples_done"].sum()), "stop": run.stop_reason}  # fmt: skip


# ---------------------------------------------------------------- part B: measuring (parent side)


def _status_kb(pid, field: str = "VmRSS:") -> int:
    """A /proc/<pid>/status field in kB (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(step: str, run_dir: Path, out: Path, args, url: str) -> dict:
    """Run one step in a fresh interpreter: its result, peak RSS and whether it was killed
    (over --rss-limit-gb or --step-timeout).

    Peak RSS is the child's own VmHWM at its end, or the highest VmRSS sampled every 0.1 s
    when it was killed. Not os.wait4's ru_maxrss: Python starts the child with vfork, so
    that figure is at least the parent's peak (this bench's, after writing a run dir)."""
    result = Path(args.workdir) / "step_result.json"
    result.unlink(missing_ok=True)
    os.sync()  # the last step's writes go to disk first: they would throttle this one's
    log = open(Path(args.workdir) / f"step_{step}.log", "w")  # noqa: SIM115
    t_spawn = time.time()
    cmd = [sys.executable, __file__, "--step", step, "--run-dir", str(run_dir), "--out", str(out),
           "--result", str(result), "--url", url, "--spawn-t", repr(t_spawn)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    killed: list[str] = []
    sampled = [0]

    def watchdog() -> None:
        limit_kb = args.rss_limit_gb * (1 << 20)
        while proc.returncode is None and not killed:
            rss = _status_kb(proc.pid)
            sampled[0] = max(sampled[0], rss)
            if rss > limit_kb or time.time() - t_spawn > args.step_timeout:
                killed.append("rss" if rss > limit_kb else "timeout")
                os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.1)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    _, status = os.waitpid(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    thread.join()
    log.close()
    doc = json.loads(result.read_text()) if result.exists() and not killed else {}
    peak = max(doc.get("hwm_mb", 0), sampled[0] / 1024)
    doc |= {"rss_mb": peak, "wall_s": time.time() - t_spawn}
    if killed:
        why = f"over {args.rss_limit_gb:g} GB RSS" if killed[0] == "rss" else "timeout"
        doc["error"] = f"killed ({why})"
    elif proc.returncode or "seconds" not in doc:
        tail = (Path(args.workdir) / f"step_{step}.log").read_text().strip().splitlines()[-1:]
        doc["error"] = f"exit {proc.returncode}: {tail[0][:150] if tail else ''}"
    return doc


def part_b(args) -> None:
    workdir = Path(args.workdir)
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    steps = [s for s in STEPS if s in args.steps]
    print(f"== part B: sizes {args.sizes}, steps each in a fresh interpreter", flush=True)
    results: dict[str, dict[int, dict]] = {}
    with fleet.Fleet(1, 0.0) as endpoint:
        first = True
        for n in args.sizes:
            run_dir, meta, snap = run_dir_for(workdir, n)
            if first:
                doc = measure("imports", run_dir, workdir, args, endpoint.urls[0])
                results["imports"] = {n: doc}
                _save(workdir, "imports", n, doc)
                print(f"   {LABELS['imports']:<24}{'':>10}  {_cells(doc, n)}", flush=True)
                first = False
            for step in steps:
                fmt = step.partition("_")[2]
                out = (
                    workdir
                    / "exports"
                    / f"n{n}"
                    / (
                        (
                            "plain_"
                            if step.startswith("plain")
                            else "floor_"
                            if step.startswith("floor")
                            else ""
                        )
                        + fmt
                    )
                )
                if step.startswith(("export", "plain", "floor")):
                    shutil.rmtree(out, ignore_errors=True)
                doc = measure(step, run_dir, out, args, endpoint.urls[0])
                results.setdefault(step, {})[n] = doc
                _save(workdir, step, n, doc)
                if step == "restart":
                    restore(run_dir, meta, snap)
                if step.startswith(("validate", "plain", "floor")) and not args.keep_exports:
                    shutil.rmtree(out, ignore_errors=True)
                print(f"   {LABELS[step]:<24}{n:>10,}  {_cells(doc, n)}", flush=True)
            print(f"   run dir on disk: {meta['disk_bytes'] / 1e9:.2f} GB; load average "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)  # fmt: skip
    print_table(results, args.sizes)


def _save(workdir: Path, step: str, n: int, doc: dict) -> None:
    """Keep every measurement in workdir/results.json (--table-only prints them again)."""
    path = workdir / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved.setdefault(step, {})[str(n)] = doc | {"t": time.time()}
    path.write_text(json.dumps(saved, indent=1))


def table_only(args) -> None:
    """The table and goals of the measurements kept in workdir/results.json."""
    saved = json.loads((Path(args.workdir) / "results.json").read_text())
    results = {s: {int(n): d for n, d in by.items()} for s, by in saved.items()}
    results = {s: results[s] for s in ["imports", *STEPS] if s in results}
    sizes = [n for n in args.sizes if any(n in by for by in results.values())]
    if "imports" in results and not set(results["imports"]) & set(sizes):
        results["imports"] = {sizes[0]: next(iter(results["imports"].values()))}
    print_table(results, sizes)


def _cells(doc: dict, n: int) -> str:
    if doc.get("error"):
        return f"{doc['error']}  (peak {doc['rss_mb']:,.0f} MB)"
    s = doc["seconds"]
    if s == 0.0:
        return f"{'-':>10}{doc['rss_mb']:>10,.0f} MB (the floor under every step)"
    if s is None:
        return f"no request reached the endpoint (peak {doc['rss_mb']:,.0f} MB)"
    extra = ""
    if "total_s" in doc:
        extra = f"  [whole restart {doc['total_s']:.1f} s; from exec {doc['from_exec_s']:.1f} s; +{doc['new_records'] - n} records]"  # fmt: skip
    if "ok" in doc:
        extra = f"  [ok={doc['ok']}{'' if doc['ok'] else ' ' + '; '.join(doc['problems'])}]"
    return f"{s:>8.2f} s {doc['rss_mb']:>8,.0f} MB {n / max(s, 1e-9):>10,.0f} rec/s{extra}"


def print_table(results: dict, sizes: list[int]) -> None:
    sizes = sorted(sizes)
    print(f"\n{'step':<24}{'records':>10}{'seconds':>9}{'peak MB':>9}{'rec/s':>10}{'x time':>8}"
          f"{'x RSS':>7}  goals (RSS < 1500 MB; restart < 10 s; audit < 60 s; specforge >= 20K/s)")  # fmt: skip
    for step, by_size in results.items():
        prev = None
        for n in sizes:
            d = by_size.get(n)
            if d is None:
                continue
            if d.get("error") or d.get("seconds") is None:
                print(
                    f"{LABELS[step]:<24}{n:>10,}  {d.get('error', 'no request')} (peak {d['rss_mb']:,.0f} MB)"
                )
                prev = None
                continue
            s, mb = d["seconds"], d["rss_mb"]
            if step == "imports":
                print(f"{LABELS[step]:<24}{'-':>10}{'-':>9}{mb:>9,.0f}")
                continue
            grow = f"{s / prev[0]:>8.2f}{mb / prev[1]:>7.2f}" if prev else f"{'-':>8}{'-':>7}"
            cells = (
                f"{LABELS[step]:<24}{n:>10,}{s:>9.2f}{mb:>9,.0f}{n / max(s, 1e-9):>10,.0f}{grow}"
            )
            print(cells + "  " + _goal_cell(step, s, mb, n))
            prev = (s, mb)
    print_goals(results, sizes)


def _goal_cell(step: str, s: float, mb: float, n: int) -> str:
    """The goals that apply to one measured step, each PASS/FAIL ("" for the baselines)."""
    if step.startswith(("plain", "floor")):
        return "(baseline)"
    out = [f"RSS {'PASS' if mb < 1500 else 'FAIL'}"]
    limit = {"restart": 10, "audit": 60}.get(step)
    if limit:
        out.append(f"< {limit} s {'PASS' if s < limit else 'FAIL'}")
    if step == "export_specforge":
        out.append(f">= 20K/s {'PASS' if n / s >= 20_000 else 'FAIL'}")
    return "; ".join(out)


def _ok(d: dict | None) -> bool:
    return d is not None and not d.get("error") and d.get("seconds") is not None


def print_goals(results: dict, sizes: list[int]) -> None:
    big, small = max(sizes), min(sizes)
    at = "" if big == 1_000_000 else f" (measured at {big:,}; the goals are at 1,000,000)"
    print(f"\ngoals{at}:")
    kit_steps = [s for s in results if s in STEPS and not s.startswith(("plain", "floor"))]
    worst = {s: results[s].get(big, {}).get("rss_mb", 0) for s in kit_steps}
    over = {s: mb for s, mb in worst.items() if mb >= 1500 or not _ok(results[s].get(big))}
    print(
        f"  peak RSS < 1500 MB, every kit step: {'FAIL' if over else 'PASS'}"
        + "".join(f"; {LABELS[s]} {mb:,.0f} MB" for s, mb in over.items())
    )
    for step, limit, what in (("restart", 10, "restart < 10 s"), ("audit", 60, "audit < 60 s")):
        d = results.get(step, {}).get(big)
        if d is not None:
            ok = _ok(d) and d["seconds"] < limit
            shown = f"{d['seconds']:.1f} s" if _ok(d) else d.get("error", "no request")
            print(f"  {what}: {'PASS' if ok else 'FAIL'} ({shown})")
    d = results.get("export_specforge", {})
    if d:
        rates = {n: n / x["seconds"] for n, x in d.items() if _ok(x)}
        ok = len(rates) == len(d) and all(r >= 20_000 for r in rates.values())
        print(
            f"  export specforge >= 20,000 records/s: {'PASS' if ok else 'FAIL'} ("
            + ", ".join(f"{n:,}: {r:,.0f}/s" for n, r in rates.items())
            + ")"
        )
    if big != small:
        print(
            f"  memory flat {small:,} -> {big:,} (peak RSS growth <= 1.5x), and time growth "
            f"(x{big / small:.0f} records):"
        )
        for s in kit_steps:
            a, b = results[s].get(small), results[s].get(big)
            if _ok(a) and _ok(b):
                g = b["rss_mb"] / a["rss_mb"]
                print(f"    {LABELS[s]:<24} RSS x{g:.2f} {'PASS' if g <= 1.5 else 'FAIL'}; time x{b['seconds'] / a['seconds']:.1f}")  # fmt: skip
            else:
                print(f"    {LABELS[s]:<24} FAIL (a step did not finish)")
    print("  baseline (same run): kit export / plain json export of the same records:")
    for fmt in ("specforge", "token_ids"):
        for n in sizes:
            k, p = results.get(f"export_{fmt}", {}).get(n), results.get(f"plain_{fmt}", {}).get(n)
            if _ok(k) and _ok(p):
                print(f"    {fmt:<10}{n:>10,}: time x{k['seconds'] / p['seconds']:.2f}, peak RSS "
                      f"x{k['rss_mb'] / p['rss_mb']:.2f} ({k['rss_mb']:,.0f} vs {p['rss_mb']:,.0f} MB)")  # fmt: skip
    print("  the write floor (same run): writing the export's bytes alone, no kit:")
    for n in sizes:
        k, w = results.get("export_specforge", {}).get(n), results.get("floor_specforge", {}).get(n)
        if _ok(k) and _ok(w):
            rate = n / w["seconds"]
            plain = f"; written plainly {w['plain_seconds']:.1f} s" if "plain_seconds" in w else ""
            print(f"    specforge {n:>10,}: {w.get('bytes', 0) / 1e9:.2f} GB in {w['seconds']:.1f} s written as kit writes "
                  f"(a {rate:,.0f} records/s ceiling for any exporter here; kit export x{k['seconds'] / w['seconds']:.2f} of it){plain}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["a", "b", "both"], default="both")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small try: 0.2M tokens per dataset, sizes 2000 10000",
    )
    p.add_argument("--budget-millions", type=float, default=11.5, help="part A: tokens per dataset")
    p.add_argument("--sizes", type=int, nargs="+", default=[40_000, 200_000, 1_000_000])
    p.add_argument("--steps", nargs="+", default=STEPS, choices=STEPS)
    p.add_argument("--workdir", default="/tmp/scale")
    p.add_argument("--endpoints", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--rss-limit-gb", type=float, default=8.0, help="kill a step over this RSS")
    p.add_argument("--step-timeout", type=float, default=3600.0)
    p.add_argument("--keep-exports", action="store_true")
    p.add_argument("--table-only", action="store_true", help="print the kept part B results")
    for name in ("--step", "--run-dir", "--out", "--result", "--url"):  # a child's arguments
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--spawn-t", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        child(args)
        return
    if args.quick:
        args.budget_millions, args.sizes = 0.2, [2000, 10_000]
    if args.table_only:
        return table_only(args)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    problems = fleet.check_vocab()
    if problems:
        raise SystemExit(f"fleet.VOCAB is not one token per word for SmolLM2: {problems[:5]}")
    if args.part in ("a", "both"):
        part_a(args)
    if args.part in ("b", "both"):
        part_b(args)


if __name__ == "__main__":
    main()
