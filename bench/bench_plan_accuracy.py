"""Does the plan predict what a real budgeted run needs? Pilot, plan, run, compare.

    python bench/bench_plan_accuracy.py [--url http://127.0.0.1:PORT/v1 --model NAME]
                                        [--budget 3000] [--max-tokens 128] [--pilot-share 0.1]

On the embedded server (started here unless --url is given): for 4 sample datasets,
pilot ~10% of the samples each budget needs (its size guessed from max_tokens / 2, at
least 5), plan with kit.plan.budget, then a real budgeted run with kit.generate. The
actual samples a dataset needed is the smallest k such that its first k records (in
arrival order) reach the budget. Prints predicted vs actual per dataset and the error %;
goal: within 15% for every dataset. Takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ["alpaca_tasks", "chat_general", "code_instruct", "math_word"]


def load_prompts():
    """The 4 benchmark datasets from data/samples."""
    import polars as pl

    from kit.sources import load

    files = sorted(
        p
        for p in (ROOT / "data" / "samples").glob("*")
        if p.suffix in (".json", ".jsonl", ".parquet")
    )
    frame = load([str(p) for p in files]).frame
    return frame.filter(pl.col("dataset").is_in(DATASETS))


def actual_samples_needed(records, budget: int) -> int | None:
    """Smallest k whose first k records (by arrival) reach the budget; None if never."""
    import polars as pl

    tokens = records.sort("t_done")["completion_tokens"].cum_sum()
    hit = tokens.to_frame("c").with_row_index().filter(pl.col("c") >= budget)
    return int(hit["index"][0]) + 1 if hit.height else None


async def run(args, url: str, model: str) -> None:
    import polars as pl

    from kit import plan
    from kit.generate import generate
    from kit.store import records_frame
    from kit.types import Sampling

    prompts = load_prompts()
    sampling = Sampling(max_tokens=args.max_tokens)
    per = max(5, math.ceil(args.pilot_share * args.budget / (args.max_tokens / 2)))
    res = await plan.pilot(
        prompts, url, model=model, per_dataset=per, sampling=sampling, concurrency=8
    )
    print(f"pilot: {per} prompts/dataset, {res.frame.height} completions, {len(res.errors)} errors, "
          f"{res.tokens_per_s:.0f} tok/s, {res.wall_s:.0f} s")  # fmt: skip
    for line in res.errors[:3]:
        print("  pilot error:", line)
    budgets = dict.fromkeys(DATASETS, args.budget)
    table = plan.budget(budgets, res, prompts_available=prompts, max_tokens=args.max_tokens)
    means = {r["dataset"]: r["mean"] for r in table.iter_rows(named=True)}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        await generate(
            prompts, run_dir=run_dir, model=model, endpoints=url, budgets=budgets, sampling=sampling,
            concurrency=8, expected_tokens={d: means[d] for d in DATASETS}, seed=1,
            timeout=args.timeout,
        )  # fmt: skip
        records = records_frame(run_dir)
    print(
        f"{'dataset':<16}{'pilot n':>8}{'mean':>8}{'predicted':>11}{'upper':>8}{'actual':>8}{'error':>9}"
    )
    worst = 0.0
    for r in table.filter(pl.col("dataset") != plan.TOTAL).iter_rows(named=True):
        actual = actual_samples_needed(
            records.filter(pl.col("dataset") == r["dataset"]), args.budget
        )
        err = (r["samples_needed"] - actual) / actual if actual else float("nan")
        worst = max(worst, abs(err)) if actual else math.inf
        print(f"{r['dataset']:<16}{r['n_pilot']:>8}{r['mean']:>8.1f}{r['samples_needed']:>11}"
              f"{r['samples_needed_upper'] or 0:>8}{actual or 'n/a':>8}{err:>9.1%}")  # fmt: skip
    print(f"worst error {worst:.1%} (goal <= 15%) {'OK' if worst <= 0.15 else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--model")
    parser.add_argument("--budget", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pilot-share", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    parser.add_argument("--temperature", type=float, default=0.7, help="of a server started here")
    args = parser.parse_args()
    if args.url:
        asyncio.run(run(args, args.url, args.model))
        return
    from kit.serve import start

    with start(temperature=args.temperature) as server:
        print(f"embedded server at {server.base_url} (temperature {args.temperature})")
        asyncio.run(run(args, server.base_url, server.model))


if __name__ == "__main__":
    main()
