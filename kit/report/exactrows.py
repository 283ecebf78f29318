"""Token-id rows of a batch of records in polars: the exact rows (tokenrows._server_row's,
built without a Python int per id) of records with both id lists, counted by the server's
ids and turns "last_turn"; every other row is tokenrows.token_rows'.

Checked on a stated sample (the manifest's `token_checks`): the first CHECK_SAMPLE eligible
rows of each dataset in commit order (a seeded random draw of prompts) have their ids
checked against the text (kit.tokens.ids_spell; else re-tokenized, "ids_text_differ"; a
dataset with one such row is then checked in full) and their prompt rendered by kit and
compared with prompt_ids ("prompt_render_differs").
"""

from __future__ import annotations

from kit.report.convo import conversation, first_breaks, json_text, row_ids, tools_of
from kit.report.tokenrows import end_of_turn, token_rows
from kit.tokens import encode_many, ids_spell_batch, render
from kit.types import STOPS

CHECK_SAMPLE = 500  # eligible rows per dataset whose ids are decoded and prompt rendered (as the audit samples)


class Checks:
    """What the sampled checks saw, per dataset, over one export's batches."""

    def __init__(self) -> None:
        self.candidates: dict[str, int] = {}  # dataset -> rows with the server's ids
        self.decoded: dict[str, int] = {}  # dataset -> rows whose ids were decoded
        self.rendered: dict[str, int] = {}  # dataset -> rows whose prompt was rendered
        self.full: set[str] = set()  # datasets whose ids are decoded on every row

    def section(self) -> dict:
        """The manifest's token_checks: rows seen by each check, per dataset, and how."""
        return {
            "how": (
                f"the first {CHECK_SAMPLE:,} rows with the server's ids of each dataset (commit "
                "order, a seeded random draw of its prompts): output_ids decoded and checked "
                "against the text, prompt_ids compared with kit's rendering of the prompt; a "
                "dataset where one sampled row's ids do not spell its text is decoded in full"
            ),
            "per_dataset": {
                d: {
                    "exact_candidates": n,
                    "ids_decoded": self.decoded.get(d, 0),
                    "prompt_rendered": self.rendered.get(d, 0),
                    "decoded_all": d in self.full,
                }
                for d, n in sorted(self.candidates.items())
            },
        }


def first_rows(frame, seen: dict[str, int], size: int, full=frozenset()):
    """Per row of `frame` (a batch): whether it is inside its dataset's first `size` rows
    over the batches (`seen`: dataset -> rows taken before), or of a dataset in `full`."""
    import polars as pl

    left = {d: (1 << 62) if d in full else size - seen.get(d, 0) for d in frame["dataset"].unique()}
    rank = frame.select(pl.int_range(pl.len()).over("dataset")).to_series().to_numpy()
    return rank < frame["dataset"].replace_strict(left, return_dtype=pl.Int64).to_numpy()


def widening_sample(frame, seen: dict[str, int], full: set[str], size: int, check):
    """Run `check` (rows -> a bool per row, True: a finding) on each dataset's first `size`
    rows (first_rows) and, once a dataset has a finding, on all its rows, in this batch and
    later ones (`full` gains it). `seen` and `full` are updated. Per row: its finding, False
    where it was not checked."""
    import numpy as np
    import polars as pl

    found = np.zeros(frame.height, dtype=bool)
    done = np.zeros(frame.height, dtype=bool)
    while frame.height:
        pick = first_rows(frame, seen, size, full) & ~done
        if not pick.any():
            break
        rows = frame.filter(pl.Series(pick))
        hits = np.asarray(check(rows), dtype=bool)
        found[np.flatnonzero(pick)] = hits
        done |= pick
        for d, n in rows["dataset"].value_counts().iter_rows():
            seen[d] = seen.get(d, 0) + n
        new = set(rows.filter(pl.Series(hits))["dataset"].to_list()) - full
        if not new:
            break
        full |= new
    return found


def token_columns(
    tok, frame, stats: dict, by_dataset: dict, checks: Checks, *, turns: str, kwargs_for, fetch=None
):
    """A batch of records (with prompts, kit.run.reader) -> (the rows made, with input_ids,
    loss_mask and ids_source columns, in the batch's order; rows the template cannot split,
    left out). stats / by_dataset: as tokenrows.token_rows counts them (updated in place).
    fetch: rows -> the rows with their prompts (`messages`, `tools`), for a batch read
    without them: only the rows that use a prompt's text read it (the exact rows' sampled
    checks, the re-tokenized rows); the rows made come without them."""
    import polars as pl

    given = set(frame.columns)
    fetch = fetch or (lambda rows: rows)

    c = pl.col
    frame = frame.with_row_index("_i")
    has = lambda n: c(n).is_not_null() & (c(n).list.len() > 0)  # noqa: E731
    counted = c("count_source").is_null() | (c("count_source") == "server_ids")
    ok = has("prompt_ids") & has("output_ids") & counted & pl.lit(turns != "all_turns")
    frame = frame.with_columns(_ok=ok)
    cand = frame.filter(c("_ok"))
    bad = _ids_do_not_spell(tok, cand, checks)
    exact = cand.filter(~bad)
    _check_prompts(tok, exact, checks, by_dataset, kwargs_for, fetch)
    parts = [_exact(tok, exact, stats, by_dataset)]
    rest = pl.concat([frame.filter(~c("_ok")), cand.filter(bad)]).sort("_i")
    if rest.height:
        rest = fetch(rest)
        made = token_rows(
            tok, rest.to_dicts(), stats, by_dataset, turns=turns, kwargs_for=kwargs_for
        )
        keep = pl.Series([m is not None for m in made], dtype=pl.Boolean)
        rows = [m for m in made if m is not None]
        parts.append(
            rest.filter(keep).with_columns(
                input_ids=pl.Series([r["input_ids"] for r in rows], dtype=pl.List(pl.Int64)),
                loss_mask=pl.Series([r["loss_mask"] for r in rows], dtype=pl.List(pl.Int8)),
                ids_source=pl.Series([r["ids_source"] for r in rows], dtype=pl.String),
            )
        )
    out = pl.concat(parts, how="diagonal_relaxed").sort("_i").drop("_i", "_ok")
    out = out.drop([n for n in ("messages", "tools") if n not in given], strict=False)
    return out, frame.height - out.height


def _ids_do_not_spell(tok, cand, checks: Checks):
    """Per eligible row: True when it was decoded and its ids do not spell its text
    (kit.tokens.ids_spell)."""
    import polars as pl

    for ds, n in cand["dataset"].value_counts().iter_rows():
        checks.candidates[ds] = checks.candidates.get(ds, 0) + n

    def wrong(rows):
        cols = [rows[c] if c in rows.columns else None for c in ("reasoning", "tool_calls")]
        ids = id_arrays(rows["output_ids"])
        spelled = ids_spell_batch(tok, ids, rows["completion"], *cols, rows["finish_reason"])
        return [not ok for ok in spelled]

    return pl.Series(widening_sample(cand, checks.decoded, checks.full, CHECK_SAMPLE, wrong))


def _check_prompts(tok, exact, checks: Checks, by_dataset: dict, kwargs_for, fetch) -> None:
    """Sampled rows: the server's prompt_ids against kit's rendering of the prompt, tokenized
    (prompt_render_differs counts the rows that differ; the server's ids stay the row)."""
    import polars as pl

    if not exact.height:
        return
    keep = first_rows(exact, checks.rendered, CHECK_SAMPLE)
    rows = (
        fetch(exact.filter(pl.Series(keep)))
        .select("dataset", "messages", "tools", "prompt_ids")
        .to_dicts()
    )
    for r, differs in zip(rows, prompt_ids_differ(tok, rows, kwargs_for), strict=True):
        checks.rendered[r["dataset"]] = checks.rendered.get(r["dataset"], 0) + 1
        if differs:
            ds = by_dataset.setdefault(r["dataset"], {})
            ds["prompt_render_differs"] = ds.get("prompt_render_differs", 0) + 1


def prompt_ids_differ(tok, rows: list[dict], kwargs_for=None) -> list[bool]:
    """Per row (dataset, messages, tools, prompt_ids): whether the server's prompt_ids are
    not kit's rendering of the prompt (kit.tokens.render, the dataset's template kwargs),
    tokenized; a prompt the template refuses differs. kit's one check of that fact, for the
    export's token rows and kit.audit (prompt_ids_differ)."""
    kw = [(kwargs_for(r["dataset"]) if kwargs_for else None) or {} for r in rows]
    convs = [conversation(r["messages"], "")[:-1] for r in rows]
    tools = [tools_of(r) for r in rows]
    texts = render(tok, convs, True, on_error="skip", tools=tools, template_kwargs=kw)
    ids = encode_many(tok, [t or "" for t in texts])
    return [
        text is None or list(got) != list(r["prompt_ids"])
        for r, text, got in zip(rows, texts, ids, strict=True)
    ]


def _exact(tok, exact, stats: dict, by_dataset: dict):
    """The exact rows' columns, built by polars; counted as tokenrows' _server_row counts."""
    import polars as pl

    c = pl.col
    eot, _ = end_of_turn(tok)
    if eot is None:
        appended = pl.lit(False)
    else:
        last = c("output_ids").list.last()
        appended = c("finish_reason").is_in(STOPS) & ~last.is_in(list(tok.all_special_ids))
    out = exact.with_columns(_app=appended.cast(pl.UInt32))
    out = out.with_columns(
        input_ids=pl.concat_list(
            "prompt_ids", "output_ids", pl.lit(eot or 0, pl.Int64).repeat_by(c("_app"))
        ),
        loss_mask=pl.concat_list(
            pl.lit(0, pl.Int8).repeat_by(c("prompt_ids").list.len()),
            pl.lit(1, pl.Int8).repeat_by(c("output_ids").list.len() + c("_app")),
        ),
        ids_source=pl.lit("server", pl.String),
    )
    out = out.with_columns(_zeros=c("prompt_ids").list.len())  # the mask's zeros (token_lines)
    per = out.group_by("dataset", maintain_order=True).agg(n=pl.len(), app=c("_app").sum())
    for ds, n, app in per.iter_rows():
        d = by_dataset.setdefault(ds, {})
        d["exact"] = d.get("exact", 0) + n
        if app:
            d["end_of_turn_appended"] = d.get("end_of_turn_appended", 0) + app
        for k in ("prompt_ids", "output_ids"):
            stats[k] = stats.get(k, 0) + n
    return out.drop("_app")


def token_lines(frame) -> tuple[bytes, list[int]]:
    """The token-id JSONL lines of a frame with input_ids, loss_mask, ids_source, each with
    its newline: exactly json.dumps({"id", "input_ids", "loss_mask", "ids_source"},
    ensure_ascii=False), as (their bytes joined, the offset of each line: convo.rendered's
    form). Ids are written by orjson from numpy ("[1,2]" made "[1, 2]": a list of ints has
    no other comma); the mask of an exact row (`_zeros`, _exact) by repetition.

    Example:
        >>> f = pl.DataFrame({"dataset": ["d"], "prompt_id": ["p"], "sample": [0],
        ...     "input_ids": [[5, 6, 7]], "loss_mask": [[0, 1, 1]], "ids_source": ["server"]})
        >>> token_lines(f)[0]
        b'{"id": "d-p-0", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "ids_source": "server"}\\n'
    """
    import orjson
    import polars as pl

    def ints(values) -> bytes:
        return orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].replace(b",", b", ")

    head = pl.concat_str(pl.lit('{"id": '), json_text(row_ids()), pl.lit(', "input_ids": ['))
    tail = pl.concat_str(
        pl.lit('], "ids_source": '), json_text(pl.col("ids_source")), pl.lit("}\n")
    )
    ends = frame.select(head.alias("h"), tail.alias("t"))
    zeros = frame["_zeros"].to_list() if "_zeros" in frame.columns else [None] * frame.height
    general = frame["loss_mask"].filter(pl.Series(zeros, dtype=pl.Int64).is_null())
    masks = iter(id_arrays(general.cast(pl.List(pl.Int64))))  # the rows without `_zeros`
    parts, offsets = [], [0]
    for h, ids, z, t in zip(
        ends["h"], id_arrays(frame["input_ids"]), zeros, ends["t"], strict=True
    ):
        mask_text = (
            ints(next(masks)) if z is None else b"0, " * z + b"1, " * (len(ids) - z - 1) + b"1"
        )
        row = (h.encode(), ints(ids), b'], "loss_mask": [', mask_text, t.encode())
        parts += row
        offsets.append(offsets[-1] + sum(map(len, row)))
    return b"".join(parts), offsets


def id_arrays(ids) -> list:
    """A List(Int64) series -> a numpy array per row (views of one buffer: no Python int per
    id, for orjson and a tokenizer's decode)."""
    arr = ids.rechunk().to_arrow()
    offsets, values = arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False)
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def token_problems(frame, vocab_size: int, one_span: bool) -> list[str]:
    """What breaks kit.validate's token-id rules (kit.report.checks) in the frame token_lines
    renders, one line per rule naming its first row: the export checks its rows here, as
    typed columns, so its staged folder is validated without parsing them again."""
    import polars as pl

    c = pl.col
    ids, mask = c("input_ids"), c("loss_mask")
    rules = {
        "'input_ids' must be a non-empty list of ints >= 0": (ids.list.len() == 0)
        | (ids.list.min() < 0),
        f"a token id is not below the vocabulary size {vocab_size}": ids.list.max() >= vocab_size,
        "'loss_mask' must be a list of 0/1 ints": (mask.list.min() < 0) | (mask.list.max() > 1),
        "loss_mask is not as long as input_ids": mask.list.len() != ids.list.len(),
        "loss_mask is all 0: the row trains nothing": mask.list.max() != 1,
        "loss_mask is 1 on the first token: the prompt is trained": mask.list.first() == 1,
        "'ids_source' must be 'server' or 'retokenized'": ~c("ids_source").is_in(
            ["server", "retokenized"]
        ),
    }
    if one_span:
        rules[
            "loss_mask has more than one stretch of 1s: only the last assistant turn is trained"
        ] = mask.list.eval(pl.element().diff() == 1).list.sum() > 1
    return first_breaks(frame, rules)
