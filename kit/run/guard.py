"""The context guard of kit.generate: prompts too long for the target are skipped, never sent.

A prompt is skipped when prompt_tokens + sampling.max_tokens > max_context, prompt_tokens
counted on the prompt rendered with the target's chat template (a server handed one errors
out or, like `transformers serve`, stalls). Skips are counted per dataset and listed in the
run database's `skips` table, replaced at each start. Rendering a million prompts costs ~90 s,
so the database caches too_long's answer per dataset under a key of everything it depends on
(tokenizer files, template, limits, kwargs, the prompts or, for content-hash ids, their ids
alone, library versions), and the tokenizer's facts under its files' names, sizes and mtimes.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import orjson

from kit.errors import ConfigError
from kit.run import db
from kit.run.reader import is_run_dir, open_db, prompt_state

_CACHE_VERSION = 1  # bump when too_long's rule changes
REASON = "context"  # prompt_tokens + max_tokens > max_context
_SANE_MAX = 10_000_000  # tokenizers without a known limit report int(1e30)

Skips = dict  # (dataset, prompt_id) -> (prompt_tokens, samples not yet done)


def check(max_context, tokenizer, max_tokens: int) -> None:
    """ValueError naming the field and the value for a bad max_context setting."""
    if max_context is None:
        return
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
        raise ConfigError(f"generate: bad max_context={max_context!r} (a positive int or None)")
    if not tokenizer:
        raise ConfigError(
            f"generate: max_context={max_context} needs tokenizer=... "
            "(prompts are counted with its chat template)"
        )
    if max_tokens >= max_context:
        raise ConfigError(
            f"generate: max_context={max_context} leaves no room for the prompt with "
            f"sampling.max_tokens={max_tokens}"
        )


def model_context(tokenizer: str) -> int | None:
    """The target's context: max_position_embeddings in the tokenizer folder's config.json,
    else the tokenizer's model_max_length when it is a real limit; None when unknown.

    Example: model_context("data/models/SmolLM2-135M-Instruct") -> 8192
    """
    folder = Path(tokenizer)
    cfg = folder / "config.json"
    if folder.is_dir() and cfg.is_file():
        try:
            doc = json.loads(cfg.read_text())
        except (OSError, ValueError):
            doc = {}
        for part in (doc, doc.get("text_config") or {}):
            value = part.get("max_position_embeddings") if isinstance(part, dict) else None
            if isinstance(value, int) and value > 0:
                return value
    from kit.tokens import load_tokenizer

    value = getattr(load_tokenizer(tokenizer), "model_max_length", None)
    return int(value) if isinstance(value, int) and 0 < value <= _SANE_MAX else None


def too_long(
    frame, tokenizer, max_context: int, max_tokens: int, template_kwargs: dict | None = None
) -> dict[tuple, int]:
    """(dataset, prompt_id) -> prompt_tokens for prompts with prompt_tokens + max_tokens > max_context.

    Prompts are rendered with the chat template (kit.tokens.render); only those whose
    rendered text has more UTF-8 bytes than half the room are tokenized (a token covers
    at least one byte of text; the factor 2 allows for normalizers that expand text), so
    a million short prompts cost a render, not a tokenization. Prompts the template
    refuses are left to the server. A `tools` column's definitions are rendered with their
    prompt, and template_kwargs (e.g. enable_thinking) passed to the template.

    Example: too_long(frame, "data/models/SmolLM2-135M-Instruct", 8192, 512)
             -> {("sharegpt", "9f2c..."): 8301}
    """
    from kit.tokens import encode_lengths, render

    room = max_context - max_tokens
    tools = frame["tools"].to_list() if "tools" in frame.columns else None
    texts = render(
        tokenizer,
        frame["messages"].to_list(),
        on_error="skip",
        tools=tools,
        template_kwargs=template_kwargs,
    )
    candidates = [i for i, t in enumerate(texts) if t is not None and 2 * len(t.encode()) > room]
    lengths = encode_lengths(tokenizer, [texts[i] for i in candidates])
    datasets, ids = frame["dataset"].to_list(), frame["prompt_id"].to_list()
    return {(datasets[i], ids[i]): n for i, n in zip(candidates, lengths, strict=True) if n > room}


def apply(frame, config, run_dir, done) -> tuple[Skips, list[tuple]]:
    """The prompts this run skips (none without a tokenizer), and the rows the store keeps of
    them (RunStore.write_skips).

    Args:
        frame: the prompt frame; config: the RunConfig (tokenizer, max_context, sampling).
        run_dir: the run directory. done: the records already written, RunStore.done()'s
            frame (or a set of their keys).
    Returns:
        ({(dataset, prompt_id): (prompt_tokens, samples not yet done)}, rows) for prompts with at
        least one sample still to do. too_long's answers come from the cache when their key
        matches (see the module docstring).
    """
    cache = _Cache(Path(run_dir), config.tokenizer) if config.tokenizer else None
    limit = config.max_context
    if cache is not None:
        limit = cache.context() if limit is None else limit
        cache.note_tokenizer(config.chat_template_hash)
        cache.save()
    if not config.tokenizer or not limit:
        return {}, []
    max_tokens, n = config.sampling.max_tokens, config.sampling.n
    check(limit, config.tokenizer, max_tokens)
    import polars as pl

    from kit.run.queues import prompt_text

    found: dict[tuple, int] = {}
    custom = _custom_ids(run_dir)
    for name in frame["dataset"].unique(maintain_order=True).to_list():
        kwargs = config.sampling_for(name).chat_template_kwargs
        facts = (config.chat_template_hash, limit, max_tokens, kwargs)
        ids_key = None
        if custom.get(name) == 0:  # every id is its prompt's content hash: the ids say it all
            keys = frame.filter(pl.col("dataset") == name).select("dataset", "prompt_id")
            ids_key = cache.key(keys.unique().sort("prompt_id"), *facts)
        hit = cache.get(name, ids_key)
        if hit is None:
            part = prompt_text(frame, run_dir, name)  # a resume reads one dataset's text at a time
            if "tools" not in part.columns:  # the same key from a frame and from the database
                part = part.with_columns(tools=pl.lit(None, dtype=pl.String))
            part = part.select("dataset", "prompt_id", "messages", "tools")
            part = part.unique(subset=["prompt_id"], keep="first").sort("prompt_id")
            key = cache.key(part, *facts)
            hit = cache.get(name, key)
            if hit is None:
                hit = too_long(part, config.tokenizer, limit, max_tokens, kwargs)
            cache.put(name, key, hit, ids_key)
        found |= hit
    cache.save()
    if isinstance(done, pl.DataFrame):  # RunStore.done(): the keys of these prompts only
        rows = done.filter(pl.col("prompt_id").is_in([pid for _, pid in found]))
        done = set(rows.select("dataset", "prompt_id", "sample").iter_rows())
    skips: Skips = {}
    for (ds, pid), tokens in found.items():
        todo = sum((ds, pid, s) not in done for s in range(n))
        if todo:
            skips[(ds, pid)] = (tokens, todo)
    rows = [
        (ds, pid, tokens, max_tokens, limit, samples, REASON)
        for (ds, pid), (tokens, samples) in sorted(skips.items())
    ]
    return skips, rows


def _custom_ids(run_dir) -> dict[str, int]:
    """dataset -> its stored prompts whose id is not their content hash (absent: unknown)."""
    if not is_run_dir(run_dir):
        return {}
    with open_db(run_dir) as conn:
        return prompt_state(conn)["custom_ids"]


def template_hash(tokenizer, run_dir) -> str:
    """kit.tokens.chat_template_hash(tokenizer), read from the guard's cache when the
    tokenizer's files are those it was computed from (no tokenizer loaded), else computed.

    Example: template_hash("data/models/SmolLM2-135M-Instruct", "data/runs/demo") -> "5adf0442e5f7706b"
    """
    known = _Cache(Path(run_dir), tokenizer).tokenizer.get("chat_template_hash")
    if isinstance(known, str):
        return known
    from kit.tokens import chat_template_hash

    return chat_template_hash(tokenizer)


def tokenizer_files(tokenizer) -> list | None:
    """[resolved path, [[name, size, mtime_ns] of its files]] of a local tokenizer (a folder
    or a file such as a .gguf), None for anything else (a Hugging Face id, an object)."""
    if not isinstance(tokenizer, (str, Path)):
        return None
    try:
        path = Path(tokenizer).expanduser().resolve(strict=True)
        entries = sorted(path.iterdir()) if path.is_dir() else [path]
        stats = [(p.name, p.stat()) for p in entries if p.is_file()]
    except OSError:
        return None
    return [str(path), [[name, st.st_size, st.st_mtime_ns] for name, st in stats]]


@lru_cache(maxsize=1)
def _versions() -> dict:
    """The installed transformers and tokenizers versions (render and count prompts)."""
    out = {}
    for name in ("transformers", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class _Cache:
    """The guard's cache in the run database: too_long answers per dataset under their key
    (guard_datasets), facts about the tokenizer (chat_template_hash, context) under its
    files' names, sizes and mtimes (guard_tokenizer). A guard.json of an older kit is read
    instead once, then stored in the database and removed."""

    def __init__(self, run_dir: Path, tokenizer) -> None:
        self.run_dir, self.name = run_dir, tokenizer
        self.files = tokenizer_files(tokenizer) if tokenizer else None
        imported = (run_dir / "guard.json").is_file()
        tok, self.datasets = _guard_json(run_dir) if imported else _stored(run_dir)
        self.dirty = set(self.datasets) if imported else set()  # datasets to store
        fresh = isinstance(tok, dict) and self.files is not None and tok.get("files") == self.files
        self.tokenizer = dict(tok) if fresh else {"files": self.files}
        self.changed = imported or not fresh

    def context(self) -> int | None:
        """model_context(tokenizer), cached with the tokenizer's files."""
        if "context" not in self.tokenizer:
            self.tokenizer["context"], self.changed = model_context(self.name), True
        value = self.tokenizer["context"]
        return value if isinstance(value, int) and value > 0 else None

    def note_tokenizer(self, template_hash: str | None) -> None:
        if template_hash and self.tokenizer.get("chat_template_hash") != template_hash:
            self.tokenizer["chat_template_hash"], self.changed = template_hash, True

    def key(self, part, template_hash, limit: int, max_tokens: int, kwargs) -> str | None:
        """sha256 of everything too_long(part, ...) depends on; None: not cacheable."""
        import polars as pl

        if self.files is None:
            return None  # not local files (a Hugging Face id): kit cannot tell it changed
        rows = hashlib.sha256(part.hash_rows().to_numpy().tobytes()).hexdigest()
        facts = [_CACHE_VERSION, str(self.name), self.files, template_hash, limit, max_tokens]
        parts = [*facts, kwargs, part.columns, part.height, rows, pl.__version__, _versions()]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, dataset: str, key: str | None) -> dict | None:
        entry = self.datasets.get(dataset)
        if (
            key is None
            or not isinstance(entry, dict)
            or key not in (entry.get("key"), entry.get("ids_key"))
        ):
            return None
        try:
            return {(dataset, str(pid)): int(n) for pid, n in entry["too_long"]}
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, dataset: str, key: str | None, found: dict, ids_key: str | None = None) -> None:
        """Keep too_long's answer under its key (and the ids-only key, when it has one)."""
        if key is not None:
            rows = [[pid, n] for (_, pid), n in found.items()]
            entry = {"key": key, "ids_key": ids_key, "too_long": rows}
            if self.datasets.get(dataset) != entry:
                self.datasets[dataset] = entry
                self.dirty.add(dataset)

    def save(self) -> None:
        """Store what changed in one transaction (a failure is only a miss next time)."""
        if not (self.changed or self.dirty):
            return
        rows = [
            (name, e["key"], e.get("ids_key"), orjson.dumps(e["too_long"]).decode())
            for name, e in self.datasets.items()
            if name in self.dirty and isinstance(e, dict) and isinstance(e.get("key"), str)
        ]
        try:
            conn = db.connect(self.run_dir, write=True)
            try:
                conn.execute("BEGIN IMMEDIATE")
                if self.changed:
                    doc = orjson.dumps(self.tokenizer).decode()
                    conn.execute("INSERT OR REPLACE INTO guard_tokenizer VALUES (1, ?)", (doc,))
                conn.executemany("INSERT OR REPLACE INTO guard_datasets VALUES (?, ?, ?, ?)", rows)
                conn.execute("COMMIT")
            finally:
                conn.close()
            (self.run_dir / "guard.json").unlink(missing_ok=True)
        except (OSError, sqlite3.Error, db.DatabaseDamaged):
            return
        self.changed, self.dirty = False, set()


def _stored(run_dir: Path) -> tuple[dict, dict]:
    """(the tokenizer's facts, dataset -> {"key", "ids_key", "too_long"}) stored in run_dir's
    database; empty when it has none or cannot be read."""
    if not is_run_dir(run_dir):
        return {}, {}
    try:
        with open_db(run_dir) as conn:
            tok = conn.execute("SELECT doc FROM guard_tokenizer").fetchone()
            rows = conn.execute("SELECT dataset, key, ids_key, too_long FROM guard_datasets")
            datasets = {
                name: {"key": key, "ids_key": ids_key, "too_long": orjson.loads(found)}
                for name, key, ids_key, found in rows
            }
        return (orjson.loads(tok[0]) if tok else {}), datasets
    except (OSError, ValueError, sqlite3.Error, db.DatabaseDamaged):
        return {}, {}


def _guard_json(run_dir: Path) -> tuple[dict, dict]:
    """(tokenizer facts, dataset entries) of an older kit's guard.json; empty when spoiled."""
    try:
        doc = orjson.loads((run_dir / "guard.json").read_bytes())
    except (OSError, ValueError):
        doc = {}
    if not isinstance(doc, dict) or doc.get("version") != _CACHE_VERSION:
        return {}, {}
    tok, datasets = doc.get("tokenizer"), doc.get("datasets")
    return (tok if isinstance(tok, dict) else {}), (datasets if isinstance(datasets, dict) else {})
