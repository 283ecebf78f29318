"""The trainers' own data code on a kit export, run in .venv-trainers (`make trainers`) by
tests/test_trainers.py: prints JSON of what each trainer trains, per kit row id.

    .venv-trainers/bin/python tests/trainer_oracle.py '{"export": ..., "model": ..., ...}'

Routes (args "routes"):
  specforge_ids    SpecForge's pre-tokenized route (data.prompts_path): prepare_prompt_tasks
                   on token_ids/train.jsonl, in file order
  speculators_ids  `speculators prepare-data --data token_ids/train.jsonl` (its prepare_data
                   function, the CLI's), read back from its output folder
  specforge_conv   SpecForge's conversation route (data.train_data_path + data.chat_template,
                   the template registered as args "template" says): prepare_prompt_tasks on
                   specforge/train.jsonl, and per row preprocess_conversations (the function
                   its dataset map calls), so each output has its kit id
  speculators_conv prepare-data on specforge/train.jsonl with --render-endpoint (the target's
                   vLLM), and per row _preprocess_batch (the function its dataset map calls)
Each route's pipeline output (shuffled, ids dropped) is compared, as a multiset, with the
per-row results: "pipeline_same" says the per-row calls are the pipeline. No stub is used.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

MAX_LENGTH = 4096  # both trainers' window: the embedded vLLM's max_model_len (render refuses more)


def pair(ids, mask) -> tuple:
    listed = lambda v: v.tolist() if hasattr(v, "tolist") else list(v)  # noqa: E731
    ids, mask = listed(ids), listed(mask)
    if ids and isinstance(ids[0], list):  # SpecForge keeps a leading batch axis
        ids, mask = ids[0], mask[0]
    return tuple(ids), tuple(mask)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def same(pipeline: list[tuple], per_row: list[tuple]) -> bool:
    return sorted(pipeline) == sorted(per_row)


def specforge_ids(args: dict, tok) -> dict:
    from specforge.data.prompt_builder import prepare_prompt_tasks

    path = Path(args["export"]) / "token_ids/train.jsonl"
    ids = [r["id"] for r in read_jsonl(path)]
    tasks = prepare_prompt_tasks(
        path,
        tok,
        chat_template=None,
        max_length=MAX_LENGTH,
        is_preformatted=False,
        train_only_last_turn=False,
        cache_dir=None,
        cache_key=None,
        num_proc=1,
    )
    got = [pair(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]
    return {"rows": dict(zip(ids, got, strict=True)) if len(got) == len(ids) else {}, "n": len(got)}


def speculators_prepare(model: str, data: Path, endpoint: str | None) -> list[tuple]:
    """`speculators prepare-data` (the CLI's function) into a temporary folder, read back."""
    from datasets import load_from_disk
    from speculators.cli.prepare_data import prepare_data

    with tempfile.TemporaryDirectory() as out:
        prepare_data(
            model=model,
            data=[str(data)],
            output=out,
            seq_length=MAX_LENGTH,
            render_endpoint=endpoint,
            num_preprocessing_workers=1,
            allow_empty_output=True,
        )
        rows = load_from_disk(out)
        return [pair(r["input_ids"], r["loss_mask"]) for r in rows]


def speculators_ids(args: dict, tok) -> dict:
    path = Path(args["export"]) / "token_ids/train.jsonl"
    got = speculators_prepare(args["model"], path, None)
    return {"multiset": [list(map(list, p)) for p in got], "n": len(got)}


def register(args: dict) -> str:
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate

    spec = dict(args["template"])
    name = spec.pop("name")
    if name not in TEMPLATE_REGISTRY.get_all_template_names():
        TEMPLATE_REGISTRY.register(name=name, template=ChatTemplate(**spec))
    return name


def specforge_conv(args: dict, tok) -> dict:
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.data.template import TEMPLATE_REGISTRY

    name = register(args)
    path = Path(args["export"]) / "specforge/train.jsonl"
    rows, only_last = read_jsonl(path), args["train_only_last_turn"]
    tasks = prepare_prompt_tasks(
        path,
        tok,
        chat_template=name,
        max_length=MAX_LENGTH,
        is_preformatted=False,
        train_only_last_turn=only_last,
        cache_dir=None,
        cache_key=None,
        num_proc=1,
        min_loss_tokens=0,
    )
    pipeline = [pair(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]
    out = preprocess_conversations(
        tok,
        [r["conversations"] for r in rows],
        TEMPLATE_REGISTRY.get(name),
        MAX_LENGTH,
        train_only_last_turn=only_last,
        tools=[r.get("tools") or [] for r in rows],
    )
    per_row = [pair(i, m) for i, m in zip(out["input_ids"], out["loss_mask"], strict=True)]
    return {
        "rows": {r["id"]: p for r, p in zip(rows, per_row, strict=True)},
        "pipeline_same": same(pipeline, per_row),
        "n": len(pipeline),
    }


def speculators_conv(args: dict, tok) -> dict:
    from speculators.data_generation.preprocessing import _preprocess_batch

    path = Path(args["export"]) / "specforge/train.jsonl"
    endpoint = args["render_endpoint"]
    pipeline = speculators_prepare(args["model"], path, endpoint)
    rows, per = read_jsonl(path), {}
    for r in rows:  # the function prepare-data maps over its batches, one conversation each
        got = _preprocess_batch(
            {"conversations": [r["conversations"]], "tools": [r.get("tools")]},
            False,
            endpoint,
            MAX_LENGTH,
        )
        per[r["id"]] = [pair(i, m) for i, m in zip(got["input_ids"], got["loss_mask"], strict=True)]
    flat = [p for ps in per.values() for p in ps]
    return {"rows": per, "pipeline_same": same(pipeline, flat), "n": len(pipeline)}


ROUTES = {
    "specforge_ids": specforge_ids,
    "speculators_ids": speculators_ids,
    "specforge_conv": specforge_conv,
    "speculators_conv": speculators_conv,
}


def main(args: dict) -> dict:
    import logging

    from transformers import AutoTokenizer

    logging.disable(logging.WARNING)
    tok = AutoTokenizer.from_pretrained(args["model"], local_files_only=True)
    return {route: ROUTES[route](args, tok) for route in args["routes"]}


if __name__ == "__main__":
    import contextlib
    import os
    import warnings

    warnings.simplefilter("ignore")
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # the trainers print progress: JSON alone on stdout
        result = main(json.loads(sys.argv[1]))
    os.write(1, json.dumps(result).encode())
