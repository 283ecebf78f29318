"""Hidden-state disk in the plan (issue 25 item 6): bytes of an offline EAGLE-3 dump from the
target's config.json, budgets given in bytes, bad configs refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from test_cli import run_main

import kit
from kit.cli import commands
from kit.plan import hidden

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "data" / "samples" / "chat_general.jsonl"
SMOL = REPO / "data" / "models" / "SmolLM2-135M-Instruct"


def write_config(path: Path, **fields) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_embedded_target_shape_and_bytes_per_token():
    shape = hidden.target_shape(SMOL)
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (576, 30, 49152)
    assert shape.bytes_per_token == 4 * 576 * 2  # 3 aux layers + the last, bf16


def test_known_config_byte_count(tmp_path):
    """Llama-3.1-8B's shape (hidden 4096): 32,768 bytes a token; a plan of two datasets."""
    cfg = write_config(
        tmp_path / "config.json", hidden_size=4096, num_hidden_layers=32, vocab_size=128256
    )
    shape = hidden.target_shape(cfg)
    pilot = pl.DataFrame(
        {
            "dataset": ["a"] * 4 + ["b"] * 4,
            "completion_tokens": [100, 200, 300, 400, 1000, 1000, 1000, 1000],
            "prompt_tokens": [50, 50, 50, 50, 10, 20, 30, 40],
        }
    )
    table = kit.plan.budget(
        {"a": 25_000, "b": 50_000}, pilot, prompts_available={"a": 1000, "b": 1000}
    )
    out = kit.plan.hidden_states(table, pilot, shape)
    rows = {r["dataset"]: r for r in out.iter_rows(named=True)}
    # a: 25,000 / 250 = 100 samples x 50 prompt tokens; b: 50 samples x 25
    assert rows["a"]["sequence_tokens"] == 25_000 + 5_000
    assert rows["b"]["sequence_tokens"] == 50_000 + 1_250
    assert rows["a"]["hidden_bytes"] == 30_000 * 32_768 == 983_040_000
    assert rows["TOTAL"]["hidden_bytes"] == (30_000 + 51_250) * 32_768
    assert "2.66 GB" in hidden.hidden_text(out, shape)  # 81,250 x 32,768 = 2.66e9


def test_multimodal_config_uses_text_config(tmp_path):
    cfg = write_config(
        tmp_path / "config.json", text_config={"hidden_size": 5120, "num_hidden_layers": 64}
    )
    assert hidden.target_shape(tmp_path).bytes_per_token == 4 * 5120 * 2
    assert hidden.target_shape(cfg).vocab_size is None


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "is not JSON"),
        ('{"num_hidden_layers": 32}', "hidden_size must be a positive int, got None"),
        (
            '{"hidden_size": "4096", "num_hidden_layers": 32}',
            "hidden_size must be a positive int, got '4096'",
        ),
        ("[1, 2]", "is not a JSON object"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, content, needle):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match="config.json") as e:
        hidden.target_shape(tmp_path)
    assert needle in str(e.value)


def test_missing_config_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'} does not exist"):
        hidden.target_shape(tmp_path / "nope")


def test_parse_plan_budgets_bytes_and_tokens():
    assert commands.parse_plan_budgets(["2TB"]) == (1, 2 * 10**12)
    assert commands.parse_plan_budgets(["1e6"]) == (1_000_000, {})
    assert commands.parse_plan_budgets(["a=1e6", "b=1.5GiB"]) == (
        {"a": 1_000_000, "b": 1},
        {"b": 1610612736},
    )
    with pytest.raises(ValueError, match="only kit plan converts them"):
        commands.parse_budgets(["2TB"])  # kit generate has no pilot to convert with


def fake_pilot(prompts, config, *, per_dataset, progress=None):
    """12 completions of 40..62 tokens (mean 51) with 20-token prompts per dataset."""
    names = sorted(getattr(prompts, "frame", prompts)["dataset"].unique().to_list())
    rows = [
        {
            "dataset": d,
            "prompt_id": f"p{i}",
            "completion_tokens": 40 + 2 * i,
            "finish_reason": "stop",
            "count_source": "usage",
            "prompt_tokens": 20,
            "latency_s": 0.1,
        }
        for d in names
        for i in range(12)
    ]
    return kit.plan.PilotResult(frame=pl.DataFrame(rows), wall_s=2.0, sampling=config.sampling)


def test_plan_budget_in_bytes_converts_to_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kit.plan, "pilot_sync", fake_pilot)
    cfg = write_config(
        tmp_path / "config.json", hidden_size=64, num_hidden_layers=8
    )  # 512 B a token
    run_dir = tmp_path / "run"
    argv = [
        "plan",
        "--samples",
        str(CHAT),
        "--run-dir",
        str(run_dir),
        "--budget",
        "1MB",
        "--target-config",
        str(cfg),
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
    ]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    # 1e6 / 512 = 1953.1 sequence tokens, of which 51 / (51 + 20) are completion: 1402
    assert kit.plan.read_plan(run_dir)["config"].budgets == {"chat_general": 1402}
    assert "1.00 MB of hidden states = 1,402 completion tokens" in out
    # 28 samples x 20 prompt tokens + 1,402 = 1,962 tokens x 512 B = 1,004,544 B
    assert "chat_general: 1.00 MB (1,962 tokens in 28 samples)" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--target-config", "/nowhere/cfg"], "/nowhere/cfg does not exist"),
        ([], "needs the target's config.json: give --target-config"),
    ],
)
def test_plan_refuses_bad_target_config_before_any_work(
    tmp_path, monkeypatch, capsys, extra, needle
):
    monkeypatch.setattr(kit.plan, "pilot_sync", lambda *a, **k: pytest.fail("piloted"))
    argv = [
        "plan",
        "--samples",
        str(CHAT),
        "--run-dir",
        str(tmp_path / "run"),
        "--budget",
        "2TB",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        *extra,
    ]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert err.startswith("kit: error: ") and needle in err, err
