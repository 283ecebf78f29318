"""Prompt-length profiling at scale: kit.tokens.count_prompt_tokens vs a naive loop vs raw encoding.

    python bench/bench_tokens.py [--n 100000] [--naive 5000]

Builds N prompts (data/samples replicated when present, each copy made distinct by
prepending its copy number to its last turn, so no cache of any kind sees a repeat; else
synthetic multi-turn chats), then times, in one run, with the embedded model's tokenizer and chat template:
  kit     kit.tokens.count_prompt_tokens(tok, frame) on all N rows
  naive   len(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True)) per
          row, timed on --naive rows and extrapolated (the rate is what is compared)
  (and, for reference, kit with a template that trims contents: the per-row Jinja path)
  raw     the tokenizer's own batch encoding (Rust `encode_batch_fast` in chunks, both
          cores) of the pre-rendered prompts only, no template: what a hand-written batch
          pipeline pays
Goals: kit >= 10x naive, and kit within 2x of raw (kit's time <= 2x raw's).
kit's counts are asserted equal to the naive loop's on the naive rows and to raw's on all.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the model data token budget prompt python function return value list loop sample".split()


def sample_frame():
    """The prompt frame of data/samples, or None when there are none yet."""
    files = sorted(
        p
        for p in (ROOT / "data" / "samples").glob("*")
        if p.suffix in (".json", ".jsonl", ".parquet")
    )
    if not files:
        return None
    from kit.sources import load

    return load([str(p) for p in files]).frame


def synthetic_frame(n: int, seed: int = 0):
    """n synthetic chats: 1-3 user turns of 5-400 words, sometimes a system turn."""
    import polars as pl

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = rng.choice([1, 1, 1, 2, 3])
        messages = [{"role": "system", "content": "You are terse."}] if rng.random() < 0.2 else []
        for t in range(turns):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 400)))
            messages.append({"role": "user", "content": text})
            if t < turns - 1:
                messages.append(
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=40))}
                )
        rows.append({"dataset": f"syn{i % 4}", "prompt_id": f"{i:08x}", "messages": messages})
    return pl.DataFrame(rows)


def build(n: int):
    """N prompts and a label saying where they came from."""
    import polars as pl

    base = sample_frame()
    if base is None or base.height == 0:
        return synthetic_frame(n), "synthetic chats"
    reps = -(-n // base.height)
    copies = [base] + [distinct(base, r) for r in range(1, reps)]
    label = f"data/samples ({base.height} prompts) replicated, copies made distinct"
    return pl.concat(copies, how="vertical_relaxed").head(n), label


def distinct(frame, copy: int):
    """The frame with copy number `copy` prepended to every conversation's last turn."""
    import polars as pl

    def mark(messages):
        out = [dict(m) for m in messages]
        out[-1]["content"] = f"({copy}) {out[-1]['content']}"
        return out

    return frame.with_columns(pl.Series("messages", [mark(m) for m in frame["messages"].to_list()]))


def timed(fn):
    """(result, seconds) of fn()."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--naive", type=int, default=20_000, help="rows the naive loop is timed on")
    args = parser.parse_args()

    from kit import tokens
    from kit.serve import prepare_model

    tok = tokens.load_tokenizer(prepare_model())
    frame, origin = build(args.n)
    messages = frame["messages"].to_list()
    print(f"{frame.height:,} prompts from {origin}; tokenizer {type(tok).__name__}")

    tokens.count_prompt_tokens(tok, frame.head(200))  # warm caches (template compile)
    counted, t_kit = timed(lambda: tokens.count_prompt_tokens(tok, frame)["prompt_tokens"])
    total_tokens = int(counted.sum())

    subset = messages[: args.naive]

    def naive():
        return [
            len(
                tok.apply_chat_template(
                    m, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
            for m in subset
        ]

    naive_counts, t_naive = timed(naive)
    assert naive_counts == counted.head(len(subset)).to_list(), "kit and naive counts differ"

    texts, t_render = timed(lambda: tokens.render(tok, messages))
    _, t_raw_call = timed(lambda: tok(texts, add_special_tokens=False)["input_ids"])
    # the Rust batch encoder in 8,192-text chunks (faster than one 100K call here)
    raw_counts, t_raw_fast = timed(lambda: tokens._hf_lengths(tok, texts))
    assert raw_counts == counted.to_list(), "kit and raw counts differ"
    _, t_mirror = timed(lambda: tokens.encode_lengths(tok, texts))
    trimming = copy.deepcopy(tok)  # a template that edits content (Llama 3 trims): per-row Jinja
    trimming.chat_template = tok.get_chat_template().replace(
        "message['content']", "(message['content'] | trim)"
    )
    _, t_trim = timed(lambda: tokens.count_prompt_tokens(trimming, frame))
    t_raw = min(t_raw_call, t_raw_fast)

    rate = lambda rows, s: rows / s  # noqa: E731
    kit_rate, naive_rate = rate(frame.height, t_kit), rate(len(subset), t_naive)
    tok_per_row = total_tokens / frame.height
    print(f"{'method':<44}{'prompts/s':>12}{'tokens/s':>14}{'time (s)':>11}")
    for label, r, s in [
        ("kit count_prompt_tokens", kit_rate, t_kit),
        ("  part: render alone (compiled template)", rate(frame.height, t_render), t_render),
        (f"naive apply_chat_template loop ({len(subset):,} rows)", naive_rate, t_naive),
        ("  extrapolated to all rows", naive_rate, frame.height / naive_rate),
        ("raw tok(texts) on pre-rendered text", rate(frame.height, t_raw_call), t_raw_call),
        ("raw encode_batch_fast on pre-rendered text", rate(frame.height, t_raw_fast), t_raw_fast),
        ("  for reference: kit encode_lengths on them", rate(frame.height, t_mirror), t_mirror),
        ("for reference: kit, template that trims", rate(frame.height, t_trim), t_trim),
    ]:
        print(f"{label:<44}{r:>12,.0f}{r * tok_per_row:>14,.0f}{s:>11.2f}")
    print(
        f"total prompt tokens {total_tokens:,} (mean {tok_per_row:.1f}/prompt); "
        "counts equal naive on its rows and raw on all"
    )
    speedup, overhead = kit_rate / naive_rate, t_kit / t_raw
    print(f"kit / naive speed: {speedup:.1f}x (goal >= 10x) {'OK' if speedup >= 10 else 'MISSED'}")
    print(
        f"kit time / raw encoding time: {overhead:.2f}x (goal <= 2x) {'OK' if overhead <= 2 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
