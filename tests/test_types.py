"""kit.RunConfig: validation on construction, budgets_for, dict round trip, fingerprint."""

from __future__ import annotations

import json

import pytest

import kit
from kit.types import RunConfig, Sampling

URL = "http://127.0.0.1:8000/v1"


def config(**changes) -> RunConfig:
    base = dict(model="smol", endpoints=URL, budgets={"a": 300, "b": 200})
    return RunConfig(**(base | changes))


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("model", "", "''"),
        ("endpoints", [], "[]"),
        ("budgets", -1, "-1"),
        ("budgets", "x", "'x'"),
        ("concurrency", 0, "0"),
        ("policy", "x", "'x'"),
        ("api", "x", "'x'"),
        ("max_attempts", 0, "0"),
        ("timeout", -1, "-1"),
        ("max_consecutive_failures", 0, "0"),
        ("max_consecutive_failures", True, "True"),
    ],
)
def test_a_bad_field_raises_naming_the_field_and_the_value(field, value, shown):
    with pytest.raises(ValueError) as err:
        config(**{field: value})
    msg = str(err.value)
    assert msg.startswith(f"RunConfig.{field} must be ") and msg.endswith(f"got {shown}"), msg


@pytest.mark.parametrize("value", [0, -5, "x", float("nan")])
def test_a_bad_budget_in_the_dict_names_its_dataset_and_value(value):
    with pytest.raises(ValueError) as err:
        config(budgets={"a": 10, "b": value})
    msg = str(err.value)
    assert msg.startswith("RunConfig.budgets: budget for dataset 'b'"), msg
    assert msg.endswith(f"got {value!r}"), msg


def test_one_endpoint_string_becomes_a_list_and_a_sampling_dict_a_sampling():
    c = config(sampling={"max_tokens": 64, "n": 2})
    assert c.endpoints == [URL] and c.sampling == Sampling(max_tokens=64, n=2)


def test_one_int_budget_expands_to_every_dataset():
    c = config(budgets=4000)
    assert c.budgets_for(["x", "y", "z"]) == {"x": 4000, "y": 4000, "z": 4000}
    assert c.budgets_for([]) == {}


def test_budgets_for_names_missing_and_extra_datasets():
    c = config(budgets={"a": 300, "b": 200})
    assert c.budgets_for(["a", "b"]) == {"a": 300, "b": 200}
    with pytest.raises(ValueError, match=r"no entry for datasets \['c'\]"):
        c.budgets_for(["a", "b", "c"])
    with pytest.raises(ValueError, match=r"names datasets \['b'\] that have no prompts"):
        c.budgets_for(["a"])


def test_fractional_budgets_round_up():
    assert config(budgets={"a": 10.2}).budgets == {"a": 11}


def test_to_dict_from_dict_round_trip_through_json():
    c = config(
        sampling=Sampling(max_tokens=64, temperature=0.2, seed=3, n=2),
        tokenizer="/m",
        api="vllm",
        api_key_env="KIT_KEY",
        concurrency=8,
        per_endpoint_concurrency=4,
        policy="cancel",
        seed=7,
        max_attempts=2,
        max_context=4096,
        timeout=30.0,
        max_consecutive_failures=5,
        source_hashes={"a": "h1"},
        datasets={"a": "data/a.jsonl"},
        chat_template_hash="t",
    )
    again = RunConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.fingerprint() == c.fingerprint()
    assert RunConfig.from_dict(c.to_dict() | {"from_a_newer_kit": 1}) == c  # unknown keys ignored


def test_url_credentials_are_used_but_never_written_nor_shown():
    with pytest.warns(UserWarning, match="api_key_env"):
        c = config(endpoints=["http://al:pw-S3cret@h:1/v1", URL])
    assert c.endpoints[0] == "http://al:pw-S3cret@h:1/v1"  # what the backend authenticates with
    assert c.to_dict()["endpoints"] == ["http://h:1/v1", URL]
    assert "S3cret" not in repr(c) and "S3cret" not in json.dumps(c.to_dict())
    assert RunConfig.from_dict(c.to_dict()).endpoints == ["http://h:1/v1", URL]


def test_fingerprint_follows_what_changes_outputs():
    base = config()
    assert config().fingerprint() == base.fingerprint()
    assert config(sampling=Sampling(max_tokens=128)).fingerprint() != base.fingerprint()
    assert config(model="other").fingerprint() != base.fingerprint()
    same = config(
        concurrency=3,
        budgets=99,
        endpoints=["http://h:2/v1", "http://h:3/v1"],
        timeout=5.0,
        max_attempts=1,
        policy="cancel",
    )
    assert same.fingerprint() == base.fingerprint()
    parts = config(sampling=Sampling(max_tokens=128)).fingerprint_parts()
    assert parts["sampling"]["max_tokens"] == 128 and set(parts) == {
        "model",
        "sampling",
        "chat_template_hash",
        "source_hashes",
    }
    # what issue 12 added changes the fingerprint when set, and leaves older runs' alone
    assert config(turns="all_turns").fingerprint() != base.fingerprint()
    assert (
        config(template_kwargs={"a": {"enable_thinking": False}}).fingerprint()
        != base.fingerprint()
    )
    thinking = Sampling(chat_template_kwargs={"enable_thinking": True})
    assert config(sampling=thinking).fingerprint() != base.fingerprint()
    penalised = config(sampling=Sampling(frequency_penalty=0.5))
    assert penalised.fingerprint() != base.fingerprint()
    assert penalised.fingerprint_parts()["sampling"]["frequency_penalty"] == 0.5
    assert config(sampling=Sampling(presence_penalty=0.5)).fingerprint() != base.fingerprint()
    unpenalised = config(sampling=Sampling(frequency_penalty=0.0)).fingerprint_parts()
    assert unpenalised["sampling"] == {  # a penalty of 0 is left out: older runs resume
        "max_tokens": 1024,
        "temperature": 0.5,
        "top_p": 1.0,
        "seed": None,
        "n": 1,
    }


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [2.5, -3, "0.5", None])
def test_penalties_out_of_range_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"Sampling.{name} must be in \[-2, 2\], got"):
        Sampling(**{name: value})


def test_public_names():
    assert kit.RunConfig is RunConfig and kit.Sampling is Sampling
