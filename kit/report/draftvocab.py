"""Draft vocabulary: token frequencies and the d2t/t2d mapping an EAGLE-3 drafter trains with.

Counted from the ids a trainer's loss mask covers: each record's server output_ids and, with
all_turns, each earlier generated turn's; records without server ids are excluded and counted;
the end-of-turn id the token-id export appends to a stop row is not counted. The K ids: most
frequent first, ties to the lower id, filled with the lowest unseen ids; d2t[i] = id_i - i
(int64 [K]), t2d[t] = t is one (bool [V]), as speculators 0.9.0 and SpecForge 0.2.0 build them.
Files in draft_vocab/: vocab_mapping.pt (SpecForge --vocab-mapping), token_freq.pt (speculators
--token-freq-path), d2t-K.npy and t2d-K.npy (its --d2t-path, --t2d-path), draft_vocab.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kit.errors import ConfigError

if TYPE_CHECKING:
    import polars as pl

_FOLDER = "draft_vocab"


class TokenCounts:
    """Per dataset: how often each token id was trained, records counted and excluded."""

    def __init__(self) -> None:
        self.per: dict[str, np.ndarray] = {}  # dataset -> counts indexed by token id
        self.records: dict[str, int] = {}  # dataset -> records counted
        self.excluded: dict[str, int] = {}  # dataset -> records without server ids

    def add(self, frame: pl.DataFrame) -> None:
        """Count a batch of records (dataset, output_ids[, turns])."""
        import polars as pl

        ok = frame["output_ids"].is_not_null()
        earlier = [None] * frame.height  # all_turns' earlier generated turns, parsed if any
        if "turns" in frame.columns and frame["turns"].is_not_null().any():
            earlier = [_turn_ids(t) for t in frame["turns"].to_list()]
            ok = ok & pl.Series([e is not None for e in earlier])
        parts = frame.with_columns(_ok=ok).partition_by("dataset", as_dict=True)
        for (name,), part in parts.items():
            good = part.filter(pl.col("_ok"))
            self.excluded[name] = self.excluded.get(name, 0) + part.height - good.height
            self.records[name] = self.records.get(name, 0) + good.height
            self._bump(name, good["output_ids"].explode().drop_nulls().to_numpy())
        for name, keep, extra in zip(frame["dataset"], ok, earlier, strict=True):
            if keep and extra is not None and len(extra):
                self._bump(name, extra)

    def _bump(self, name: str, ids: np.ndarray) -> None:
        old = self.per.setdefault(name, np.zeros(0, np.int64))
        if len(ids):
            new = np.bincount(ids.astype(np.int64), minlength=len(old))
            new[: len(old)] += old
            self.per[name] = new

    def total(self, size: int = 0) -> np.ndarray:
        """Every dataset's counts summed, at least `size` long."""
        out = np.zeros(max([size, *(len(a) for a in self.per.values())]), np.int64)
        for a in self.per.values():
            out[: len(a)] += a
        return out


def _turn_ids(turns_json: str | None) -> np.ndarray | None:
    """All earlier generated turns' ids of an all_turns record (empty without turns); None
    when one of them has no server ids (the record is then excluded)."""
    if not turns_json:
        return np.zeros(0, np.int64)
    ids = [t.get("output_ids") for t in json.loads(turns_json)]
    if any(i is None for i in ids):
        return None
    return np.asarray([x for i in ids for x in i], np.int64)


def select_ids(freq: np.ndarray, k: int) -> np.ndarray:
    """The k draft ids, ascending: most frequent first (ties: lower id), filled with the
    lowest unseen ids when fewer than k were seen.

    Example:
        >>> select_ids(np.array([0, 5, 2, 5, 0, 1]), 3).tolist()
        [1, 2, 3]
        >>> select_ids(np.array([0, 0, 0, 7]), 3).tolist()
        [0, 1, 3]
    """
    order = np.argsort(-freq, kind="stable")  # count descending, ties by id
    chosen = order[: min(k, int((freq > 0).sum()))]
    if len(chosen) < k:
        unseen = np.setdiff1d(np.arange(k), chosen)[: k - len(chosen)]
        chosen = np.concatenate([chosen, unseen])
    return np.sort(chosen)


def mapping(freq: np.ndarray, k: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [k], t2d bool [vocab]): d2t[i] = id_i - i, t2d[id_i] = True."""
    ids = select_ids(freq, k)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    return (ids - np.arange(k)).astype(np.int64), t2d


def coverage(counts: TokenCounts, k: int) -> pl.DataFrame:
    """Per dataset (and TOTAL): records counted and excluded, tokens, distinct ids, the share
    of its tokens inside the run's top k (`in_top_k`), and `adds`: ids in the top k that
    would not be there without this dataset."""
    import polars as pl

    total = counts.total()
    top = select_ids(total, k)

    def row(name: str, records: int, excluded: int, a: np.ndarray, adds: int | None) -> tuple:
        return (name, records, excluded, int(a.sum()), int((a > 0).sum()), _share(a, top), adds)

    rows = []
    for name in sorted(counts.per):
        a = np.zeros(len(total), np.int64)
        a[: len(counts.per[name])] = counts.per[name]
        adds = len(np.setdiff1d(top, select_ids(total - a, k)))
        rows.append(row(name, counts.records[name], counts.excluded[name], a, adds))
    excluded = sum(counts.excluded.values())
    rows.append(row("TOTAL", sum(counts.records.values()), excluded, total, None))
    counts = dict.fromkeys(["records", "excluded", "tokens", "distinct"], pl.Int64)
    schema = {"dataset": pl.String, **counts, "in_top_k": pl.Float64, "adds": pl.Int64}
    return pl.DataFrame(rows, schema=schema, orient="row")


def _share(a: np.ndarray, top: np.ndarray) -> float | None:
    n = int(a.sum())
    return float(a[top[top < len(a)]].sum()) / n if n else None


def targets(k: int) -> list[str]:
    """The files (relative to an export) a draft vocabulary of k writes (ValueError for a bad k)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"draft_vocab must be a positive number of token ids, got {k!r}")
    names = ["vocab_mapping.pt", "token_freq.pt", f"d2t-{k}.npy", f"t2d-{k}.npy"]
    return [f"{_FOLDER}/{n}" for n in (*names, "draft_vocab.json")]


def write(out_dir: Path, counts: TokenCounts, k: int, vocab: int, files: dict) -> dict:
    """Write draft_vocab/ (k capped at the target's vocab) into out_dir, add each file to
    `files` (manifest entries) and return the manifest's "draft_vocab" section."""
    from kit.report.validate import file_entry

    torch = _torch()
    k = min(k, vocab)
    total = counts.total(vocab)
    if len(total) > vocab:
        raise ConfigError(
            f"token ids up to {len(total) - 1} in the run, but the target's vocab_size is {vocab}"
        )
    d2t, t2d = mapping(total, k, vocab)
    folder = Path(out_dir) / _FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    pair = {"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}
    torch.save(pair, folder / "vocab_mapping.pt")
    seen = np.flatnonzero(total)
    freq = dict(zip(seen.tolist(), total[seen].tolist(), strict=True))  # id -> count, seen only
    torch.save(freq, folder / "token_freq.pt")
    np.save(folder / f"d2t-{k}.npy", d2t)
    np.save(folder / f"t2d-{k}.npy", t2d)
    table = coverage(counts, k)
    section = {
        "draft_vocab_size": k,
        "target_vocab_size": vocab,
        "files": targets(k),
        "datasets": table.to_dicts(),
        "counted": "server output_ids of the exported records (earlier generated turns "
        "included); records without them excluded",
    }
    (folder / "draft_vocab.json").write_text(json.dumps(section, indent=2))
    for rel in targets(k):
        files[rel] = file_entry(Path(out_dir) / rel, None)
    return section


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError(
            "draft_vocab writes the trainers' .pt files with torch: pip install 'kit[vocab]'"
        ) from None
    return torch


def coverage_text(table: pl.DataFrame, k: int) -> list[str]:
    """One line a dataset: its tokens' share inside the top k and what it adds."""
    lines = []
    for r in table.iter_rows(named=True):
        share = f"{r['in_top_k']:.1%}" if r["in_top_k"] is not None else "-"
        adds = f", adds {r['adds']:,} ids" if r["adds"] is not None else ""
        skip = f", {r['excluded']:,} records without server ids excluded" if r["excluded"] else ""
        lines.append(
            f"  {r['dataset']}: {share} of {r['tokens']:,} tokens inside the top {k:,}{adds}{skip}"
        )
    return lines
