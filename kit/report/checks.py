"""What an export must be, row by row and in its manifest: the rules kit.validate checks
(each format's writer, kit.report.formats, names its row rule here).

A manifest: an object whose `files` map paths inside the export's folders to entries with a
sha256, whose `counts` give train / validation rows per dataset, and whose
`options.formats` is a list.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("system", "user", "assistant")
# where an export writes
FOLDERS = ("specforge", "token_ids", "parquet", "hf", "linehashes", "draft_vocab")


def check_specforge(row, rules=None, line: str = "") -> str | None:
    """Why a parsed SpecForge line breaks the format, or None: a non-empty id, conversations
    of {role, content} ending with the assistant's answer, with text, a system turn only
    first, reasoning_content a string, tool_calls a non-empty list of calls, tools a list of
    dicts."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not row["id"]:
        return "'id' must be a non-empty string"
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        return "'conversations' must be a non-empty list"
    for j, m in enumerate(conv):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            return f"conversations[{j}] must be {{'role': one of {ROLES}, 'content': str}}, got {m!r:.80}"
        if m["role"] == "system" and j:
            return f"conversations[{j}] is a system message after the first turn"
        if "reasoning_content" in m and not isinstance(m["reasoning_content"], str):
            return f"conversations[{j}].reasoning_content must be a string"
        calls = m.get("tool_calls")
        if "tool_calls" in m and not (
            isinstance(calls, list)
            and calls
            and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
        ):
            return f"conversations[{j}].tool_calls must be a non-empty list of tool calls"
    if conv[-1]["role"] != "assistant":
        return "the last message must be the assistant completion"
    if not conv[-1]["content"].strip():
        return (
            "the last assistant message has no text: SpecForge trains a lone end-of-turn after "
            "its header, not the target's tokens (kit leaves such rows out: manifest "
            "trainers.no_text)"
        )
    tools = row.get("tools")
    if "tools" in row and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "'tools' must be a list of tool definitions (dicts)"
    return None


def is_int(x) -> bool:
    return type(x) is int


@dataclass
class Rules:
    """What token-id rows are checked against, from the manifest."""

    vocab_size: int | None = None  # ids must be below it
    one_span: bool = True  # turns "last_turn": the loss mask is one run of 1s (the answer)
    sources: dict = field(default_factory=dict)  # ids_source -> rows seen


def check_token_ids(row, rules: Rules, line: str = "") -> str | None:
    """Why a parsed token-id line breaks the format, or None: ids >= 0 below the vocabulary
    size, a 0/1 loss mask as long as the ids (_mask_problem), ids_source "server" or
    "retokenized". `line`: the row's JSON text;
    where its arrays are plain (_plain_arrays) the element checks run on that text and on
    C-level list methods, never a Python loop over the ids."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not row["id"]:
        return "'id' must be a non-empty string"
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    plain = _plain_arrays(line) if isinstance(ids, list) and isinstance(mask, list) else None
    ints = plain or (isinstance(ids, list) and all(is_int(i) and i >= 0 for i in ids))
    if not isinstance(ids, list) or not ids or not ints:
        return "'input_ids' must be a non-empty list of ints >= 0"
    if rules.vocab_size is not None and max(ids) >= rules.vocab_size:
        return f"token id {max(ids)} is not below the vocabulary size {rules.vocab_size}"
    if not isinstance(mask, list) or (
        mask.count(0) + mask.count(1) != len(mask)
        if plain
        else any(x not in (0, 1) or not is_int(x) for x in mask)
    ):
        return "'loss_mask' must be a list of 0/1 ints"
    if len(mask) != len(ids):
        return f"loss_mask length {len(mask)} != input_ids length {len(ids)}"
    if plain:
        spans = plain[1].replace(" ", "").count("0,1")  # each 0 followed by a 1
    else:
        spans = sum(1 for a, b in itertools.pairwise(mask) if (a, b) == (0, 1))
    return _mask_problem(1 in mask, mask[0] == 1, spans, rules) or _source(row, rules)


_NOT_DIGITS = str.maketrans("", "", "0123456789, ")  # what is left of a plain int array


def _plain_arrays(line: str) -> tuple[str, str] | None:
    """The text of input_ids and loss_mask in line when each key occurs once and each array
    holds only digits, commas and spaces (ints >= 0: no bool, float, sign or nesting)."""
    parts = []
    for key in ('"input_ids": [', '"loss_mask": ['):
        if line.count(key) != 1:
            return None
        a = line.index(key) + len(key)
        b = line.find("]", a)
        if b < 0 or line[a:b].translate(_NOT_DIGITS):
            return None
        parts.append(line[a:b])
    return parts[0], parts[1]


def _mask_problem(trains: bool, first: bool, spans: int, rules: Rules) -> str | None:
    """Why a loss mask cannot be on completion tokens only, or None: it trains nothing, or
    the first token (a prompt always comes first), or (one_span) more than one stretch."""
    if not trains:
        return "loss_mask is all 0: the row trains nothing"
    if first:
        return "loss_mask is 1 on the first token: the prompt is trained"
    if rules.one_span and spans > 1:
        return f"loss_mask has {spans} stretches of 1s: only the last assistant turn is trained"
    return None


def _source(row, rules: Rules) -> str | None:
    source = row.get("ids_source")
    if source not in ("server", "retokenized"):
        return f"'ids_source' must be 'server' or 'retokenized', got {source!r:.40}"
    rules.sources[source] = rules.sources.get(source, 0) + 1
    return None


def read_manifest(root: Path, problems: list[str]) -> dict | None:
    """manifest.json as a dict whose `files` (path -> entry), `counts` and `options.formats`
    have their shapes; None (the reasons in problems) when it is missing or malformed."""
    path = root / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        problems.append(f"{path}: missing (not an export directory?)")
        return None
    except (OSError, ValueError) as e:
        problems.append(f"manifest.json: unreadable ({type(e).__name__}: {e})")
        return None
    bad = _manifest_shape(manifest)
    if bad:
        problems.append(f"manifest.json: malformed: {bad}")
        return None
    return manifest


def _manifest_shape(m) -> str | None:
    """What is wrong with a parsed manifest's shape, or None."""
    if not isinstance(m, dict):
        return f"not a JSON object (a {type(m).__name__})"
    files, counts, opts = m.get("files"), m.get("counts"), m.get("options")
    if not isinstance(files, dict):
        return f"'files' must be an object path -> entry, got {type(files).__name__}"
    for rel, entry in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts or parts[0] not in FOLDERS:
            return f"files lists {rel!r}, outside the export's folders {FOLDERS}"
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return f"files[{rel!r}] must be an object with a 'sha256' string"
        if entry.get("rows") is not None and not (is_int(entry["rows"]) and entry["rows"] >= 0):
            return f"files[{rel!r}].rows must be an int >= 0 or null"
        if "line_hashes" in entry and not isinstance(entry["line_hashes"], str):
            return f"files[{rel!r}].line_hashes must be a path"
    if not isinstance(counts, dict) or not all(
        isinstance(c, dict)
        and all(is_int(c.get(k, 0)) and c.get(k, 0) >= 0 for k in ("train", "validation"))
        for c in counts.values()
    ):
        return "'counts' must be an object dataset -> {train: int, validation: int, ...}"
    formats = opts.get("formats") if isinstance(opts, dict) else None
    if not isinstance(formats, list) or not all(isinstance(f, str) for f in formats):
        return "'options.formats' must be a list of format names"
    return None
