"""The arguments of kit.load, checked and normalized: format/mapping, dataset names, and
paths (a directory becomes its data files, plus the entries it ignores, each with why).
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from kit.data.formats import FORMATS, columns
from kit.data.readers import CODECS, list_dir
from kit.errors import ConfigError

_NAME_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_format(format, mapping) -> str | None:
    """Validate format/mapping arguments; return the forced format or None."""
    if format is not None and format not in FORMATS:
        raise ConfigError(f"format must be one of {FORMATS}, got {format!r}")
    if mapping is None:
        if format == "mapping":
            raise ConfigError("format='mapping' needs mapping={'prompt': column}")
        return format
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(f"mapping must be a non-empty dict, got {mapping!r}")
    keys = {"prompt", "system", "messages", "turns", "transcript", "tools", "answer"}
    unknown = set(mapping) - keys
    unknown |= (
        set(mapping) - {"prompt", "system", "tools", "answer"} if "answer" in mapping else set()
    )
    if unknown or sum(k in mapping for k in ("prompt", "messages", "turns", "transcript")) != 1:
        raise ConfigError(
            "mapping needs exactly one of 'prompt', 'messages', 'turns' (a list of user turns) "
            "or 'transcript' (Human:/Assistant: text) plus optional 'system' and 'tools' "
            f"('answer' with 'prompt': the dataset's own answer), got {mapping!r}"
        )
    if not all(isinstance(v, str) and v for v in mapping.values()):
        raise ConfigError(f"mapping values must be column names, got {mapping!r}")
    kind = "transcript" if "transcript" in mapping else "mapping"
    if format not in (None, kind):
        raise ConfigError(f"format={format!r} conflicts with mapping={mapping!r}")
    return kind


def _per_source(value) -> bool:
    """True for a per-dataset dict of load() arguments: {dataset: format or mapping}, told
    from one column mapping ({"prompt": "question"}) by its values (dicts or formats).

    Example:
        >>> _per_source({"gsm8k": {"prompt": "question"}}), _per_source({"prompt": "question"})
        (True, False)
    """
    if not isinstance(value, dict) or not value:
        return False
    return all(isinstance(v, dict) or v is None for v in value.values())


def for_each(names: list[str], format, mapping) -> dict[str, tuple[str | None, dict | None]]:
    """dataset -> (format, mapping) it loads with, from load()'s format= and mapping= (one
    for every source, or a dict per dataset name); checked, naming any unknown dataset.

    Example:
        >>> for_each(["gsm8k", "humaneval"], None, {"gsm8k": {"prompt": "question"}})
        {'gsm8k': ('mapping', {'prompt': 'question'}), 'humaneval': (None, None)}
    """
    formats = format if isinstance(format, dict) else dict.fromkeys(names, format)
    mappings = mapping if _per_source(mapping) else dict.fromkeys(names, mapping)
    for what, given in (("format", formats), ("mapping", mappings)):
        if unknown := sorted(set(given) - set(names)):
            raise ConfigError(
                f"{what}= names datasets {unknown} that are not among the sources {names}"
            )
    return {n: (check_format(formats.get(n), mappings.get(n)), mappings.get(n)) for n in names}


def sources(spec, name) -> tuple[list[tuple[str, object]], list[dict]]:
    """The first argument of load() -> [(dataset_name, Path or rows object)] and the
    directory entries ignored ([{"path", "reason"}])."""
    ignored: list[dict] = []
    if isinstance(spec, dict):
        if name is not None:
            raise ConfigError("name= is for a single source; a dict already names its datasets")
        pairs = [(check_name(k), _as_source(v)) for k, v in spec.items()]
    elif isinstance(spec, (str, Path)) and not Path(spec).is_dir():
        pairs = [(check_name(name) if name else _stem_name(Path(spec)), Path(spec))]
    elif isinstance(spec, (str, Path, list, tuple)) and _all_paths(spec):
        if name is not None:
            raise ConfigError("name= is for a single file; pass {name: path} for several")
        paths, ignored = _expand(spec)
        pairs = [(_stem_name(p), p) for p in paths]
    elif name is not None:
        pairs = [(check_name(name), spec)]
    else:
        raise ConfigError(
            f"load() takes a path, a list of paths or {{name: path_or_rows}}, got {type(spec).__name__}; "
            "in-memory data needs a name: load({'name': data})"
        )
    if not pairs:
        raise ConfigError("load() got no sources")
    _check_unique(pairs)
    return pairs, ignored


def _all_paths(spec) -> bool:
    """True for a path or a list/tuple of paths."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    return all(isinstance(p, (str, Path)) for p in items)


def _expand(spec) -> tuple[list[Path], list[dict]]:
    """Paths, with each directory replaced by its data files (sorted); the entries ignored."""
    out, ignored = [], []
    for item in spec if isinstance(spec, (list, tuple)) else [spec]:
        path = Path(item)
        if not path.is_dir():
            out.append(path)
            continue
        found, skipped = list_dir(path)
        if not found:
            why = "; ".join(f"{Path(f['path']).name}: {f['reason']}" for f in skipped)
            raise ConfigError(
                f"{path}: no .jsonl, .ndjson, .json or .parquet files in this directory"
                + (f" (found {why})" if why else "")
            )
        out.extend(found)
        ignored.extend(skipped)
    return out, ignored


def _as_source(value):
    """A dict value: a path becomes a Path, anything else is in-memory rows."""
    return Path(value) if isinstance(value, (str, Path)) else value


def _check_unique(pairs) -> None:
    """Raise when two sources share a dataset name."""
    seen: dict[str, object] = {}
    for ds, src in pairs:
        if ds in seen:
            raise ConfigError(
                f"dataset name {ds!r} used twice ({seen[ds]} and {src}); pass {{name: path}} to rename"
            )
        seen[ds] = src


def check_name(name) -> str:
    """Dataset names become file names in the run directory: [A-Za-z0-9_.-], no leading dot."""
    if not isinstance(name, str) or not _NAME_OK.fullmatch(name):
        raise ConfigError(
            f"dataset name {name!r} must match [A-Za-z0-9_.-]+ and not start with '.' or '-' "
            "(it names files in the run directory)"
        )
    return name


def _stem_name(path: Path) -> str:
    """'my data (v2).jsonl' -> 'my_data_v2'."""
    name = path.name
    for _ in range(2 if path.suffix.lower() in CODECS else 1):  # "dolly.jsonl.gz" -> "dolly"
        name = name[: -len(Path(name).suffix) or None]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    stem = stem.strip("_.-")
    if not stem:
        raise ConfigError(f"cannot make a dataset name from {str(path)!r}; pass name= or a dict")
    return stem


def check_mapping_columns(mapping: dict, rows, label: str) -> None:
    """A mapped column missing from every row is a typo, not a bad row: raise. (A tools
    column only has to exist: most rows of a tool dataset may hold no tools.)"""
    cols = columns(rows)
    missing = [c for key, c in mapping.items() if key != "tools" and c not in cols]
    if "tools" in mapping and not _has_key(rows, mapping["tools"]):
        missing.append(mapping["tools"])
    if missing and cols:
        raise ConfigError(f"mapping columns {missing} not found in {label}; columns found {cols}")


def _has_key(rows, key: str) -> bool:
    """True when a frame has the column, or any object row has the key."""
    if isinstance(rows, pl.DataFrame):
        return key in rows.columns
    return any(isinstance(r, dict) and key in r for r in rows)
