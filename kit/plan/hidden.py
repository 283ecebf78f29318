"""Hidden-state disk: the bytes an offline EAGLE-3 dump of a plan would take.

Offline EAGLE-3 training first dumps the target's hidden states for every token of every
training sequence, prompt and completion alike: three auxiliary layers and the last, each
`hidden_size` bfloat16 values. SpecForge 0.2.0 stores `aux_hidden_state` [seq, 3 x hidden]
and `hidden_state` [seq, hidden] per sample (scripts/prepare_hidden_states.py);
speculators 0.9.0 stores `hidden_states` [seq, 4, hidden] (speculators/train/data.py).
Token ids, loss masks (16 bytes a token) and a trainer's max_length cut are left out.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError, DataError, MissingPath

if TYPE_CHECKING:
    import polars as pl

LAYERS_DUMPED = 4  # EAGLE-3: three auxiliary layers + the last
VALUE_BYTES = 2  # bfloat16, both trainers' default
_UNITS = {"B": 1} | {f"{p}B": 10 ** (3 * i) for i, p in enumerate("KMGTP", 1)}
_UNITS |= {f"{p}IB": 2 ** (10 * i) for i, p in enumerate("KMGTP", 1)}  # KiB, MiB, ...


@dataclass(frozen=True, slots=True)
class TargetShape:
    """What the dump's size depends on, from the target's config.json."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int | None  # the target's output vocabulary (lm_head rows), if the config says
    source: str  # the config.json read

    @property
    def bytes_per_token(self) -> int:
        """Hidden-state bytes one sequence token takes: 4 layers x hidden_size x 2 bytes."""
        return LAYERS_DUMPED * self.hidden_size * VALUE_BYTES


def target_shape(path) -> TargetShape:
    """The target's shape from its config.json (a model folder or the file itself); a
    multimodal config's `text_config` is used, as both trainers do.

    Example:
        >>> s = target_shape("data/models/SmolLM2-135M-Instruct")
        >>> s.hidden_size, s.num_hidden_layers, s.bytes_per_token
        (576, 30, 4608)
    """
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise MissingPath(
            f"target config: {file} does not exist (give the target model's folder or its config.json)"
        )
    try:
        doc = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"target config {file} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise DataError(f"target config {file} is not a JSON object")
    doc = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    values = {k: doc.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    for key in ("hidden_size", "num_hidden_layers"):
        v = values[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise DataError(f"target config {file}: {key} must be a positive int, got {v!r}")
    vocab = values["vocab_size"] if isinstance(values["vocab_size"], int) else None
    return TargetShape(values["hidden_size"], values["num_hidden_layers"], vocab, str(file))


def shape_for(target_config, tokenizer, *, needed: bool = False) -> TargetShape | None:
    """The TargetShape of `target_config` (a path), else of the tokenizer's folder when it
    holds a config.json (the embedded model's does); None when neither, ValueError if needed."""
    folder = Path(tokenizer) if tokenizer else None
    if target_config is None and folder is not None and (folder / "config.json").is_file():
        target_config = folder
    if target_config is not None:
        return target_shape(target_config)
    if needed:
        raise ConfigError(
            "a budget in bytes of hidden states needs the target's config.json: give "
            "--target-config PATH (the model's folder or its config.json)"
        )
    return None


def parse_bytes(text: str) -> int | None:
    """'2TB' -> 2e12, '1.5 GiB' -> 1610612736; None when `text` carries no byte unit.

    Example:
        >>> parse_bytes("2TB"), parse_bytes("512 MiB"), parse_bytes("1e7")
        (2000000000000, 536870912, None)
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGTP]I?B|B)\s*", text.upper())
    if not m:
        return None
    try:
        value = float(m.group(1)) * _UNITS[m.group(2)]
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 1 else None


def _format_bytes(n: float | None) -> str:
    """Decimal units, as disks are sold: 4.61e12 -> '4.61 TB'.

    Example:
        >>> _format_bytes(4_608_000_000), _format_bytes(None)
        ('4.61 GB', '-')
    """
    if n is None:
        return "-"
    for unit in ("PB", "TB", "GB", "MB", "KB"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.2f} {unit}"
    return f"{n:.0f} B"


def _means(samples: Any) -> dict[str, tuple[float, float | None]]:
    """dataset -> (mean completion tokens, mean prompt tokens or None) of a pilot (a
    PilotResult or a frame with dataset, completion_tokens[, prompt_tokens])."""
    import polars as pl

    frame = getattr(samples, "frame", samples)
    prompt = pl.col("prompt_tokens").mean() if "prompt_tokens" in frame.columns else pl.lit(None)
    agg = frame.group_by("dataset").agg(pl.col("completion_tokens").mean(), prompt.alias("p"))
    return {d: (c, p) for d, c, p in agg.iter_rows()}


def tokens_for_bytes(
    hidden_bytes: int, completion_mean: float, prompt_mean: float | None, shape: TargetShape
) -> int:
    """The completion-token budget whose dump (prompts included) fills `hidden_bytes`.

    Example:
        >>> s = TargetShape(4096, 36, None, "qwen3-8b")
        >>> tokens_for_bytes(2 * 10**12, 500.0, 500.0, s)   # half of each sequence is prompt
        30517578
    """
    if prompt_mean is None:
        raise ConfigError(
            "a budget in bytes of hidden states needs the pilot's prompt token counts "
            "(the server reported none): give the budget in tokens"
        )
    per_completion = (completion_mean + prompt_mean) / completion_mean
    return int(hidden_bytes / shape.bytes_per_token / per_completion)


def convert_budgets(budgets, hidden, samples, shape: TargetShape) -> tuple[dict, list[str]]:
    """(dataset -> completion tokens, one line per conversion): the byte budgets (`hidden`:
    one number or dataset -> bytes) converted at the pilot's mean lengths; token budgets kept."""
    lengths = _means(samples)
    out, lines = {}, []
    for name in sorted(budgets) if isinstance(budgets, dict) else sorted(lengths):
        size = hidden if isinstance(hidden, int) else hidden.get(name)
        if size is None:
            out[name] = budgets[name]
            continue
        c, p = lengths[name]
        out[name] = tokens_for_bytes(size, c, p, shape)
        lines.append(
            f"budget {name}: {_format_bytes(size)} of hidden states = {out[name]:,} "
            f"completion tokens (pilot means: {p or 0:,.0f} prompt + {c:,.0f} "
            "completion tokens a sample)"
        )
    return out, lines


def hidden_states(table: pl.DataFrame, samples: Any, shape: TargetShape) -> pl.DataFrame:
    """Per dataset of kit.plan.budget()'s `table`, and in total, the bytes an offline dump
    of the planned run would take: samples (done + needed, at most the prompts),
    completion_tokens (the budget, or what the prompts can give), prompt_tokens (samples x
    the pilot's mean prompt), sequence_tokens, hidden_bytes (x shape.bytes_per_token)."""
    import polars as pl

    from kit.plan.estimate import TOTAL

    prompt = {d: p for d, (_, p) in _means(samples).items()}
    c = pl.col
    rows = table.filter(c("dataset") != TOTAL).with_columns(
        samples=pl.min_horizontal(c("samples_done") + c("samples_needed"), c("prompts_available")),
        completion_tokens=pl.min_horizontal(c("budget"), c("max_tokens_available")),
        p=c("dataset").replace_strict(prompt, default=None, return_dtype=pl.Float64),
    )
    rows = rows.select(
        "dataset", "samples", "completion_tokens", prompt_tokens=c("samples") * c("p")
    )
    rows = rows.with_columns(sequence_tokens=c("completion_tokens") + c("prompt_tokens"))
    rows = rows.with_columns(hidden_bytes=c("sequence_tokens") * shape.bytes_per_token)
    total = rows.select(pl.lit(TOTAL).alias("dataset"), pl.exclude("dataset").sum())
    if rows["prompt_tokens"].null_count():
        total = total.with_columns(prompt_tokens=None, sequence_tokens=None, hidden_bytes=None)
    return pl.concat([rows, total.cast(rows.schema)])


def hidden_text(frame: pl.DataFrame, shape: TargetShape) -> str:
    """Plain-text lines of hidden_states(): one per dataset and the total."""
    lines = [
        f"hidden states of an offline EAGLE-3 dump ({LAYERS_DUMPED} layers x "
        f"{shape.hidden_size} x {VALUE_BYTES} B = {shape.bytes_per_token:,} B a token; "
        f"prompts and completions; target config {shape.source}):"
    ]
    for r in frame.iter_rows(named=True):
        seq = f"{r['sequence_tokens']:,.0f}" if r["sequence_tokens"] is not None else "?"
        lines.append(
            f"  {r['dataset']}: {_format_bytes(r['hidden_bytes'])} "
            f"({seq} tokens in {r['samples']:,} samples)"
        )
    return "\n".join(lines)
