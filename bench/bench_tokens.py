"""Prompt-token counting at scale: kit.tokens.count_prompt_tokens vs the tokenizer alone.

    python bench/bench_tokens.py [--n 100000] [--check 2000] [--repeat 2]

Builds N distinct prompts (data/samples replicated, each copy marked by prepending its
copy number to its last turn, so no cache of any kind sees a repeat), then times, with
the embedded model's tokenizer and chat template, both starting from the same polars frame:
  kit   kit.tokens.count_prompt_tokens(tok, frame)
  raw   what a user writes with the tokenizer alone:
        convs = frame["messages"].to_list()
        texts = tok.apply_chat_template(convs, tokenize=False, add_generation_prompt=True)
        [len(e) for e in tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
Each run is a fresh process (frame built, tokenizer loaded and warmed up, then the method
timed once); the methods alternate --repeat times and the best time counts. Peak RSS is
that process's high-water mark while the method runs (whole process, frame included).
Asserts kit's counts equal raw's on all rows, and equal
len(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True)) on --check rows
spread over the frame. Goal: kit's time within 1.3x raw's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data" / "models" / "SmolLM2-135M-Instruct"
GOAL = 1.3


def build(n: int):
    """N distinct prompts: data/samples replicated, copy r's last turns prefixed "(r) " (in polars)."""
    import polars as pl

    import kit

    base = kit.load(str(ROOT / "data" / "samples")).frame
    if base.height == 0:
        raise SystemExit("data/samples has no prompts")

    def marked(r: int):
        last = pl.int_range(pl.len()) == pl.len() - 1
        content = pl.field("content")
        content = pl.when(last).then(pl.lit(f"({r}) ") + content).otherwise(content)
        edit = pl.element().struct.with_fields(content.alias("content"))
        return base.with_columns(pl.col("messages").list.eval(edit))

    copies = [base] + [marked(r) for r in range(1, -(-n // base.height))]
    return pl.concat(copies).head(n), base.height


def peak_rss_mb() -> float:
    """The process's peak RSS in MB since the last reset_peak()."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> None:
    """Reset the peak RSS to the current RSS (Linux); a no-op elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def child(method: str, n: int, out: str) -> None:
    """One timed run of one method in this (fresh) process; results as JSON to `out`."""
    from kit import tokens

    tok = tokens.load_tokenizer(MODEL)
    frame, _ = build(n)

    def kit_counts():
        return tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()

    def raw_counts():
        convs = frame["messages"].to_list()
        texts = tok.apply_chat_template(convs, tokenize=False, add_generation_prompt=True)
        enc = tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [len(e) for e in enc]

    tokens.count_prompt_tokens(tok, frame.head(100))  # warm up: template compile, thread pool
    before = peak_rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    counts = {"kit": kit_counts, "raw": raw_counts}[method]()
    seconds = time.perf_counter() - t0
    doc = {"seconds": seconds, "peak_mb": peak_rss_mb(), "before_mb": before, "counts": counts}
    Path(out).write_text(json.dumps(doc))


def run(method: str, n: int) -> dict:
    """child(method) in a fresh interpreter; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--n", str(n), "--child", method, "--out", str(out)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--check", type=int, default=2_000, help="rows checked one by one")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", choices=["kit", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.n, args.out)

    from kit import tokens

    if not MODEL.is_dir():  # convert the bundled GGUF once (kit.serve)
        from kit.serve.server import prepare_model

        prepare_model()
    tok = tokens.load_tokenizer(MODEL)
    frame, n_base = build(args.n)
    print(
        f"{frame.height:,} distinct prompts ({n_base} from data/samples, replicated and marked); "
        f"tokenizer {type(tok).__name__}, {os.cpu_count()} cores; best of {args.repeat} runs each"
    )
    runs: dict[str, list[dict]] = {"kit": [], "raw": []}
    for _ in range(args.repeat):
        for name in runs:
            runs[name].append(run(name, args.n))
    counts = runs["kit"][0]["counts"]
    assert all(r["counts"] == counts for rs in runs.values() for r in rs), "kit and raw differ"

    step = max(1, frame.height // args.check)
    rows = list(range(0, frame.height, step))[: args.check]
    for i, m in zip(rows, frame["messages"].gather(rows).to_list(), strict=True):
        out = tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out  # a BatchEncoding in transformers 5
        assert counts[i] == len(ids), f"row {i}: kit {counts[i]} != {len(ids)}"

    total = sum(counts)
    print(
        f"{'method':<26}{'time (s)':>9}{'prompts/s':>11}{'tokens/s':>11}{'peak RSS MB':>13}{'(before)':>10}"
    )
    best = {}
    for name, label in (("kit", "kit count_prompt_tokens"), ("raw", "raw tokenizer alone")):
        best[name] = min(r["seconds"] for r in runs[name])
        peak = max(r["peak_mb"] for r in runs[name])
        before = max(r["before_mb"] for r in runs[name])
        print(
            f"{label:<26}{best[name]:>9.2f}{frame.height / best[name]:>11,.0f}"
            f"{total / best[name]:>11,.0f}{peak:>13,.0f}{before:>10,.0f}"
        )
    print(
        "  all runs (s): "
        + "; ".join(
            f"{name} " + " ".join(f"{r['seconds']:.2f}" for r in rs) for name, rs in runs.items()
        )
    )
    ratio = best["kit"] / best["raw"]
    print(
        f"total prompt tokens {total:,} (mean {total / frame.height:.1f}); counts equal raw on "
        f"all rows and apply_chat_template(tokenize=True) on {len(rows):,} spread rows"
    )
    print(f"kit / raw time: {ratio:.2f}x (goal <= {GOAL}x) {'OK' if ratio <= GOAL else 'MISSED'}")


if __name__ == "__main__":
    main()
