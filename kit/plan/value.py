"""Regeneration value, measured in the pilot: how far each dataset's own answers are from the target's.

For each pilot prompt with the dataset's own answer (kit.load's `answer` column), the server
scores that answer as the assistant turn of the prompt rendered by kit.tokens.render: the
target's log-probability of each token and whether it is the target's top-1 there
(kit.run.backends.score: one prefill per answer, after the pilot's completions). The
pilot's own answers come with the same two numbers from the server as it writes them
(kit.run.backends.own_logprobs: each sampled token's logprob and the top-1, asked with the
completions, which changes no sampling, count or record); an answer the server gave none
for is scored by a prefill like the dataset's. Both are the target's raw distribution at
each position (vLLM's default logprobs_mode; SGLang's only at temperature 0 or 1, else
prefilled), so one method: on the embedded vLLM a pilot answer scored back by prefill
matches its returned logprobs within AGREE nats a token (0.05 on average) and on the same
top-1 tokens but for near-ties, at most 5% (tests/test_value.py). Per dataset: mean
log-probability per token of both sides and the share of the dataset's answer tokens that
are the target's top-1, each with a 90% percentile bootstrap interval over the pilot's
prompts (token-weighted: the resampled unit is a prompt). A proxy for how much
regenerating buys, not an acceptance length.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kit.errors import BackendError, NoScoring

if TYPE_CHECKING:
    from pathlib import Path

    import polars as pl

    from kit.types import RunConfig

ANSWER = "answer"  # kit.load's column of the dataset's own answer (null when none)
LEVEL = 0.90
RESAMPLES = 2000
# gap = target's minus the dataset's mean log-probability per token (nats); the reading's bounds
CLOSE, FAR = 0.5, 1.5
NO_ANSWERS = "no own answers"
# nats: a prefill and the decode that wrote the same token agree this closely, token by
# token (two steps of bf16 logits, 1/8 each at the embedded model's), and on average within
# 0.05 (tests/test_value.py holds the embedded vLLM to both)
AGREE = 0.25
SCHEMA = """dataset:String status:String prompts:Int64 tokens:Int64 cut:Int64 failed:Int64 requests:Int64
    own_logprob:Float64 own_logprob_lo:Float64 own_logprob_hi:Float64
    target_logprob:Float64 target_logprob_lo:Float64 target_logprob_hi:Float64
    own_top1:Float64 own_top1_lo:Float64 own_top1_hi:Float64 target_top1:Float64 reading:String"""


def schema() -> dict:
    """The value frame's columns: name -> polars dtype."""
    import polars as pl

    return {n: getattr(pl, t) for n, t in (c.split(":") for c in SCHEMA.split())}


async def measure(
    chosen: pl.DataFrame, run_dir: Path, config: RunConfig, own: dict | None = None
) -> pl.DataFrame:
    """Score the chosen prompts' own answers and the pilot's answers to them; a row per dataset.

    Args:
        chosen: the pilot's prompts (dataset, prompt_id, messages, tools?, answer?).
        run_dir: the pilot's run directory (its records: the target's answers).
        config: the run's config (endpoints, api, model, tokenizer, max_context, concurrency).
        own: the logprobs the server returned with the pilot's answers (own_logprobs()'s
            dict); an answer not in it is scored by a request.

    Returns:
        The SCHEMA frame: status "measured", "no own answers" or "not measured: <why>"
        (its numbers null, never zeros), prompts scored, answer tokens, answers cut to the
        context, failed scorings, the three measures with their 90% bounds, a reading.
    """
    import polars as pl

    names = sorted(set(chosen["dataset"].to_list()))
    has = chosen.filter(pl.col(ANSWER).is_not_null()) if ANSWER in chosen.columns else chosen[:0]
    with_own = set(has["dataset"].to_list())
    status = {d: NO_ANSWERS for d in names if d not in with_own}
    rows: dict[str, dict] = {}
    if with_own:
        why = None if config.tokenizer else "no tokenizer (RunConfig.tokenizer) to render with"
        try:
            rows = {} if why else await _score_all(has, _answers(run_dir), config, own or {})
        except NoScoring as err:
            why = str(err)
        for d in with_own:
            status[d] = f"not measured: {why}" if why else status.get(d, "measured")
    out = [_row(d, status[d], rows.get(d)) for d in names]
    return pl.DataFrame(out, schema=schema())


def _answers(run_dir: Path) -> pl.DataFrame:
    """The pilot's records: the columns the target's side is scored from."""
    import polars as pl

    from kit.run.reader import record_batches
    from kit.types import record_columns

    names = record_columns(
        "dataset", "prompt_id", "output_ids", "prompt_ids", "completion", "finish_reason"
    )
    parts = list(record_batches(run_dir, columns=list(names)))
    return (
        pl.concat(parts, how="vertical_relaxed")
        if parts
        else pl.DataFrame(schema=dict.fromkeys(names, pl.String))
    )


async def _score_all(
    has: pl.DataFrame, records: pl.DataFrame, config: RunConfig, own: dict
) -> dict:
    """dataset -> {"own": [(prompt_id, logprobs, top1)], "target": [...], cut, failed}."""
    from kit.run.backends import make_backend, score

    tok_path = config.tokenizer
    backends = [
        make_backend(
            config.api, url, config.model, api_key_env=config.api_key_env, tokenizer=tok_path
        )
        for url in config.endpoints
    ]
    try:
        context = await _context(backends[0], config)
        jobs = _jobs(has, records, config, context, own)
        gate = asyncio.Semaphore(max(1, config.concurrency))

        async def one(i: int, job: dict):
            async with gate:
                try:
                    got = await score(
                        backends[i % len(backends)],
                        job["prompt"],
                        job["answer"],
                        timeout=config.timeout or 120.0,
                    )
                except BackendError as err:
                    if isinstance(err, NoScoring):
                        raise
                    return job, err
                return job, got

        first = jobs["jobs"][:1]  # alone: a server that cannot score says so once
        done = [await one(0, job) for job in first]
        done += await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs["jobs"][1:], 1)))
    finally:
        for b in backends:
            await b.aclose()
    out: dict[str, dict] = {}
    for job, got in done:
        entry = out.setdefault(job["dataset"], {"own": [], "target": [], "cut": 0, "failed": 0})
        entry["requests"] = entry.get("requests", 0) + 1
        if isinstance(got, BackendError):
            entry["failed"] += 1
            entry.setdefault("error", f"{type(got).__name__}: {got}")
            continue
        entry[job["side"]].append((job["prompt_id"], *got))
    for dataset, prompt_id, got in jobs["returned"]:
        entry = out.setdefault(dataset, {"own": [], "target": [], "cut": 0, "failed": 0})
        entry["target"].append((prompt_id, *got))
    for d, cut in jobs["cut"].items():
        out.setdefault(d, {"own": [], "target": [], "cut": 0, "failed": 0})["cut"] = cut
    for d, n in jobs["failed"].items():
        entry = out.setdefault(d, {"own": [], "target": [], "cut": 0, "failed": 0})
        entry["failed"] += n
        entry.setdefault("error", "the chat template could not render the prompt")
    return out


async def _context(backend: Any, config: RunConfig) -> int | None:
    """The target's context: config.max_context, else the server's max_model_len (vLLM's
    /models lists it), else the tokenizer folder's (kit.run.guard.model_context)."""
    from kit.run.guard import model_context

    if config.max_context:
        return config.max_context
    doc = await backend.get_json(backend.url + "/models")
    listed = doc.get("data") if isinstance(doc, dict) else None
    for entry in listed if isinstance(listed, list) else []:
        value = entry.get("max_model_len") if isinstance(entry, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return model_context(config.tokenizer)


def _jobs(
    has: pl.DataFrame, records: pl.DataFrame, config: RunConfig, context: int | None, own: dict
) -> dict:
    """The scoring requests: each prompt rendered once (kit.tokens.render), its own answer
    (text ids + the end-of-turn token, as the target ends its own) and each pilot answer
    the server returned no logprobs for (its output_ids, else the text's ids), cut to fit
    the context; "returned": (dataset, prompt_id, (logprobs, top1)) of the others."""
    from kit.tokens import encode_many, load_tokenizer, render

    tok = load_tokenizer(config.tokenizer)
    tools = has["tools"].to_list() if "tools" in has.columns else None
    kwargs = [config.sampling_for(d).chat_template_kwargs for d in has["dataset"].to_list()]
    prompts = render(
        tok,
        has["messages"].to_list(),
        tools=tools,
        template_kwargs=kwargs,
        tokenize=True,
        on_error="skip",  # a prompt the template refuses: counted as failed, not scored
    )
    eos = [tok.eos_token_id] if isinstance(getattr(tok, "eos_token_id", None), int) else []
    theirs = [ids + eos for ids in encode_many(tok, has[ANSWER].to_list())]
    keyed = {k: i for i, k in enumerate(has.select("dataset", "prompt_id").iter_rows())}
    answers = [(i, "own", a) for i, a in enumerate(theirs)]
    returned, scored = [], []  # pilot answers with the server's logprobs / to be prefilled
    for r in records.rows(named=True):
        i = keyed.get((r["dataset"], r["prompt_id"]))
        got = own.get((tuple(r.get("prompt_ids") or ()), tuple(r.get("output_ids") or ())))
        if i is not None and got is not None and prompts[i] is not None:
            returned.append((r["dataset"], r["prompt_id"], got))
        elif i is not None:
            scored.append((i, r))
    texts = [r.get("completion") or "" for _, r in scored if not r.get("output_ids")]
    encoded = iter(encode_many(tok, texts) if texts else [])  # only answers without ids
    for i, r in scored:
        end = eos if r.get("finish_reason") == "stop" else []
        answers.append((i, "target", r.get("output_ids") or next(encoded) + end))
    jobs, cut, failed = [], {}, {}
    for i, side, answer in answers:
        dataset, prompt_id = has["dataset"][i], has["prompt_id"][i]
        if prompts[i] is None:
            failed[dataset] = failed.get(dataset, 0) + 1
            continue
        room = (context - len(prompts[i]) - 1) if context else len(answer)
        if room < len(answer):
            cut[dataset] = cut.get(dataset, 0) + (side == "own")
            answer = answer[: max(room, 0)]
        if answer:
            jobs.append(
                {
                    "dataset": dataset,
                    "prompt_id": prompt_id,
                    "side": side,
                    "prompt": prompts[i],
                    "answer": answer,
                }
            )
    return {"jobs": jobs, "cut": cut, "failed": failed, "returned": returned}


def _row(dataset: str, status: str, got: dict | None) -> dict:
    """The SCHEMA row of one dataset."""
    row = dict.fromkeys(schema(), None) | {"dataset": dataset, "status": status}
    if got is None or status != "measured":
        return row | {"reading": status}
    own, target = _per_prompt(got["own"]), _per_prompt(got["target"])
    row.update(
        prompts=len(own), tokens=sum(n for _, n, _ in own), cut=got["cut"], failed=got["failed"]
    )
    row["requests"] = got.get("requests", 0)
    if not own:
        why = got.get("error", "no answer could be scored")
        return row | {"status": f"not measured: {why}", "reading": f"not measured: {why}"}
    lp, lo, hi = interval(own, 0)
    top, tlo, thi = interval(own, 2)
    row.update(own_logprob=lp, own_logprob_lo=lo, own_logprob_hi=hi)
    row.update(own_top1=top, own_top1_lo=tlo, own_top1_hi=thi)
    if target:
        t, t_lo, t_hi = interval(target, 0)
        row.update(target_logprob=t, target_logprob_lo=t_lo, target_logprob_hi=t_hi)
        row["target_top1"] = interval(target, 2)[0]
    return row | {"reading": reading(row)}


def _per_prompt(scored: list) -> list[tuple[float, int, float]]:
    """(sum of log-probabilities, tokens, tokens that are top-1) per prompt (samples summed)."""
    by: dict[str, list] = {}
    for prompt_id, logprobs, top1 in scored:
        s = by.setdefault(prompt_id, [0.0, 0, 0])
        s[0] += sum(logprobs)
        s[1] += len(logprobs)
        s[2] += sum(top1)
    return [tuple(v) for _, v in sorted(by.items())]


def interval(per_prompt: list, column: int, *, seed: int = 0) -> tuple[float, float, float]:
    """(ratio, lo, hi): sum(column) / sum(tokens) over prompts, with its 90% percentile
    bootstrap interval (RESAMPLES resamples of the prompts, seeded).

    Example:
        >>> interval([(-2.0, 4, 3), (-6.0, 4, 1)], 0)
        (-1.0, -1.5, -0.5)
    """
    import numpy as np

    values = np.array([p[column] for p in per_prompt], dtype=float)
    tokens = np.array([p[1] for p in per_prompt], dtype=float)
    point = float(values.sum() / tokens.sum())
    if len(per_prompt) < 2:
        return point, None, None
    picks = np.random.default_rng(seed).integers(0, len(values), (RESAMPLES, len(values)))
    ratios = values[picks].sum(axis=1) / tokens[picks].sum(axis=1)
    lo, hi = np.quantile(ratios, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return point, round(float(lo), 6), round(float(hi), 6)


def reading(row: dict) -> str:
    """One line on a measured dataset: the gap to the target's own answers, read by CLOSE/FAR.

    Example:
        >>> reading({"own_logprob": -2.6, "target_logprob": -0.6, "own_top1": 0.41, "target_top1": 0.8})
        "far from the target's (2.00 nats/token below its own; 41% top-1 vs 80%): regenerate"
    """
    own, target = row["own_logprob"], row.get("target_logprob")
    share = f"{row['own_top1']:.0%} top-1"
    if target is None:
        return f"own answers: {own:.2f} nats/token, {share} (no pilot answer to compare with)"
    gap = target - own
    versus = f" vs {row['target_top1']:.0%}" if row.get("target_top1") is not None else ""
    what = f"{abs(gap):.2f} nats/token {'below' if gap >= 0 else 'above'} its own; {share}{versus}"
    if gap <= CLOSE:
        return f"own answers close to the target's ({what}): regeneration buys little"
    if gap <= FAR:
        return f"own answers apart from the target's ({what}): regeneration helps"
    return f"far from the target's ({what}): regenerate"


def value_text(frame: pl.DataFrame) -> str:
    """The value frame as plain text: a line per dataset (`kit plan`, 01_plan, show_plan).

    Example:
        >>> print(value_text(pl.DataFrame([{"dataset": "a", "status": "no own answers"}])))
        regeneration value (own answers scored by the target; 90% bootstrap over prompts):
          a: no own answers
    """
    lines = ["regeneration value (own answers scored by the target; 90% bootstrap over prompts):"]
    for r in frame.iter_rows(named=True):
        if r["status"] != "measured":
            lines.append(f"  {r['dataset']}: {r['status']}")
            continue
        t = r.get("target_logprob")
        failed = f", {r['failed']} failed" if r["failed"] else ""
        lines.append(
            f"  {r['dataset']}: own {_ci(r, 'own_logprob')} nats/token, target's "
            f"{'-' if t is None else _ci(r, 'target_logprob')}; own top-1 {_ci(r, 'own_top1', pct=True)}"
            f" ({r['prompts']} prompts, {r['tokens']} tokens, {r['cut']} cut to the context"
            f"{failed})"
        )
        lines.append(f"    {r['reading']}")
    return "\n".join(lines)


def _ci(row: dict, name: str, *, pct: bool = False) -> str:
    """ "-1.23 [-1.40, -1.10]" (or percentages)."""
    fmt = (lambda v: f"{v:.0%}") if pct else (lambda v: f"{v:.2f}")
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    bounds = f" [{fmt(lo)}, {fmt(hi)}]" if lo is not None and hi is not None else ""
    return fmt(row[name]) + bounds


def join_value(table: pl.DataFrame, value: pl.DataFrame | None) -> pl.DataFrame:
    """The plan table with each dataset's value columns (own_logprob, target_logprob,
    own_top1 and bounds, value: the reading); the table unchanged without a value frame."""
    if value is None or value.is_empty():
        return table
    keep = [c for c in value.columns if c.startswith(("own_", "target_"))]
    extra = value.select("dataset", *keep, value="reading")
    table = table.drop([c for c in extra.columns if c != "dataset"], strict=False)
    return table.join(extra, on="dataset", how="left", maintain_order="left")


def chart(frame: pl.DataFrame):
    """Mean log-probability per token, the dataset's answers vs the target's, with their
    90% intervals, one row per measured dataset (altair); None when no dataset was measured
    (value_text says why), so a notebook draws no empty chart."""
    import altair as alt
    import polars as pl

    rows = []
    for r in frame.filter(pl.col("status") == "measured").iter_rows(named=True):
        for side, name in (
            ("dataset's answers", "own_logprob"),
            ("target's answers", "target_logprob"),
        ):
            if r[name] is not None:
                rows.append(
                    {
                        "dataset": r["dataset"],
                        "answers": side,
                        "logprob": r[name],
                        "lo": r[f"{name}_lo"],
                        "hi": r[f"{name}_hi"],
                    }
                )
    data = pl.DataFrame(
        rows,
        schema={
            "dataset": pl.String,
            "answers": pl.String,
            "logprob": pl.Float64,
            "lo": pl.Float64,
            "hi": pl.Float64,
        },
    )
    if data.is_empty():
        return None
    base = alt.Chart(data).encode(
        y=alt.Y("dataset:N", title=None),
        color=alt.Color("answers:N", title=None),
        yOffset="answers:N",
    )
    bars = base.mark_rule().encode(
        x=alt.X("lo:Q", title="mean log-probability per token (nats)"), x2="hi:Q"
    )
    points = base.mark_point(filled=True).encode(
        x="logprob:Q", tooltip=["dataset", "answers", "logprob", "lo", "hi"]
    )
    return (bars + points).properties(title="regeneration value: own answers vs the target's")
