"""The full-size run and the scale table: budgets at 92M tokens, the run database at 1M records.

Part A (the simulated full-size run): kit.generate over 8 synthetic datasets (bench/fleet.py:
lognormal completion lengths with long tails, medians 150 to 1500 tokens, max_tokens 4096)
against 4 fake OpenAI-compatible endpoints, each its own process, concurrency 256, a budget
of --budget-millions tokens per dataset (11.5: 92M in all) and more prompts than the budgets
need. Prints per dataset: budget, tokens, overshoot, records, and whether the count landed
in [budget, budget + max(1%, max_tokens)]; whether records were lost or duplicated (each
answer the endpoints gave is exactly one record, keys unique, counts the runner's); wall
time, records/s, the generating process's peak RSS; run.sqlite's size against the JSONL
layout's for the same records (its record lines plus prompts.parquet).

Part B (the scale table): for each of --sizes records, a run database written directly
(RunStore.init + RunStore.append, flush_every 20,000: the same datasets, lengths and texts
as part A, one sample per prompt, 25% more prompts than records, so a restart has 0.25 x
records prompts unsent; each record carries the server's token ids: output_ids the
completion's words, one SmolLM2 token each; prompt_ids SmolLM2's ChatML template built from
the same pieces, checked equal to kit's rendering tokenized on 500 prompts), and the same prompts as JSONL files for kit.load. Its size
is set against the JSONL layout's for the same run (one orjson line per record with the
Record fields but messages/tools, as kit wrote them, plus prompts.parquet written as kit
wrote it; the lines are summed, not written: their bytes are the files'). The run is kept
under --workdir and reused while complete, put back as written after a step that wrote to it
(records past the build's last rowid deleted; totals, state and config restored).

Then each step in a fresh interpreter, measuring the wall time of the call and the process's
peak RSS (VmHWM, see measure()), with a plain baseline in the same run where there is one:
  load               kit.load of the prompt files (1.25 x records prompts) | plain_load: orjson
  load_gz            kit.load of the same files gzipped (.jsonl.gz, written once beside them)
  fresh              kit.load of the prompt files, then kit.generate(LoadResult) into a new run
                     directory (one request a dataset): seconds from the load's call to the first
                     request, the prompts stored a part at a time on the way; its peak RSS is a
                     fresh run's whole process
  watch              kit.run.progress.progress, first read, while a writer process commits
                     records into the run (RunStore, every 256 records or 1 s, status rows)
  audit              kit.audit(run_dir).summary()
  restart            kit.generate(None, ...) with unreachable budgets: seconds from the call to
                     the first request at a fake endpoint; it then sends every unsent prompt
                     (0.25 x records), so its peak RSS is the whole generating process's
  export_specforge   kit.export(formats=("specforge",)) | plain_specforge: the same records
                     read from run.sqlite by a plain sqlite3 loop (prompts joined by SQL),
                     SpecForge JSONL written with orjson; floor_specforge: the export's bytes
                     written alone (as kit writes them, and plainly)
  export_token_ids   kit.export(formats=("token_ids",)) from the server's ids | plain_token_ids:
                     the ids read by a plain loop, prompt_ids + output_ids (+ <|im_end|> after a
                     stop) with the loss mask, written with orjson
  validate_*         kit.validate of each export
A step over --rss-limit-gb or --step-timeout is killed (its row says so, with the highest RSS
sampled); --skip-over S skips a step that the rate at a smaller size predicts takes over S
seconds. Every measurement is kept in workdir/results.json; --table-only prints it again.
--profile STEP runs one step under cProfile at --sizes[0] and prints the top entries.
Pages: a step reads run.sqlite as the page cache holds it after the steps before it (warm,
or partly); --cold drops that file's cached pages before each step (posix_fadvise), so the
step pays its disk reads, as a first read after a reboot would. The row says which.

    python bench/bench_scale.py --quick                       # both parts, small (minutes)
    python bench/bench_scale.py --part a                      # 92M tokens
    python bench/bench_scale.py --part b --sizes 40000 200000 1000000
    python bench/bench_scale.py --part b --sizes 200000 --profile export_specforge

Targets (issue 22), at 1M records unless said: every kit step under 1.5 GB peak RSS
(kit.load of 1.25M prompts and the whole generating process included); restart to the
first request < 5 s with 25% unsent; watch's first read < 1 s while the run writes; audit
< 40 s; SpecForge export no slower than the plain exporter and >= 30K records/s, token-id
export from server ids >= 20K records/s (at every size); run.sqlite <= 1.5x the JSONL
layout's files and <= 4 bytes a token id. Data go under --workdir (/tmp/scale).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import sqlite3
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
SPARE = 1.25  # part B: prompts per record (the unsent ones give a restart work to do)
STEPS = [
    "load",
    "load_gz",
    "plain_load",
    "fresh",
    "watch",
    "audit",
    "restart",
    "export_specforge",
    "plain_specforge",
    "floor_specforge",
    "validate_specforge",
    "export_token_ids",
    "plain_token_ids",
    "validate_token_ids",
]
BASELINE = {
    "load": "plain_load",
    "load_gz": "plain_load",
    "export_specforge": "plain_specforge",
    "export_token_ids": "plain_token_ids",
}
LABELS = {
    "imports": "imports only (no call)",
    "load": "kit.load prompts",
    "load_gz": "kit.load prompts .jsonl.gz",
    "plain_load": "plain load",
    "fresh": "load+generate 1st request",
    "watch": "watch 1st read (writing)",
    "audit": "audit",
    "restart": "restart to 1st request",
    "export_specforge": "export specforge",
    "plain_specforge": "plain specforge",
    "floor_specforge": "write floor specforge",
    "validate_specforge": "validate specforge",
    "export_token_ids": "export token_ids",
    "plain_token_ids": "plain token_ids",
    "validate_token_ids": "validate token_ids",
}
# the JSONL layout's record line: Record fields in this order, messages and tools left out
# (they were in prompts.parquet), as kit wrote them before issue 22's run database
OLD_LINE = [
    "dataset",
    "prompt_id",
    "sample",
    "completion_tokens",
    "finish_reason",
    "t_done",
    "completion",
    "count_source",
    "prompt_tokens",
    "output_ids",
    "prompt_ids",
    "endpoint",
    "latency_s",
    "attempts",
    "reasoning",
    "turns",
]
INDEXES = ("sqlite_autoindex_records_1", "records_done", "prompts_key")  # the keys' and done's
RSS_MB, RESTART_S, WATCH_S, AUDIT_S = 1500, 5.0, 1.0, 40.0
SPECFORGE_RATE, TOKEN_RATE, DB_RATIO, ID_BYTES = 30_000, 20_000, 1.5, 4.0


def prompt_frame(counts: dict[str, int], keep: dict | None = None):
    """The prompt frame (kit.types columns + tools) of counts[dataset] prompts per dataset;
    keep: filled with (dataset, index) -> (messages, tools) when given."""
    import polars as pl

    from kit.data.sources import MESSAGE_TYPE, prompt_id

    parts = []
    for ds, n in counts.items():
        msgs, tools = zip(*(fleet.prompt(ds, i) for i in range(n)), strict=True)
        if keep is not None:
            keep.update(((ds, i), p) for i, p in enumerate(zip(msgs, tools, strict=True)))
        parts.append(
            pl.DataFrame(
                {
                    "dataset": [ds] * n,
                    "prompt_id": [prompt_id(m, t) for m, t in zip(msgs, tools, strict=True)],
                    "messages": list(msgs),
                    "n_turns": [len(m) for m in msgs],
                    "row": list(range(n)),
                    "tools": list(tools),
                },
                schema_overrides={"messages": MESSAGE_TYPE, "tools": pl.String, "row": pl.Int64},
            )
        )
    return pl.concat(parts)


def old_line(row: dict) -> bytes:
    """A record's line in the JSONL layout (row: Record fields; turns as a list or None)."""
    return orjson.dumps({f: row.get(f) for f in OLD_LINE}) + b"\n"


def db_bytes(run_dir: Path) -> int:
    """run.sqlite with its -wal and -shm."""
    return sum(p.stat().st_size for p in run_dir.glob("run.sqlite*") if p.is_file())


def _status_kb(pid, field: str = "VmRSS:") -> int:
    """A /proc/<pid>/status field in kB (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------- part A


def part_a(args) -> None:
    from kit.run.generate import generate
    from kit.types import RunConfig, Sampling

    budget = int(args.budget_millions * 1e6)
    counts = {d: math.ceil(budget / fleet.mean_length(d) * 1.3) + 50 for d in fleet.DATASETS}
    print(
        f"== part A: {len(counts)} datasets x {budget:,} tokens, {sum(counts.values()):,} "
        f"prompts, {args.endpoints} fake endpoints, concurrency {args.concurrency}",
        flush=True,
    )
    frame = prompt_frame(counts)
    run_dir = Path(args.workdir) / "full_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    with fleet.Fleet(args.endpoints, args.latency_ms) as endpoints:
        config = RunConfig(
            model=MODEL,
            endpoints=endpoints.urls,
            budgets=budget,
            sampling=Sampling(max_tokens=fleet.MAX_TOKENS),
            concurrency=args.concurrency,
        )
        t0 = time.perf_counter()
        run = asyncio.run(generate(frame, config, run_dir=run_dir))
        wall = time.perf_counter() - t0
        rss_run = _status_kb("self", "VmHWM:") / 1024  # prompt frame + the runner, not the checks
        answered = endpoints.answered()
    summary = {r["dataset"]: r for r in run.summary().to_dicts()}
    rows = {
        (ds, pid): row for ds, pid, row in frame.select("dataset", "prompt_id", "row").iter_rows()
    }
    old = _old_prompts_bytes(frame, Path(args.workdir) / "full_run_prompts.parquet")
    del frame
    found, seen, sample = _part_a_records(run_dir, rows)
    n = sum(g["records"] for g in found.values())
    old += sum(g["old_bytes"] for g in found.values())
    _part_a_budgets(summary, found)
    checks = {
        "record keys unique": n == len(seen),
        "every record's prompt is in the prompt frame": all(
            None not in g["rows"] for g in found.values()
        ),
        "records and tokens == the runner's counts": all(
            found.get(ds, {}).get("records") == summary[ds]["samples_done"]
            and found.get(ds, {}).get("tokens") == summary[ds]["tokens_done"]
            for ds in summary
        ),
        "each endpoint answer is one record (none lost, none twice)": all(
            sorted(answered.get(ds, [])) == sorted(g["rows"]) for ds, g in found.items()
        )
        and sum(map(len, answered.values())) == n,
        f"completion_tokens == SmolLM2 re-tokenized count ({len(sample)} records)": _retokenized(
            sample
        ),
    }
    for name, ok in checks.items():
        print(f"  {name}: {'PASS' if ok else 'FAIL'}")
    tokens = sum(g["tokens"] for g in found.values())
    size = db_bytes(run_dir)
    print(
        f"run: {wall:.1f} s wall, {n:,} records, {n / wall:,.0f} records/s, {tokens / wall:,.0f} "
        f"tokens/s; stop_reason {run.stop_reason}; generating process peak RSS {rss_run:,.0f} MB "
        f"(prompt frame + runner) {'PASS' if rss_run < RSS_MB else 'FAIL'} (< {RSS_MB} MB)"
    )
    print(
        f"run.sqlite: {size / 1e6:,.1f} MB, {size / max(n, 1):,.0f} bytes/record; JSONL layout "
        f"(record lines + prompts.parquet): {old / 1e6:,.1f} MB; ratio {size / max(old, 1):.2f}x "
        f"{'PASS' if size <= DB_RATIO * old else 'FAIL'} (<= {DB_RATIO}x)\n",
        flush=True,
    )


def _part_a_records(run_dir: Path, rows: dict) -> tuple[dict, set, list]:
    """Per dataset {records, tokens, rows (prompt rows, None if unknown), old_bytes}, the keys
    seen, and a sample of (completion, completion_tokens), read through kit.run.reader."""
    from kit.run.reader import RECORD_COLUMNS, record_batches

    found, seen, sample = {}, set(), []
    for batch in record_batches(run_dir, columns=RECORD_COLUMNS):
        for row in batch.iter_rows(named=True):
            ds, pid = row["dataset"], row["prompt_id"]
            seen.add((ds, pid, row["sample"]))
            got = found.setdefault(ds, {"records": 0, "tokens": 0, "rows": [], "old_bytes": 0})
            got["records"] += 1
            got["tokens"] += row["completion_tokens"]
            got["rows"].append(rows.get((ds, pid)))
            got["old_bytes"] += len(
                old_line(row | {"turns": json.loads(row["turns"]) if row["turns"] else None})
            )
            if len(sample) < 1000 and len(seen) % 97 == 0:
                sample.append((row["completion"], row["completion_tokens"]))
    return found, seen, sample


def _part_a_budgets(summary: dict, found: dict) -> None:
    print(
        f"{'dataset':<12}{'budget':>12}{'tokens':>12}{'over %':>8}{'records':>9}  within max(1%, max_tokens)"
    )
    ok_all = True
    for ds in fleet.DATASETS:
        s, g = summary[ds], found.get(ds, {"records": 0, "tokens": 0})
        slack = max(0.01 * s["budget"], fleet.MAX_TOKENS)
        within = s["budget"] <= g["tokens"] <= s["budget"] + slack
        ok_all &= within
        print(
            f"{ds:<12}{s['budget']:>12,}{g['tokens']:>12,}{100 * (g['tokens'] / s['budget'] - 1):>8.2f}"
            f"{g['records']:>9,}  {'yes' if within else 'NO'} ({s['state']})"
        )
    print(
        f"budgets: {'all within' if ok_all else 'SOME OUTSIDE'} [budget, budget + max(1%, {fleet.MAX_TOKENS})]"
    )


def _old_prompts_bytes(frame, path: Path) -> int:
    """prompts.parquet of the JSONL layout for this frame (written as kit wrote it: 10K-row
    groups, polars' default compression): its size."""
    frame.write_parquet(path, row_group_size=10_000)
    size = path.stat().st_size
    path.unlink()
    return size


def _retokenized(sample: list[tuple[str, int]]) -> bool:
    """Whether each completion text re-tokenizes (SmolLM2) to its completion_tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fleet.TOKENIZER / "tokenizer.json"))
    got = tok.encode_batch([text for text, _ in sample], add_special_tokens=False)
    return all(len(e.ids) == n for e, (_, n) in zip(got, sample, strict=True))


# ---------------------------------------------------------------- part B: the run database


def record_counts(n: int) -> dict[str, int]:
    """Records per dataset for n in all, in part A's mix (equal budgets: counts ~ 1/mean)."""
    w = {d: 1 / fleet.mean_length(d) for d in fleet.DATASETS}
    out = {d: int(n * v / sum(w.values())) for d, v in w.items()}
    out[next(iter(out))] += n - sum(out.values())
    return out


class _Ids:
    """Token ids of fleet texts without the tokenizer's cost: each VOCAB word is one SmolLM2
    token, bare or after a space, so a text's ids are its first word's bare id and the
    others' spaced ids; a prompt's are SmolLM2's ChatML template (which ignores tools) built
    from those pieces. prompt() is checked against the rendering kit uses (check())."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(fleet.TOKENIZER / "tokenizer.json"))
        self.enc = lambda s: self.tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        self.bare = {w: self.enc(w)[0] for w in fleet.VOCAB}
        self.spaced = {w: self.enc(" " + w)[0] for w in fleet.VOCAB}
        self.start, self.end = (
            self.tok.token_to_id("<|im_start|>"),
            self.tok.token_to_id("<|im_end|>"),
        )
        self.nl = self.enc("\n")
        self.system = [
            self.start,
            *self.enc(
                "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            ),
            self.end,
            *self.nl,
        ]
        self.heads = {r: [self.start, *self.enc(r + "\n")] for r in ("system", "user", "assistant")}

    def text(self, text: str) -> list[int]:
        words = text.split(" ")
        return [self.bare[words[0]], *map(self.spaced.__getitem__, words[1:])] if text else []

    def prompt(self, messages: list[dict]) -> list[int]:
        out = [] if messages[0]["role"] == "system" else list(self.system)
        for k, m in enumerate(messages):
            content = m["content"]
            if k == 0:  # "[dataset] index. words..."
                tag, _, rest = content.partition(". ")
                body = self.enc(tag + ".") + (
                    [self.spaced[w] for w in rest.split(" ")] if rest else []
                )
            else:
                body = self.text(content)
            out += [*self.heads[m["role"]], *body, self.end, *self.nl]
        return out + self.heads["assistant"]

    def check(self, prompts: list[tuple]) -> int:
        """How many of these (messages, tools) prompts' ids differ from kit's rendering
        (kit.tokens.render, tokenized)."""
        from kit.tokens import encode_many, load_tokenizer, render

        tok = load_tokenizer(str(fleet.TOKENIZER))
        convs = [
            [{"role": m["role"], "content": m["content"]} for m in msgs] for msgs, _ in prompts
        ]
        tools = [json.loads(t) if t else None for _, t in prompts]
        real = encode_many(tok, render(tok, convs, True, on_error="skip", tools=tools))
        return sum(self.prompt(m) != r for (m, _), r in zip(prompts, real, strict=True))


def synthesize(run_dir: Path, prompt_dir: Path, n: int) -> dict:
    """Write a run database of n records (RunStore.init + append) and the prompt files;
    return its marker doc (sizes, and what restore() needs)."""
    import random
    from dataclasses import replace

    from kit.data.sources import source_hashes
    from kit.run.store import RunStore
    from kit.types import RunConfig, Sampling

    t0 = time.perf_counter()
    shutil.rmtree(run_dir, ignore_errors=True)
    counts = record_counts(n)
    cache: dict = {}
    frame = prompt_frame({d: math.ceil(c * SPARE) for d, c in counts.items()}, cache)
    _prompt_files(frame, prompt_dir)
    order = [(d, i) for d, c in counts.items() for i in range(c)]
    random.Random(n).shuffle(order)
    ids = dict(
        zip(zip(frame["dataset"], frame["row"], strict=True), frame["prompt_id"], strict=True)
    )
    tokens = dict.fromkeys(counts, 0)  # the budgets: what the records add up to (set at the end)
    config = RunConfig(
        model=MODEL,
        endpoints=["http://127.0.0.1:9/v1"],
        budgets=dict.fromkeys(counts, 1),
        sampling=Sampling(max_tokens=fleet.MAX_TOKENS),
        concurrency=256,
        source_hashes=source_hashes(frame),
    )
    old = parquet = _old_prompts_bytes(
        frame, prompt_dir.parent / f"{prompt_dir.name}_old_prompts.parquet"
    )
    store = RunStore(run_dir, flush_every=20_000, flush_interval=1e9)
    store.init(config, frame)
    del frame
    maker = _Ids()
    differ = maker.check([cache[key] for key in order[:500]])
    t_done, n_ids = time.time() - 86_400, 0
    for k, (d, i) in enumerate(order):
        msgs, tools = cache.pop((d, i))
        rec = _record(d, ids[(d, i)], msgs, tools, maker, k, t_done)
        tokens[d] += rec.completion_tokens
        n_ids += len(rec.prompt_ids) + len(rec.output_ids)
        old += len(old_line({f: getattr(rec, f) for f in OLD_LINE}))
        store.append(rec)
    store.close()
    store = RunStore(run_dir)
    store.init(replace(config, budgets=tokens))  # budgets may change; the fingerprint holds
    store.close()
    return {
        "records": n,
        "synth_s": time.perf_counter() - t0,
        "old_bytes": old,
        "old_parquet_bytes": parquet,
        "ids": n_ids,
        "prompt_ids_differ_of_500": differ,
    } | _sizes(run_dir)


def _record(d: str, pid: str, msgs, tools, maker: _Ids, k: int, t_done: float):
    """The Record the runner would have written for prompt (d, pid), with server ids."""
    from kit.types import Record

    text, tok, finish = fleet.completion(msgs, None, fleet.MAX_TOKENS)
    p_ids = maker.prompt(msgs)
    return Record(
        dataset=d,
        prompt_id=pid,
        sample=0,
        messages=msgs,
        completion=text,
        finish_reason=finish,
        completion_tokens=tok,
        count_source="server_ids",
        prompt_tokens=len(p_ids),
        output_ids=maker.text(text),
        prompt_ids=p_ids,
        endpoint=f"http://127.0.0.1:{8001 + k % 4}/v1",
        latency_s=round(0.02 + tok / 400, 4),
        t_done=round(t_done + k * 0.004, 3),
        tools=json.loads(tools) if tools else None,
    )


def _prompt_files(frame, prompt_dir: Path) -> None:
    """The prompts as kit.load's input: one JSONL file per dataset, {"messages", "tools"}."""
    shutil.rmtree(prompt_dir, ignore_errors=True)
    prompt_dir.mkdir(parents=True)
    for (ds,), part in frame.group_by("dataset", maintain_order=True):
        with open(prompt_dir / f"{ds}.jsonl", "wb") as f:
            for msgs, tools in part.select("messages", "tools").iter_rows():
                row = {"messages": msgs} | ({"tools": json.loads(tools)} if tools else {})
                f.write(orjson.dumps(row) + b"\n")


def _sizes(run_dir: Path) -> dict:
    """The database's size on disk, per table (dbstat), and the token id blobs' bytes; and
    what restore() puts back: the last record rowid, totals, state and config rows."""
    conn = sqlite3.connect(run_dir / "run.sqlite")
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        tables = dict(conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall())
        blob = conn.execute(
            "SELECT sum(length(output_ids)) + sum(length(prompt_ids)) FROM records"
        ).fetchone()[0]
        keep = {
            "last_rowid": conn.execute("SELECT max(rowid) FROM records").fetchone()[0],
            "totals": conn.execute("SELECT * FROM totals").fetchall(),
            "state": conn.execute("SELECT * FROM state").fetchall(),
            "config": conn.execute("SELECT * FROM config").fetchall(),
        }
    finally:
        conn.close()
    return {"db_bytes": db_bytes(run_dir), "tables": tables, "id_blob_bytes": blob, "keep": keep}


def restore(run_dir: Path, meta: dict) -> None:
    """Put a run database back as written: a restart or a writer added records, errors and
    skips and changed totals, state and config. Nothing else may have it open."""
    keep = meta["keep"]
    conn = sqlite3.connect(run_dir / "run.sqlite", isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM records WHERE rowid > ?", (keep["last_rowid"],))
        for table in ("errors", "skips", "totals", "state", "config"):
            conn.execute(f"DELETE FROM {table}")  # noqa: S608 - our table names
        for table in ("totals", "state", "config"):
            for row in keep[table]:
                conn.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(row))})", row)  # noqa: S608
        for table in ("guard_datasets", "guard_tokenizer"):  # the guard's cache, as written: none
            if conn.execute("SELECT 1 FROM sqlite_schema WHERE name = ?", (table,)).fetchone():
                conn.execute(f"DELETE FROM {table}")  # noqa: S608 - our table names
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def run_dir_for(workdir: Path, n: int) -> tuple[Path, Path, dict]:
    """(run dir of n records, its prompt files' dir, its marker doc): reused when its marker
    says complete (and put back as written), else written."""
    run_dir, prompt_dir = workdir / "runs" / f"n{n}", workdir / "runs" / f"n{n}_prompts"
    marker = workdir / "runs" / f"n{n}.json"
    if marker.exists():
        meta = json.loads(marker.read_text())
        restore(run_dir, meta)
        print(f"-- {n:,} records: reusing {run_dir} ({meta['db_bytes'] / 1e9:.2f} GB)", flush=True)
        return run_dir, prompt_dir, meta
    print(f"-- {n:,} records: writing {run_dir} ...", flush=True)
    meta = synthesize(run_dir, prompt_dir, n)
    marker.write_text(json.dumps(meta))
    print(
        f"   written in {meta['synth_s']:.0f} s, run.sqlite {meta['db_bytes'] / 1e9:.2f} GB "
        f"({meta['db_bytes'] / n:,.0f} bytes/record, prompts included)",
        flush=True,
    )
    return run_dir, prompt_dir, meta


# ---------------------------------------------------------------- part B: the steps (child side)


def _gzipped(prompt_dir: Path) -> Path:
    """A sibling directory of the prompt files as .jsonl.gz, written once (streamed)."""
    import gzip
    import shutil

    out = prompt_dir.with_name(prompt_dir.name + "_gz")
    out.mkdir(exist_ok=True)
    for path in sorted(prompt_dir.glob("*.jsonl")):
        target = out / (path.name + ".gz")
        if not target.exists():
            with open(path, "rb") as src, gzip.open(f"{target}.tmp", "wb", compresslevel=1) as dst:
                shutil.copyfileobj(src, dst)
            Path(f"{target}.tmp").rename(target)
    return out


def _plain_load(prompt_dir: Path) -> int:
    """The baseline of kit.load: each file's lines parsed by orjson into a polars frame
    (dataset, messages, tools), no checks, no ids."""
    import polars as pl

    parts = []
    for path in sorted(prompt_dir.glob("*.jsonl")):
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        parts.append(
            pl.DataFrame(
                {
                    "dataset": [path.stem] * len(rows),
                    "messages": [r["messages"] for r in rows],
                    "tools": [
                        orjson.dumps(r["tools"]).decode() if r.get("tools") else None for r in rows
                    ],
                },
                schema_overrides={"tools": pl.String},
            )
        )
    return pl.concat(parts).height


_PLAIN_SQL = (
    "SELECT r.dataset, r.prompt_id, r.sample, r.completion, p.messages, p.tools FROM records r "
    "JOIN prompts p ON p.dataset = r.dataset AND p.prompt_id = r.prompt_id ORDER BY r.rowid"
)


def _plain_specforge(run_dir: Path, out: Path) -> int:
    """The baseline: the records and their prompts read from run.sqlite with a plain sqlite3
    loop, SpecForge JSONL ({"id", "conversations", "tools"?}) written with orjson."""
    out.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True)
    n = 0
    with open(out / "train.jsonl", "wb") as f:
        cur = conn.execute(_PLAIN_SQL)
        while rows := cur.fetchmany(10_000):
            lines = []
            for ds, pid, sample, completion, messages, tools in rows:
                conv = [{"role": r, "content": c} for r, c in orjson.loads(messages)]
                conv.append({"role": "assistant", "content": completion})
                row = {"id": f"{ds}-{pid}-{sample}", "conversations": conv}
                if tools:
                    row["tools"] = orjson.loads(tools)
                lines.append(orjson.dumps(row))
            f.write(b"\n".join(lines) + b"\n")
            n += len(rows)
    conn.close()
    return n


def _plain_token_ids(run_dir: Path, out: Path) -> int:
    """The baseline: prompt_ids and output_ids read from run.sqlite with a plain sqlite3
    loop; input_ids = prompt_ids + output_ids (+ <|im_end|> after a stop), loss_mask 1 on the
    generated part, written with orjson."""
    import numpy as np
    from tokenizers import Tokenizer

    eot = Tokenizer.from_file(str(fleet.TOKENIZER / "tokenizer.json")).token_to_id("<|im_end|>")
    out.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True)
    sql = "SELECT dataset, prompt_id, sample, finish_reason, prompt_ids, output_ids FROM records ORDER BY rowid"
    n = 0
    with open(out / "train.jsonl", "wb") as f:
        cur = conn.execute(sql)
        while rows := cur.fetchmany(10_000):
            lines = []
            for ds, pid, sample, finish, p, o in rows:
                ids = np.frombuffer(p + o, dtype="<u4").tolist()
                np_, no = len(p) // 4, len(o) // 4
                mask = [0] * np_ + [1] * no
                if finish == "stop":
                    ids.append(eot)
                    mask.append(1)
                lines.append(
                    orjson.dumps(
                        {
                            "id": f"{ds}-{pid}-{sample}",
                            "input_ids": ids,
                            "loss_mask": mask,
                            "ids_source": "server",
                        }
                    )
                )
            f.write(b"\n".join(lines) + b"\n")
            n += len(rows)
    conn.close()
    return n


def _write_floor(export_dir: Path, out: Path) -> dict:
    """The write floor: as many bytes as the export wrote (16 MB pieces of one random
    buffer), nothing else. Written as kit's JSONL sinks write (WriteBehind: synced and
    dropped from the page cache every 64 MB; "seconds") and plainly ("plain_seconds")."""
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
    return {"seconds": took["behind"], "plain_seconds": took["plain"], "bytes": size}


def _restart(run_dir: Path, args) -> dict:
    """kit.generate(None, ...) with budgets no run reaches: seconds = from the call to the
    first request at the endpoint (which records its time); it then sends every unsent prompt."""
    from dataclasses import replace

    import kit
    from kit.run.reader import read_config

    _endpoint(args.url, "reset")
    config = read_config(run_dir)
    config = replace(config, endpoints=[args.url], budgets=dict.fromkeys(config.budgets, 10**15))
    t_call = time.time()
    run = kit.generate_sync(None, config, run_dir=run_dir)
    return _first_request(args, t_call, run)


def _endpoint(url: str, what: str) -> dict:
    """The fake endpoint's /reset (POST) or /stats."""
    import urllib.request

    root = url.removesuffix("/v1")
    req = (
        urllib.request.Request(root + "/reset", data=b"{}") if what == "reset" else root + "/stats"
    )
    return orjson.loads(urllib.request.urlopen(req, timeout=10).read() or b"{}")  # noqa: S310


def _first_request(args, t_call: float, run) -> dict:
    """Seconds from t_call (and from the step's exec) to the endpoint's first request, the
    whole call's, the requests it took."""
    total = time.time() - t_call
    stats = _endpoint(args.url, "stats")
    first = stats["first_t"]
    return {
        "seconds": None if first is None else first - t_call,
        "total_s": total,
        "from_exec_s": None if first is None else first - args.spawn_t,
        "new_records": stats["requests"],
        "stop": run.stop_reason,
    }


def _fresh(run_dir: Path, prompt_dir: Path, out: Path, args) -> dict:
    """kit.load(prompt_dir) then kit.generate(LoadResult) into `out` (a new run directory,
    removed after) with budgets of one token: seconds = from the load's call to the first
    request at the endpoint."""
    from dataclasses import replace

    import kit
    from kit.run.reader import read_config

    _endpoint(args.url, "reset")
    config = read_config(run_dir)
    config = replace(config, endpoints=[args.url], budgets=dict.fromkeys(config.budgets, 1))
    shutil.rmtree(out, ignore_errors=True)
    t_call = time.time()
    loaded = kit.load(prompt_dir)
    t_loaded = time.time()
    run = kit.generate_sync(loaded, config, run_dir=out)
    done = _first_request(args, t_call, run)
    shutil.rmtree(out, ignore_errors=True)
    return done | {"load_s": t_loaded - t_call, "records": loaded.height}


def writer(run_dir: Path, ready: Path) -> None:
    """A live writer for the watch step: commits records (sample 1 of stored prompts) every
    256 records or second and a status row a second, ~1,000 records/s, until SIGTERM."""
    from kit.run.reader import read_config
    from kit.run.store import RunStore
    from kit.types import DatasetProgress, Record

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    config = read_config(run_dir)
    store = RunStore(run_dir, flush_every=256, flush_interval=1.0)
    store.init(config)
    keys = store.conn.execute("SELECT dataset, prompt_id FROM records LIMIT 100000").fetchall()
    text = fleet.words(0, 300)
    t_status, k = 0.0, 0
    while not stop and k < len(keys):
        t = time.time()
        for ds, pid in keys[k : k + 100]:
            store.append(
                Record(
                    dataset=ds,
                    prompt_id=pid,
                    sample=1,
                    messages=[],
                    completion=text,
                    finish_reason="stop",
                    completion_tokens=300,
                    count_source="usage",
                    endpoint="http://127.0.0.1:9/v1",
                    latency_s=0.1,
                    t_done=time.time(),
                )
            )
        k += 100
        if t - t_status >= 1.0:
            progress = [
                DatasetProgress(dataset=d, budget=b, state="running", in_flight=32)
                for d, b in config.budgets.items()
            ]
            store.write_status(progress)
            t_status = t
        if k >= 512 and not ready.exists():
            ready.write_text(str(k))
        time.sleep(max(0.0, 0.1 - (time.time() - t)))
    store.close()


def child(args) -> None:
    """Run one step in this (fresh) process; write {"seconds", ...} to args.result."""
    import polars  # noqa: F401 - imported before the timing, like every step's modules

    import kit
    import kit.report.audit  # noqa: F401
    import kit.report.export  # noqa: F401
    import kit.run.generate  # noqa: F401
    from kit.run.progress import progress

    run_dir, out, step, info = Path(args.run_dir), Path(args.out), args.step, {}
    prompt_dir = run_dir.parent / f"{run_dir.name}_prompts"
    profiler = None
    if args.profile_out:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if step == "load_gz":  # the same files gzipped (before the clock: not the load's work)
        prompt_dir = _gzipped(prompt_dir)
    t0, c0 = time.perf_counter(), time.process_time()
    if step == "imports":
        pass  # the modules above, nothing called: the floor every step's RSS stands on
    elif step in ("load", "load_gz"):
        info["records"] = kit.load(prompt_dir).height
    elif step == "fresh":
        info |= _fresh(run_dir, prompt_dir, out, args)
    elif step == "plain_load":
        info["records"] = _plain_load(prompt_dir)
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
        if fmt == "token_ids":  # where the ids came from: exact (server) rows vs re-tokenized
            rows = result.manifest.get("token_rows") or {}
            info["token_rows"] = {
                k: sum(d.get(k, 0) for d in rows.values())
                for k in ("exact", "retokenized", "prompt_render_differs", "skipped")
            }
    elif step.startswith("validate_"):
        v = kit.validate(out)
        info |= {"ok": v.ok, "problems": v.problems[:3]}
    elif step == "floor_specforge":
        info |= _write_floor(out.parent / "specforge", out)
    elif step == "plain_specforge":
        info["records"] = _plain_specforge(run_dir, out)
    elif step == "plain_token_ids":
        info["records"] = _plain_token_ids(run_dir, out)
    info["seconds"] = info.get("seconds", 0.0 if step == "imports" else time.perf_counter() - t0)
    info["cpu_s"] = time.process_time() - c0  # this process's CPU (user + sys), all threads
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile_out)
    info["hwm_mb"] = _status_kb("self", "VmHWM:") / 1024  # this interpreter's own peak
    Path(args.result).write_text(json.dumps(info, default=str))


# ---------------------------------------------------------------- part B: measuring (parent side)


def measure(step: str, run_dir: Path, out: Path, args, url: str, profile_out: str = "") -> dict:
    """Run one step in a fresh interpreter: its result, peak RSS and whether it was killed
    (over --rss-limit-gb or --step-timeout). The watch step runs while a writer process
    commits records into the run (started first, stopped after).

    Peak RSS is the child's own VmHWM at its end, or the highest VmRSS sampled every 0.1 s
    when it was killed. Not os.wait4's ru_maxrss: Python starts the child with vfork, so
    that figure is at least the parent's peak (this bench's, after writing a run dir)."""
    workdir = Path(args.workdir)
    result = workdir / "step_result.json"
    result.unlink(missing_ok=True)
    os.sync()  # the last step's writes go to disk first: they would throttle this one's
    if args.cold:
        evict(run_dir)
    bg = _start_writer(run_dir, workdir) if step == "watch" else None
    log = open(workdir / f"step_{step}.log", "w")  # noqa: SIM115
    t_spawn = time.time()
    cmd = [
        sys.executable,
        __file__,
        "--step",
        step,
        "--run-dir",
        str(run_dir),
        "--out",
        str(out),
        "--result",
        str(result),
        "--url",
        url,
        "--spawn-t",
        repr(t_spawn),
        "--profile-out",
        profile_out,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    killed, sampled = _watchdog(proc, args, t_spawn)
    log.close()
    if bg is not None:
        bg.send_signal(signal.SIGTERM)
        bg.wait(60)
    doc = json.loads(result.read_text()) if result.exists() and not killed else {}
    doc |= {
        "rss_mb": max(doc.get("hwm_mb", 0), sampled / 1024),
        "wall_s": time.time() - t_spawn,
        "pages": "cold" if args.cold else "as cached",
    }
    if killed:
        why = f"over {args.rss_limit_gb:g} GB RSS" if killed == "rss" else "timeout"
        doc["error"] = f"killed ({why})"
    elif proc.returncode or "seconds" not in doc:
        tail = (workdir / f"step_{step}.log").read_text().strip().splitlines()[-1:]
        doc["error"] = f"exit {proc.returncode}: {tail[0][:150] if tail else ''}"
    return doc


def evict(run_dir: Path) -> None:
    """Drop run.sqlite's pages (this file's alone) from the page cache, so a step reads them
    from disk (--cold). Without it a step reads whatever earlier steps left cached: its
    time is a warm one, or partly so, and says nothing of a first read after a reboot."""
    for path in run_dir.glob("run.sqlite*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _start_writer(run_dir: Path, workdir: Path) -> subprocess.Popen:
    """The watch step's live writer, started and past its first commits."""
    ready = workdir / "writer_ready"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--writer", str(ready), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=open(workdir / "writer.log", "w"), stderr=subprocess.STDOUT
    )  # noqa: SIM115
    t0 = time.time()
    while not ready.exists():
        if proc.poll() is not None or time.time() - t0 > 300:
            raise SystemExit(f"the watch step's writer did not start: see {workdir / 'writer.log'}")
        time.sleep(0.05)
    return proc


def _watchdog(proc: subprocess.Popen, args, t_spawn: float) -> tuple[str, int]:
    """Wait for proc, sampling its RSS every 0.1 s; kill it over the limits. Returns (why
    it was killed or "", the highest RSS sampled in kB)."""
    killed: list[str] = []
    sampled = [0]

    def watch() -> None:
        limit_kb = args.rss_limit_gb * (1 << 20)
        while proc.returncode is None and not killed:
            rss = _status_kb(proc.pid)
            sampled[0] = max(sampled[0], rss)
            if rss > limit_kb or time.time() - t_spawn > args.step_timeout:
                killed.append("rss" if rss > limit_kb else "timeout")
                os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    _, status = os.waitpid(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    thread.join()
    return (killed[0] if killed else ""), sampled[0]


def _out_dir(workdir: Path, step: str, n: int) -> Path:
    kind, _, fmt = step.partition("_")
    return (
        workdir / "exports" / f"n{n}" / ((kind + "_" if kind in ("plain", "floor") else "") + fmt)
    )


def _predicted(results: dict, step: str, n: int) -> float | None:
    """Seconds a step should take at n records from its rate at the largest smaller size."""
    done = {m: d for m, d in results.get(step, {}).items() if m < n and _ok(d)}
    if not done:
        return None
    m = max(done)
    return done[m]["seconds"] * n / m


def part_b(args) -> None:
    workdir = Path(args.workdir)
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    steps = [s for s in STEPS if s in args.steps]
    print(f"== part B: sizes {args.sizes}, steps each in a fresh interpreter", flush=True)
    results = _saved(workdir)
    with fleet.Fleet(1, 0.0) as endpoint:
        for n in args.sizes:
            run_dir, _, meta = run_dir_for(workdir, n)
            results.setdefault("db_size", {})[n] = _db_doc(meta)
            _save(workdir, "db_size", n, results["db_size"][n])
            if n == args.sizes[0]:
                doc = measure("imports", run_dir, workdir, args, endpoint.urls[0])
                results["imports"] = {n: doc}
                _save(workdir, "imports", n, doc)
            for step in steps:
                out = _out_dir(workdir, step, n)
                guess = _predicted(results, step, n) if args.skip_over else None
                made = results.get("export_" + step.partition("_")[2], {}).get(n)
                if step.startswith("validate") and not _ok(made):
                    doc = {"error": "skipped (no export to validate)", "rss_mb": 0}
                elif guess is not None and guess > args.skip_over:
                    doc = {
                        "error": f"skipped (predicted {guess:,.0f} s > {args.skip_over:g} s from the rate at a smaller size)",
                        "rss_mb": 0,
                    }
                else:
                    if step.startswith(("export", "plain", "floor", "fresh")):
                        shutil.rmtree(out, ignore_errors=True)
                    doc = measure(step, run_dir, out, args, endpoint.urls[0])
                    if step in ("restart", "watch"):
                        restore(run_dir, meta)
                    if step.startswith(("validate", "plain", "floor")) and not args.keep_exports:
                        shutil.rmtree(out, ignore_errors=True)
                results.setdefault(step, {})[n] = doc
                _save(workdir, step, n, doc)
                print(f"   {LABELS[step]:<26}{n:>10,}  {_cells(doc, n)}", flush=True)
            print(f"   load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    print_table(results, args.sizes)


def _db_doc(meta: dict) -> dict:
    return {
        k: meta[k]
        for k in (
            "records",
            "db_bytes",
            "old_bytes",
            "old_parquet_bytes",
            "ids",
            "id_blob_bytes",
            "tables",
        )
    }


def profile(args) -> None:
    """Run one step under cProfile at --sizes[0]; print the top entries by own and total time."""
    import pstats

    workdir, n = Path(args.workdir), args.sizes[0]
    run_dir, _, meta = run_dir_for(workdir, n)
    stats_path = workdir / f"profile_{args.profile}_n{n}.pstats"
    with fleet.Fleet(1, 0.0) as endpoint:
        out = _out_dir(workdir, args.profile, n)
        shutil.rmtree(out, ignore_errors=True)
        doc = measure(args.profile, run_dir, out, args, endpoint.urls[0], str(stats_path))
    if args.profile in ("restart", "watch"):
        restore(run_dir, meta)
    print(f"{args.profile} at {n:,} under cProfile: {_cells(doc, n)}")
    st = pstats.Stats(str(stats_path))
    st.sort_stats("tottime").print_stats(args.profile_top)
    st.sort_stats("cumulative").print_stats(args.profile_top)


def _saved(workdir: Path) -> dict:
    path = workdir / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    return {s: {int(n): d for n, d in by.items()} for s, by in saved.items()}


def _save(workdir: Path, step: str, n: int, doc: dict) -> None:
    """Keep every measurement in workdir/results.json (--table-only prints them again)."""
    path = workdir / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved.setdefault(step, {})[str(n)] = doc | {"t": time.time(), "kit": _kit_rev()}
    path.write_text(json.dumps(saved, indent=1, default=str))


def _kit_rev() -> str:
    """The commit kit's code was at, "+dirty" when kit/ has uncommitted changes."""
    git = ["git", "-C", str(ROOT)]
    rev = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "kit"], capture_output=True, text=True
    ).stdout.strip()
    return rev + ("+dirty" if dirty else "")


def table_only(args) -> None:
    """The table and targets of the measurements kept in workdir/results.json."""
    results = _saved(Path(args.workdir))
    sizes = sorted({n for by in results.values() for n in by if n in args.sizes})
    print_table(results, sizes)


def _ok(d: dict | None) -> bool:
    return d is not None and not d.get("error") and d.get("seconds") is not None


def _cells(doc: dict, n: int) -> str:
    if doc.get("error"):
        return f"{doc['error']}  (peak {doc['rss_mb']:,.0f} MB)"
    s = doc["seconds"]
    if s is None:
        return f"no request reached the endpoint (peak {doc['rss_mb']:,.0f} MB)"
    extra = ""
    if "total_s" in doc:
        extra = f"  [whole generating process {doc['total_s']:.1f} s, {doc['new_records']:,} new records; from exec {doc['from_exec_s']:.1f} s]"
        extra += f" [kit.load {doc['load_s']:.1f} s]" if "load_s" in doc else ""
    if "ok" in doc:
        extra = f"  [ok={doc['ok']}{'' if doc['ok'] else ' ' + '; '.join(doc['problems'])}]"
    if "plain_seconds" in doc:
        extra = f"  [{doc['bytes'] / 1e9:.2f} GB; written plainly {doc['plain_seconds']:.1f} s]"
    pages = f", {doc['pages']} pages" if "pages" in doc else ""
    return f"{s:>8.2f} s (cpu {doc.get('cpu_s', float('nan')):.1f} s{pages}) {doc['rss_mb']:>8,.0f} MB {n / max(s, 1e-9):>10,.0f} rec/s{extra}"


def print_table(results: dict, sizes: list[int]) -> None:
    sizes = sorted(sizes)
    print(
        f"\n{'step':<26}{'records':>10}{'seconds':>9}{'cpu s':>8}{'peak MB':>9}{'rows/s':>10}{'x base':>8}  note"
    )
    for step in ["imports", *STEPS]:
        for n in sizes:
            d = results.get(step, {}).get(n)
            if d is None:
                continue
            if not _ok(d):
                print(
                    f"{LABELS[step]:<26}{n:>10,}  {d.get('error', 'no request')} (peak {d['rss_mb']:,.0f} MB)"
                )
                continue
            s, mb = d["seconds"], d["rss_mb"]
            if step == "imports":
                if n != min(results["imports"]):
                    continue
                print(f"{LABELS[step]:<26}{'-':>10}{'-':>9}{'-':>8}{mb:>9,.0f}")
                continue
            base = results.get(BASELINE.get(step, ""), {}).get(n)
            ratio = f"{s / base['seconds']:>8.2f}" if _ok(base) else f"{'-':>8}"
            rate = d.get("records") or (
                n if step.startswith(("export", "plain", "audit", "watch")) else None
            )
            note = (
                f"whole generating process {d['total_s']:.0f} s, +{d['new_records']:,} records"
                if step == "restart"
                else ""
            )
            note = f"{d['records']:,} prompts" if step.endswith(("load", "load_gz")) else note
            note = (
                f"{d['records']:,} prompts loaded in {d['load_s']:.0f} s, stored, queued"
                if step == "fresh"
                else note
            )
            per_s = f"{rate / max(s, 1e-9):,.0f}" if rate else "-"
            print(
                f"{LABELS[step]:<26}{n:>10,}{s:>9.2f}{d.get('cpu_s', float('nan')):>8.1f}{mb:>9,.0f}{per_s:>10}{ratio}  {note}"
            )
    for n in sizes:
        d = results.get("db_size", {}).get(n)
        if d:
            t = d["tables"]
            print(
                f"{'run.sqlite':<26}{n:>10,}  {d['db_bytes'] / 1e9:.2f} GB = {d['db_bytes'] / d['old_bytes']:.2f}x the JSONL layout's "
                f"{d['old_bytes'] / 1e9:.2f} GB (lines {(d['old_bytes'] - d['old_parquet_bytes']) / 1e9:.2f}, prompts.parquet {d['old_parquet_bytes'] / 1e9:.2f}); "
                f"tables: records {t.get('records', 0) / 1e9:.2f} GB, prompts {t.get('prompts', 0) / 1e9:.2f} GB, indexes {sum(t.get(i, 0) for i in INDEXES) / 1e9:.2f} GB; "
                f"{d['id_blob_bytes'] / d['ids']:.2f} bytes/token id in the blobs, "
                f"{t.get('records', 0) / d['ids']:.2f} bytes of the records table per token id"
            )
    print_targets(results, sizes)


def _target(name: str, ok: bool | None, shown: str) -> None:
    verdict = "n/a " if ok is None else ("PASS" if ok else "FAIL")
    print(f"  {verdict}  {name:<58} {shown}")


def print_targets(results: dict, sizes: list[int]) -> None:
    big = max(sizes)
    at = (
        ""
        if big == 1_000_000
        else f" (largest size measured {big:,}; the targets are at 1,000,000)"
    )
    print(f"\ntargets (issue 22){at}:")
    kit_steps = [s for s in STEPS if not s.startswith(("plain", "floor"))]
    for s in kit_steps:
        d = results.get(s, {}).get(big)
        if d is not None:
            ok = (
                None
                if str(d.get("error", "")).startswith("skipped")
                else _ok(d) and d["rss_mb"] < RSS_MB
            )
            _target(
                f"peak RSS < {RSS_MB} MB: {LABELS[s]}",
                ok,
                f"{d['rss_mb']:,.0f} MB" + ("" if _ok(d) else f" ({d.get('error')})"),
            )
    for step, limit in (("restart", RESTART_S), ("watch", WATCH_S), ("audit", AUDIT_S)):
        d = results.get(step, {}).get(big)
        if d is not None:
            _target(
                f"{LABELS[step]} < {limit:g} s",
                _ok(d) and d["seconds"] < limit,
                f"{d['seconds']:.2f} s" if _ok(d) else d.get("error", "no request"),
            )
    for n in sizes:
        k, p = results.get("export_specforge", {}).get(n), results.get("plain_specforge", {}).get(n)
        if _ok(k):
            _target(
                f"export specforge >= {SPECFORGE_RATE:,}/s at {n:,}",
                n / k["seconds"] >= SPECFORGE_RATE,
                f"{n / k['seconds']:,.0f}/s",
            )
            if _ok(p):
                _target(
                    f"export specforge <= plain exporter's time at {n:,}",
                    k["seconds"] <= p["seconds"],
                    f"{k['seconds']:.1f} vs {p['seconds']:.1f} s = x{k['seconds'] / p['seconds']:.2f}",
                )
    for n in sizes:
        k = results.get("export_token_ids", {}).get(n)
        if k is not None:
            skipped = None if str(k.get("error", "")).startswith("skipped") else False
            _target(
                f"export token_ids (server ids) >= {TOKEN_RATE:,}/s at {n:,}",
                n / k["seconds"] >= TOKEN_RATE if _ok(k) else skipped,
                f"{n / k['seconds']:,.0f}/s" if _ok(k) else k.get("error"),
            )
    for n in sizes:
        d = results.get("db_size", {}).get(n)
        if d:
            r = d["db_bytes"] / d["old_bytes"]
            _target(
                f"run.sqlite <= {DB_RATIO}x the JSONL layout at {n:,}", r <= DB_RATIO, f"x{r:.2f}"
            )
            b = d["id_blob_bytes"] / d["ids"]
            _target(f"<= {ID_BYTES:g} bytes a token id at {n:,}", b <= ID_BYTES, f"{b:.2f}")


def texts_check(n: int = 20_000, size: int = 1336) -> None:
    """Whether the size comparison is fair to SQLite: zstd (parquet, as prompts.parquet) on
    fleet's prompts and completions vs real prose cut to the prompts' mean length (this
    machine's distinct package docs and Debian changelogs, licences left out)."""
    import glob
    import gzip
    import io
    import random

    import polars as pl

    def ratio(texts: list[str]) -> str:
        out = io.BytesIO()
        pl.DataFrame({"t": texts}).write_parquet(out, row_group_size=10_000)
        raw = sum(len(t.encode()) for t in texts)
        return f"{raw / 1e6:6.1f} MB -> {out.tell() / 1e6:5.1f} MB: {raw / out.tell():.2f}x"

    prompts = [
        json.dumps([[m["role"], m["content"]] for m in fleet.prompt(d, i)[0]])
        for d in fleet.DATASETS
        for i in range(n // len(fleet.DATASETS))
    ]
    answers = [
        fleet.completion(fleet.prompt(d, i)[0], None, fleet.MAX_TOKENS)[0]
        for d in fleet.DATASETS
        for i in range(n // len(fleet.DATASETS))
    ]
    paths = glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.md", recursive=True)
    paths += glob.glob("/usr/share/doc/**/changelog*.gz", recursive=True)
    docs = {
        (
            gzip.open(p, "rt", errors="replace") if p.endswith(".gz") else open(p, errors="replace")
        ).read()
        for p in paths
        if "licen" not in p.lower()
    }
    prose = "\n".join(sorted(docs))
    cuts = [prose[i : i + size] for i in range(0, len(prose) - size, size)]
    random.Random(0).shuffle(cuts)
    print(f"fleet prompts (JSON)  {ratio(prompts)}\nfleet completions     {ratio(answers)}")
    print(f"real prose ({len(docs)} docs) {ratio(cuts[:n])}")


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
    p.add_argument(
        "--skip-over",
        type=float,
        default=0.0,
        help="skip a step predicted over this many seconds (0: never)",
    )
    p.add_argument("--keep-exports", action="store_true")
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop run.sqlite's cached pages before each step (measure its disk reads)",
    )
    p.add_argument("--table-only", action="store_true", help="print the kept part B results")
    p.add_argument("--profile", choices=STEPS, help="run this step under cProfile at --sizes[0]")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument(
        "--texts", action="store_true", help="how compressible fleet's texts are vs real prose"
    )
    for name in ("--step", "--run-dir", "--out", "--result", "--url", "--writer"):  # a child's
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--spawn-t", type=float, help=argparse.SUPPRESS)
    p.add_argument("--profile-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.writer:
        return writer(Path(args.run_dir), Path(args.writer))
    if args.step:
        return child(args)
    if args.quick:
        args.budget_millions, args.sizes = 0.2, [2000, 10_000]
    if args.table_only:
        return table_only(args)
    if args.texts:
        return texts_check()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    problems = fleet.check_vocab()
    if problems:
        raise SystemExit(f"fleet.VOCAB is not one token per word for SmolLM2: {problems[:5]}")
    if args.profile:
        return profile(args)
    if args.part in ("a", "both"):
        part_a(args)
    if args.part in ("b", "both"):
        part_b(args)


if __name__ == "__main__":
    main()
