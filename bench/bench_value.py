"""Regeneration value's cost: the pilot with and without the measurement on the embedded vLLM.

Runs the same pilot twice on data/samples (one server): without the measurement, then with
it, each dataset's own answers being the first pilot's answers to the same prompts when the
loaded prompts carry none (kit.load's `answer` column). Prints each pilot's time and
requests and the ratio; target: the measurement adds at most 30% to the pilot's time.

    python bench/bench_value.py [--per-dataset 16] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import polars as pl

import kit
from kit.plan.value import ANSWER, value_text
from kit.run.reader import record_batches

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-dataset", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    frame = kit.load(ROOT / "data/samples").frame
    server = kit.serve.start(engine="vllm", temperature=0.7)
    try:
        config = kit.RunConfig(
            model=server.model,
            endpoints=server.base_url,
            api=server.api,
            budgets=1,
            sampling=kit.Sampling(max_tokens=args.max_tokens),
            tokenizer=server.tokenizer_path,
            concurrency=args.concurrency,
        )
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            off = kit.plan.pilot_sync(
                frame, config, per_dataset=args.per_dataset, run_dir=Path(tmp) / "off", value=False
            )
            off_s = time.perf_counter() - t0
            own = "dataset's own"
            if ANSWER not in frame.columns or frame[ANSWER].is_null().all():
                own = "the first pilot's (no own answers loaded)"
                answers = pl.concat(
                    record_batches(
                        Path(tmp) / "off", columns=["dataset", "prompt_id", "completion"]
                    )
                )
                frame = frame.drop(ANSWER, strict=False).join(
                    answers.rename({"completion": ANSWER}), on=["dataset", "prompt_id"], how="left"
                )
            t0 = time.perf_counter()
            on = kit.plan.pilot_sync(frame, config, per_dataset=args.per_dataset)
            on_s = time.perf_counter() - t0
    finally:
        server.stop()
    req_off = off.frame.height + len(off.errors)
    scoring = int(on.value["requests"].fill_null(0).sum())
    print(value_text(on.value))
    print(f"answers scored: {own}")
    print(f"pilot without the measurement: {off_s:,.1f} s, {req_off} requests")
    print(
        f"pilot with it: {on_s:,.1f} s ({on.wall_s:,.1f} s completions + {on.value_s:,.1f} s "
        f"scoring), {on.frame.height + len(on.errors)} + {scoring} requests"
    )
    ratio = on_s / off_s
    print(
        f"ratio with/without: {ratio:.2f}x ({(ratio - 1):+.0%}; scoring alone "
        f"{on.value_s / on.wall_s:+.0%} of the completions' time; target <= +30%)"
    )


if __name__ == "__main__":
    main()
