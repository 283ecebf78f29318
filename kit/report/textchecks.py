"""The checks of a run's records that need the target's tokenizer: ids that decode to the
stored text (and reasoning, and tool calls), prompt ids that are the prompt's rendering,
server counts not far below the text's own, whether a chat template opens a think block
though told not to, and whether it renders the tools a prompt was sent. kit.audit runs the
per-record ones on a seeded sample per dataset (TextSample); kit.report.flags re-exports
them.
"""

from __future__ import annotations

from kit.types import KEY, record_columns

THINK_MARKERS = ("<think>", "</think>")
HASH_SEED = 0x6B6974  # polars .hash() seed of text_hash / norm_hash and of TextSample's pick
# a record's columns kit.tokens.ids_spell reads, in its argument order
_SPELL_COLUMNS = record_columns(
    "output_ids", "completion", "reasoning", "tool_calls", "finish_reason"
)


def opens_think_block(tokenizer, kwargs: dict | None) -> bool:
    """True when the chat template's generation prompt, rendered with these template kwargs
    (e.g. {"enable_thinking": False}), opens a think block: the switch was ignored.

    Example: opens_think_block(tok, {"enable_thinking": False}) -> False for SmolLM2
    """
    from kit.tokens import render

    mark = "\ue000kit\ue000"
    conv = [{"role": "user", "content": mark}]
    try:
        text = render(tokenizer, [conv], True, template_kwargs=kwargs or None)[0]
    except Exception:  # noqa: BLE001 - a template that refuses: no evidence either way
        return False
    return THINK_MARKERS[0] in text[text.rfind(mark) + len(mark) :]


def drops_tools(tokenizer, messages, tools, kwargs: dict | None) -> bool:
    """True when the chat template renders a prompt the same with and without its tools:
    the model never sees them (SmolLM2's template has no tools). A template that refuses
    either rendering: False (no evidence).

    Example: drops_tools(smollm2_tok, [{"role": "user", "content": "hi"}], tools, None) -> True
    """
    from kit.tokens import parsed, render

    conv = [{"role": m["role"], "content": m["content"]} for m in messages]
    kw = kwargs or None
    try:
        with_tools = render(tokenizer, [conv], True, tools=[parsed(tools)], template_kwargs=kw)
        without = render(tokenizer, [conv], True, template_kwargs=kw)
    except Exception:  # noqa: BLE001 - a template that refuses: no evidence either way
        return False
    return with_tools[0] == without[0]


def with_optional(records):
    """Columns of newer kit versions, null in frames written before them."""
    import polars as pl

    for name in record_columns("reasoning", "tools", "turns", "tool_calls"):
        if name not in records.columns:
            records = records.with_columns(pl.lit(None, pl.String).alias(name))
    if "messages" not in records.columns:
        msg = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
        records = records.with_columns(pl.lit(None, msg).alias("messages"))
    return records


def ids_text_flags(recs, tokenizer):
    """ids_text_mismatch as a Series (kit.tokens.ids_spell): null where there are no ids or
    no tokenizer."""
    import polars as pl

    from kit.tokens import ids_spell

    values = [None] * recs.height
    if tokenizer is not None:
        cols = [recs[c] if c in recs.columns else [None] * recs.height for c in _SPELL_COLUMNS]
        for i, (ids, *row) in enumerate(zip(*cols, strict=True)):
            if ids is not None:
                values[i] = not ids_spell(tokenizer, ids, *row)
    return pl.Series("ids_text_mismatch", values, dtype=pl.Boolean)


def under_reported_flags(recs, tokenizer, ratio: float):
    """under_reported as a Series: the server's count far below the text's own token count."""
    import polars as pl

    values = [None] * recs.height
    if tokenizer is not None and recs.height:
        from kit.tokens import encode_lengths

        lengths = encode_lengths(tokenizer, recs["completion"].to_list())
        rows = zip(recs["completion_tokens"], recs["count_source"], lengths, strict=True)
        values = [None if src == "retokenized" else n < ratio * k for n, src, k in rows]
    return pl.Series("under_reported", values, dtype=pl.Boolean)


class TextSample:
    """A seeded sample, per dataset, of the records the tokenizer checks look at.

    For each check (ids decode to the text: records with output_ids; counts not
    under-reported: records whose count was not re-tokenized) and each dataset, the `size`
    records with the smallest hash of (dataset, prompt_id, sample) are kept: the same records
    whatever the batch order, every record when a dataset has fewer. `size` None keeps every
    record (and so all of their text). Only the kept rows' text stays in memory.

    `check(tok, ratio, datasets)` checks the kept rows of datasets read to their end (so the
    tokenizer works while later files are read); `checks` checks the rest and gives the
    results of the rows the sample ends with (a row checked and later pushed out is dropped).

    Example:
        sample = TextSample(500)
        for batch in batches: sample.add(batch)
        sample.checks(tok, 0.5)  # dataset, prompt_id, sample, ids_text_mismatch, under_reported
    """

    COLUMNS = record_columns(
        *KEY, "completion", "reasoning", "completion_tokens", "count_source", "tool_calls"
    )
    PROMPT = record_columns("messages", "tools", "turns")  # the prompt check's
    KEYS = ["dataset", "prompt_id", "sample"]

    def __init__(self, size: int | None, seed: int = HASH_SEED, ids_for=None, kwargs_for=None):
        self.size, self.seed, self.ids_for = size, seed, ids_for
        self.kwargs_for = kwargs_for  # dataset -> its chat template kwargs (the prompt check)
        self.kept: dict = {}  # dataset -> its kept rows
        self.bound: dict = {"_ids": {}, "_count": {}}  # check -> dataset -> prio to be under
        self.done = None  # keys + ids_text_mismatch + under_reported of the rows checked

    def _picked(self, check: str):
        import polars as pl

        if self.size is None:
            return pl.col(check)
        rank = pl.when(pl.col(check)).then(pl.col("_prio")).rank("ordinal").over("dataset")
        return (rank <= self.size).fill_null(False)

    def _keep(self, rows):
        return rows.filter(self._picked("_ids") | self._picked("_count"))

    def _may_enter(self, check: str):
        """A row can still enter a full sample only under its size-th smallest hash."""
        import polars as pl

        bound = pl.col("dataset").replace_strict(
            self.bound[check], default=None, return_dtype=pl.UInt64
        )
        return pl.col(check) & (bound.is_null() | (pl.col("_prio") < bound))

    def add(self, batch) -> None:
        """Offer one batch of records (record columns; reasoning may be missing)."""
        import polars as pl

        c = pl.col
        batch = with_optional(batch)
        ids = "output_ids" if "output_ids" in batch.columns else "n_output_ids"
        rows = batch.select(
            *dict.fromkeys([*self.COLUMNS, *_SPELL_COLUMNS[1:], *self.PROMPT]),
            *(["output_ids"] if ids == "output_ids" else []),
            _prio=pl.struct(self.KEYS).hash(self.seed),
            _ids=c(ids).is_not_null(),
            _count=c("count_source").ne_missing("retokenized"),
        )
        rows = self._keep(rows.filter(self._may_enter("_ids") | self._may_enter("_count")))
        # copy the kept texts out of the batch's buffers (a filtered string column still
        # holds the whole batch's text), so memory stays the sample's, not the run's
        rows = rows.with_columns(
            pl.Series(name, rows[name].to_list(), dtype=pl.String)
            for name in record_columns("completion", "reasoning", "tool_calls", "tools", "turns")
        ).with_columns(pl.Series("messages", rows["messages"].to_list(), rows["messages"].dtype))
        for (name,), part in rows.partition_by("dataset", as_dict=True).items():
            if name in self.kept:
                part = self._keep(pl.concat([self.kept[name], part]))
            self.kept[name] = part
            for check, bound in self.bound.items():
                prio = part.filter(check)["_prio"]
                if self.size is not None and len(prio) >= self.size:
                    bound[name] = prio.sort()[self.size - 1]

    def check(self, tokenizer, ratio: float, datasets=None) -> None:
        """Check the kept rows (of `datasets`; default all) not checked yet."""
        import polars as pl

        if not self.kept:
            return
        rows = pl.concat(self.kept.values())
        rows = rows.with_columns(_ids=self._picked("_ids"), _count=self._picked("_count"))
        if datasets is not None:
            rows = rows.filter(pl.col("dataset").is_in(list(datasets)))
        if self.done is not None:
            rows = rows.join(self.done, on=self.KEYS, how="anti")
        ids, counts = rows.filter("_ids"), rows.filter("_count")
        want = ("prompt_ids",) if "output_ids" in ids.columns else ("output_ids", "prompt_ids")
        if self.ids_for is not None:  # read by key, the sample's alone
            found = self.ids_for(ids.select(self.KEYS), want)
            ids = ids.join(found, on=self.KEYS, how="left")
        ids = ids.select(self.KEYS).with_columns(
            ids_text_flags(ids, tokenizer), self._prompt_flags(ids, tokenizer)
        )
        counts = counts.select(self.KEYS).with_columns(
            under_reported_flags(counts, tokenizer, ratio)
        )
        new = rows.select(self.KEYS).join(ids, on=self.KEYS, how="left")
        new = new.join(counts, on=self.KEYS, how="left")
        self.done = new if self.done is None else pl.concat([self.done, new])

    def _prompt_flags(self, ids, tokenizer):
        """prompt_ids_differ (kit.report.exactrows.prompt_ids_differ) of rows with prompt
        ids, one generated turn (all_turns' earlier turns are checked by the export)."""
        import polars as pl

        from kit.report.exactrows import prompt_ids_differ

        values = [None] * ids.height
        if tokenizer is not None and "prompt_ids" in ids.columns:
            one = ids["prompt_ids"].is_not_null() & (ids["turns"].fill_null("") == "")
            rows = one.arg_true().to_list()
            picked = ids[rows].select("dataset", "messages", "tools", "prompt_ids").to_dicts()
            for i, bad in zip(
                rows, prompt_ids_differ(tokenizer, picked, self.kwargs_for), strict=True
            ):
                values[i] = bad
        return pl.Series("prompt_ids_differ", values, dtype=pl.Boolean)

    def checks(self, tokenizer, ratio: float):
        """The final sample's ids_text_mismatch and under_reported (null: not checked).

        Returns a frame: dataset, prompt_id, sample, ids_text_mismatch, under_reported.
        """
        import polars as pl

        self.check(tokenizer, ratio)
        if not self.kept:
            keys = {"dataset": pl.String, "prompt_id": pl.String, "sample": pl.Int64}
            flags = ["ids_text_mismatch", "prompt_ids_differ", "under_reported"]
            return pl.DataFrame(schema=keys | dict.fromkeys(flags, pl.Boolean))
        rows = pl.concat(self.kept.values())
        rows = rows.select(*self.KEYS, _ids=self._picked("_ids"), _count=self._picked("_count"))
        rows = rows.join(self.done, on=self.KEYS, how="left")
        return rows.select(
            *self.KEYS,
            ids_text_mismatch=pl.when("_ids").then("ids_text_mismatch"),
            prompt_ids_differ=pl.when("_ids").then("prompt_ids_differ"),
            under_reported=pl.when("_count").then("under_reported"),
        )
