"""One writer per export format (kit.report.writers is their base), each turning a batch of
records into its rows by its own rules and saying what kit.validate checks of it; WRITERS
names them as ExportOptions.formats does. An export's layout, manifest.json written last:

    specforge/{split}.jsonl   {"id", "conversations": [{"role", "content"}, ...], "tools"?}
    token_ids/{split}.jsonl   {"id", "input_ids", "loss_mask", "ids_source"}
    parquet/{split}.parquet   id, conversations, counts (+ the token-id columns, tools)
    hf/{split}/               datasets.Dataset.save_to_disk of the split's Parquet table
    linehashes/<file>.txt     a short sha256 per JSONL line; draft_vocab/ with draft_vocab=K
"""

from __future__ import annotations

import functools
import shutil

from kit.errors import ConfigError
from kit.report import checks
from kit.report import manifest as _manifest
from kit.report.writers import SPLITS, JsonlWriter, Writer, file_entry
from kit.types import record_columns


class SpecForgeWriter(JsonlWriter):
    """SpecForge's conversation format (sgl-project/SpecForge data_preparation.md "Option 1",
    specforge/data/parse.py; kit/report/convo.py cites where each field is read): `id` a
    non-empty string; `conversations` an optional leading system message, then user /
    assistant turns ending with the target's completion, carrying its thinking as
    "reasoning_content" and its tool calls as "tool_calls"; "tools" when the record has any.
    Rows cut at max_tokens are left out unless keep_truncated_conversations (a trainer would
    train an end-of-turn the model never emitted); rows whose answer has no text (tool calls
    only, reasoning only, or nothing with tokens counted) are always left out: SpecForge's
    preprocessing trains a lone end-of-turn after their assistant header, not the target's
    tokens (the token-id rows keep them). Both counted (manifest "trainers"). SpecForge has
    no per-row switch for which turns train: last_turn exports need train_only_last_turn
    (manifest "specforge").
    """

    name = "specforge"
    listed = "specforge/{split}.jsonl"
    check = staticmethod(checks.check_specforge)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.keep = ctx.opts.keep_truncated_conversations
        # dataset -> {"length": {split: cut rows}, "bare": {split: {held: rows}} (answers
        # without text, not cut), "reasoning", "turns", "tool_calls"} of the rows in the
        # JSONL; dataset -> re-tokenized answers compared, differing (kit.report.trainers)
        self.trainer: dict[str, dict] = {}
        self.retokenized: dict[str, dict] = {}

    @staticmethod
    def left_out(manifest: dict, split: str) -> int:
        t = manifest.get("trainers", {})
        bare = t.get("no_text", {}).get("rows", {})
        out = sum(sum(v.get(split, {}).values()) for v in bare.values())
        length = t.get("length", {})
        if length.get("conversations") != "left_out":
            return out
        return out + sum(v.get(split, 0) for v in length.get("rows", {}).values())

    def problems(self, frame) -> list[str]:
        from kit.report.convo import conversation_problems

        return conversation_problems(frame)

    def write(self, frame, parts: dict, later) -> None:
        from kit.report.trainers import count_retokenized

        if frame.height and "ids_source" in frame.columns:  # token rows: what the route loses
            count_retokenized(self.ctx.tok, frame, self.retokenized, self.keep)
        super().write(frame, parts, later)

    def write_split(self, out, part, split: str, later) -> None:
        self._count(part, split)
        super().write_split(out, part, split, later)

    def lines(self, part):
        from kit.report.convo import rendered, specforge_lines

        convs = part.filter(self._in_jsonl())
        return rendered(specforge_lines(convs)) if convs.height else None

    def _in_jsonl(self):
        """The rows the JSONL holds: an answer with text, not cut (or cut, kept)."""
        import polars as pl

        return (pl.lit(self.keep) | ~pl.col("_cut")) & pl.col("_bare").is_null()

    def _count(self, part, split: str) -> None:
        """What the manifest's "trainers" says of a split's rows (kit.report.trainers)."""
        import polars as pl

        in_convs, c = self._in_jsonl(), pl.col
        assistant = pl.col("messages").list.eval(pl.element().struct.field("role") == "assistant")
        bare = c("_bare").filter(c("_bare").is_not_null() & (pl.lit(self.keep) | ~c("_cut")))
        per = part.group_by("dataset", maintain_order=True).agg(
            bare=bare,
            length=pl.col("_cut").sum(),
            reasoning=((pl.col("reasoning").fill_null("") != "") & in_convs).sum(),
            tool_calls=(pl.col("tool_calls_json").is_not_null() & in_convs).sum(),
            turns=assistant.list.sum().filter(in_convs).sum(),
        )
        for d, bare, length, reasoning, calls, turns in per.iter_rows():
            t = self.trainer.setdefault(
                d,
                {
                    "length": dict.fromkeys(SPLITS, 0),
                    "bare": {s: {} for s in SPLITS},
                    "reasoning": 0,
                    "turns": 0,
                    "tool_calls": 0,
                },
            )
            for held in bare:
                t["bare"][split][held] = t["bare"][split].get(held, 0) + 1
            t["length"][split] += length
            t["reasoning"] += reasoning
            t["tool_calls"] += calls
            t["turns"] += turns

    def manifest(self, manifest: dict) -> None:
        from kit.report import trainers

        c = self.ctx
        manifest["specforge"] = _manifest.specforge_section(c.config.turns)
        manifest["trainers"] = trainers.section(
            c.config, c.tok, self.trainer, self.retokenized, c.opts
        )


class TokenIdsWriter(JsonlWriter):
    """Token-id rows: the server's prompt + output ids verbatim where the record has them
    ("ids_source": "server"), else the chat template re-tokenized ("retokenized";
    kit/report/tokenrows.py says how), the loss mask on the target's turns (last_turn: the
    generated one, a prompt's earlier assistant turns being the dataset's; all_turns: every
    assistant turn). Rows the template cannot split are left out of every format
    (template_mismatch). The checks of the server's ids run on a sample per dataset
    (kit/report/exactrows.py, the manifest's "token_checks").
    """

    name = "token_ids"
    listed = "token_ids/{split}.jsonl"
    columns = ("prompt_ids", "output_ids")
    needs_tokenizer = needs_vocab = True
    check = staticmethod(checks.check_token_ids)

    def __init__(self, ctx) -> None:
        from kit.report.exactrows import Checks

        super().__init__(ctx)
        self.stats: dict[str, int] = {}
        self.by_dataset: dict[str, dict] = {}
        self.checks, self.lost = Checks(), 0

    @classmethod
    def ready(cls, tok) -> None:
        if tok is None:
            raise ConfigError(
                "formats includes 'token_ids' but no tokenizer: pass tokenizer= (object or local "
                "path) or set RunConfig.tokenizer, or leave 'token_ids' out of formats"
            )

    @property
    def needs_text(self) -> bool:
        return self.ctx.config.turns == "all_turns"  # exact rows use no prompt text

    def prepare(self, frame):
        """The batch with input_ids, loss_mask and ids_source (kit.report.exactrows); a batch
        read without its prompts reads those its rows use by key (_with_prompts)."""
        from kit.report.exactrows import token_columns

        c = self.ctx
        fetch = None if "messages" in frame.columns else functools.partial(_with_prompts, c.run_dir)
        frame, lost = token_columns(
            c.tok,
            frame,
            self.stats,
            self.by_dataset,
            self.checks,
            turns=c.config.turns,
            kwargs_for=lambda d: c.config.sampling_for(d).chat_template_kwargs,
            fetch=fetch,
        )
        self.lost += lost
        return frame

    def problems(self, frame) -> list[str]:
        from kit.report.exactrows import token_problems

        return token_problems(frame, len(self.ctx.tok), self.ctx.config.turns == "last_turn")

    def lines(self, part):
        from kit.report.exactrows import token_lines

        return token_lines(part)

    def dropped(self) -> dict[str, int]:
        return {"template_mismatch": self.lost}

    def manifest(self, manifest: dict) -> None:
        manifest["token_id_sources"] = self.stats
        manifest["token_rows"] = self.by_dataset
        manifest["token_checks"] = self.checks.section()

    @staticmethod
    def check_manifest(manifest: dict, rules, read: list[str]) -> list[str]:
        """The rows' ids_source (counted in `rules` as they were read) against token_rows."""
        if not any(rel.startswith("token_ids/") for rel in read):
            return []
        made = manifest.get("token_rows")
        if not isinstance(made, dict) or not all(isinstance(c, dict) for c in made.values()):
            return ["manifest.json: token_rows missing or malformed"]
        want = {
            "server": sum(c.get("exact", 0) for c in made.values()),
            "retokenized": sum(c.get("retokenized", 0) for c in made.values()),
        }
        got = {k: rules.sources.get(k, 0) for k in want}
        if got == want:
            return []
        return [
            f"token_ids: ids_source of the rows {got} disagrees with manifest.json token_rows "
            f"(exact: {want['server']}, retokenized: {want['retokenized']})"
        ]


class _Parts:
    """One split's Parquet file, written as parts (one per batch), joined at close. Every
    part holds the optional columns (reasoning_content, tools); the join keeps them only when
    some row has one, so a split's columns do not depend on how its rows fell into batches."""

    def __init__(self, root, split: str) -> None:
        self.root, self.rel, self.rows = root, f"parquet/{split}.parquet", 0
        self.parts = root / "parquet" / f".parts-{split}"  # kit's own; removed at close
        self.parts.mkdir(parents=True, exist_ok=True)
        self.reasoning = self.tools = False  # whether any row has them

    def write(self, table) -> None:
        self.reasoning |= table["has_reasoning"].any()
        self.tools |= table["tools"].is_not_null().any()
        if table.height or not self.rows:  # an empty first part: the split's columns
            table.drop("has_reasoning").write_parquet(self.parts / f"{self.rows:012d}.parquet")
            self.rows += table.height

    def close(self, files: dict):
        import polars as pl

        frame = pl.scan_parquet(sorted(self.parts.glob("*.parquet")))
        if not self.reasoning:
            e = pl.element().struct
            plain = pl.struct(role=e.field("role"), content=e.field("content"))
            frame = frame.with_columns(pl.col("conversations").list.eval(plain))
        if not self.tools:
            frame = frame.drop("tools")
        frame.sink_parquet(self.root / self.rel)
        shutil.rmtree(self.parts)
        files[self.rel] = file_entry(self.root / self.rel, self.rows)
        return self.root / self.rel


class ParquetWriter(Writer):
    """One row per sample: id, conversations (reasoning_content in them when a row of the
    split has any), the counts, tools as JSON text (when a row has them) and, when token_ids
    is among the formats, input_ids, loss_mask and ids_source."""

    name = "parquet"
    listed = "parquet/{split}.parquet"

    def __init__(self, ctx) -> None:
        self.token_ids = "token_ids" in ctx.opts.formats and ctx.rows > 0
        super().__init__(ctx)

    @classmethod
    def targets(cls, split: str) -> list[str]:
        return [f"parquet/{split}.parquet", f"parquet/.parts-{split}"]

    def open(self, split: str) -> _Parts:
        return _Parts(self.ctx.root, split)

    def write_split(self, out: _Parts, part, split: str, later) -> None:
        out.write(table(part, self.token_ids))

    def close_split(self, out: _Parts, split: str, files: dict):
        if not out.rows:  # a split without rows: its table's columns, no rows
            out.write(table(None, self.token_ids))
        return out.close(files)


class HFWriter(ParquetWriter):
    """hf/<split>/: datasets.Dataset.save_to_disk of the split's Parquet table (the one
    format that holds a whole split in memory: `datasets` builds it so); the Parquet file
    is kept only when "parquet" is among the formats too."""

    name = "hf"
    listed = "hf/{split}/"

    @classmethod
    def ready(cls, tok) -> None:
        try:
            import datasets  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "format 'hf' needs the `datasets` package: pip install datasets"
            ) from e

    @classmethod
    def targets(cls, split: str) -> list[str]:
        return [*super().targets(split), f"hf/{split}"]

    def close_split(self, out: _Parts, split: str, files: dict) -> None:
        import datasets
        import polars as pl

        path = super().close_split(out, split, files)
        target = self.ctx.root / "hf" / split
        frame = pl.read_parquet(path)
        datasets.Dataset.from_dict(frame.to_dict(as_series=False)).save_to_disk(str(target))
        for p in sorted(target.rglob("*")):
            if p.is_file():
                files[str(p.relative_to(self.ctx.root))] = file_entry(p, None)
        if "parquet" not in self.ctx.opts.formats:  # written for hf only: kit's own, removed
            files.pop(out.rel)
            path.unlink()
            if not any(path.parent.iterdir()):
                path.parent.rmdir()


WRITERS = {
    "specforge": SpecForgeWriter,
    "token_ids": TokenIdsWriter,
    "parquet": ParquetWriter,
    "hf": HFWriter,
}
ROW_CHECKS = {w.name: w.check for w in WRITERS.values() if w.check}  # folder -> row rule


def chosen(formats) -> list[type[Writer]]:
    """The writer classes of these formats, in WRITERS' order (HFWriter writes the Parquet
    file too: with both, it alone)."""
    names = [f for f in WRITERS if f in formats and not (f == "parquet" and "hf" in formats)]
    return [WRITERS[f] for f in names]


_COUNTS = record_columns(
    "dataset", "prompt_id", "sample", "finish_reason", "completion_tokens", "count_source"
)


def table(frame, token_ids: bool):
    """The Parquet / HF table of one batch of a split (None: no rows): id, conversations
    (with reasoning_content), the counts, tools (JSON text), the token-id columns, and
    has_reasoning (for _Parts, not written)."""
    import polars as pl

    from kit.report.convo import row_ids
    from kit.run.reader import record_schema

    schema = record_schema()
    if frame is None:
        cols = [*_COUNTS, "messages", "completion", "reasoning", "tools_json"]
        frame = pl.DataFrame(schema={c: schema.get(c, pl.String) for c in cols})
        frame = frame.with_columns(
            input_ids=pl.lit(None, pl.List(pl.Int64)),
            loss_mask=pl.lit(None, pl.List(pl.Int8)),
            ids_source=pl.lit(None, pl.String),
        )
    msg = pl.Struct({"role": pl.String, "content": pl.String, "reasoning_content": pl.String})
    reasoning = pl.when(pl.col("reasoning").fill_null("") != "").then(pl.col("reasoning"))
    last = pl.struct(
        role=pl.lit("assistant"), content=pl.col("completion"), reasoning_content=reasoning
    )
    conversations = pl.concat_list(pl.col("messages").cast(pl.List(msg)), last)
    cols = [row_ids().alias("id"), conversations.alias("conversations"), *_COUNTS]
    cols += [pl.col("tools_json").alias("tools"), reasoning.is_not_null().alias("has_reasoning")]
    if token_ids:
        cols += [
            pl.col("input_ids"),
            pl.col("loss_mask").cast(pl.List(pl.Int8)),
            pl.col("ids_source"),
        ]
    return frame.select(cols)


def _with_prompts(run_dir, rows):
    """rows of records read without their prompts, with `messages` and `tools` read by key
    (kit.run.reader.prompts_frame: each checked against its hash)."""
    import polars as pl

    from kit.run.reader import prompts_frame, record_schema

    cols = list(record_columns("dataset", "prompt_id", "messages", "tools"))
    parts = [
        prompts_frame(run_dir, datasets=[d], ids=g["prompt_id"].unique().to_list()).select(cols)
        for (d,), g in rows.group_by("dataset")
    ]
    schema = record_schema()
    found = pl.concat(parts) if parts else pl.DataFrame(schema={c: schema[c] for c in cols})
    return rows.join(found, on=["dataset", "prompt_id"], how="left", maintain_order="left")
