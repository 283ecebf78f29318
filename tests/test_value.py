"""Regeneration value (kit.plan.value): own answers scored by the target in the pilot.

The real path on the embedded vLLM (one shared server, one greedy pilot): the target's own
greedy answers scored back are its top-1 but for named near-ties, shuffled answers score far
below the true ones, a fixed paraphrase between, messages and kit's token ids score alike.
SGLang's /generate logprob shapes and the bad inputs on tests/faultserver.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer, is_top1, token_logprob

import kit
from kit.plan import value as pv
from kit.run.backends import make_backend, score
from kit.tokens import encode_many, load_tokenizer, render

QUESTIONS = [
    "What is the boiling point of water at sea level in Celsius?",
    "Which planet is closest to the Sun?",
    "How many sides does a hexagon have?",
    "Name a primary color.",
    "What is the capital of France?",
    "Give one word that rhymes with cat.",
    "What do bees make?",
    "How many days are in a week?",
    "What gas do plants take in?",
    "What is 3 plus 4?",
    "Which animal says moo?",
    "What color is the sky on a clear day?",
]
# nats: a missed token this close to the top-1 is a near-tie: the embedded model's bf16 logits
# move in steps of 1/16 to 1/8 here, and a prefill's sums differ from the decode's by a step
TIE = 0.15


def prompts(dataset: str, answers: list[str | None]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "dataset": [dataset] * len(answers),
            "prompt_id": [f"p{i:02d}" for i in range(len(answers))],
            "messages": [[{"role": "user", "content": q}] for q in QUESTIONS[: len(answers)]],
            "answer": answers,
        },
        schema_overrides={"answer": pl.String},
    )


def paraphrase(text: str) -> str:
    """A fixed rewording: another writer's opening, then the target's own words."""
    return "Well, to put it simply and briefly: " + text


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


@pytest.fixture(scope="module")
def greedy(vllm_server, tmp_path_factory):
    """(config, greedy pilot records): the target's own answers at temperature 0."""
    config = kit.RunConfig(
        model=vllm_server.model,
        endpoints=vllm_server.base_url,
        api=vllm_server.api,
        budgets=1,
        sampling=kit.Sampling(max_tokens=96, temperature=0.0, seed=1),
        tokenizer=vllm_server.tokenizer_path,
        concurrency=12,
        timeout=900,
    )
    run_dir = tmp_path_factory.mktemp("greedy") / "pilot"
    res = kit.plan.pilot_sync(
        prompts("q", [None] * 12), config, per_dataset=12, run_dir=run_dir, value=False
    )
    assert res.value is None and res.frame.height == 12
    from kit.run.reader import record_batches

    recs = pl.concat(
        record_batches(run_dir, columns=["prompt_id", "completion", "finish_reason", "output_ids"])
    )
    return config, recs.sort("prompt_id")


@pytest.mark.server
def test_vllm_greedy_answers_are_top1_shuffled_far_paraphrase_between(greedy, vllm_server):
    config, recs = greedy
    stopped = recs.filter(pl.col("finish_reason") == "stop")
    assert stopped.height >= 8, recs.select("prompt_id", "finish_reason")
    texts = stopped["completion"].to_list()
    idx = [int(p[1:]) for p in stopped["prompt_id"]]
    sel = lambda answers: [answers[idx.index(i)] if i in idx else None for i in range(12)]  # noqa: E731
    frame = pl.concat(
        [
            prompts("true", sel(texts)),
            prompts("shuffled", sel(texts[1:] + texts[:1])),
            prompts("paraphrase", sel([paraphrase(t) for t in texts])),
            prompts("none", [None] * 12),
        ]
    )
    res = kit.plan.pilot_sync(frame, config, per_dataset=12)
    v = {r["dataset"]: r for r in res.value.iter_rows(named=True)}
    assert v["none"]["status"] == "no own answers" and v["none"]["own_logprob"] is None
    for name in ("true", "shuffled", "paraphrase"):
        assert v[name]["status"] == "measured", v[name]
        assert v[name]["prompts"] == stopped.height and v[name]["cut"] == 0
        # one request per own answer: vLLM returned the pilot's answers' logprobs, aligned
        assert v[name]["requests"] == stopped.height, v[name]
    # the target's greedy answers, scored back from its own ids: top-1 but for named near-ties
    tok = load_tokenizer(config.tokenizer)
    backend = make_backend(config.api, config.endpoints[0], config.model)

    def scored(p, ids):  # a fresh session per call: each asyncio.run has its own loop
        async def go():
            try:
                return await score(backend, p, ids, timeout=300)
            finally:
                await backend.aclose()

        return asyncio.run(go())

    ties, total = [], 0
    for msgs, ids in zip(
        frame["messages"][:12].to_list(), recs["output_ids"].to_list(), strict=True
    ):
        p = render(tok, [msgs], tokenize=True)[0]
        lps, top = scored(p, ids)
        total += len(ids)
        for j, ok in enumerate(top):
            if not ok:
                raw = post(
                    config.endpoints[0] + "/completions",
                    {
                        "model": config.model,
                        "prompt": p + ids[: j + 1],
                        "max_tokens": 1,
                        "prompt_logprobs": 1,
                    },
                )
                entry = raw["choices"][0]["prompt_logprobs"][-1]
                best = max(e["logprob"] for e in entry.values())
                ties.append((ids[j], round(best - lps[j], 4)))
    assert all(gap < TIE for _, gap in ties), ties  # every miss a named near-tie
    assert len(ties) <= total * 0.05, (ties, total)
    # the pilot's own answers to the same prompts (greedy again) scored alike
    # (a second greedy pass, batched otherwise: its own near-ties, at most the same 5%)
    assert v["true"]["target_top1"] >= 0.95
    # true answers re-tokenized from text: about the target's own
    assert v["true"]["own_top1"] >= 0.9
    assert abs(v["true"]["own_logprob"] - v["true"]["target_logprob"]) < 0.3
    assert "close" in v["true"]["reading"]
    # shuffled: far below, intervals apart; the paraphrase in between
    assert v["shuffled"]["own_logprob_hi"] < v["true"]["own_logprob_lo"]
    assert v["shuffled"]["own_logprob"] < v["true"]["own_logprob"] - 1.0
    assert v["shuffled"]["own_logprob"] < v["paraphrase"]["own_logprob"] < v["true"]["own_logprob"]
    assert v["paraphrase"]["own_top1"] < v["true"]["own_top1"]
    # not "close" (how far it reads depends on the model: the 135M one is flat, ~1.2 nats)
    assert "regenerat" in v["shuffled"]["reading"] and "close" not in v["shuffled"]["reading"]
    text = pv.value_text(res.value)
    print(text, f"\nnamed near-ties: {ties} of {total} tokens")
    assert "none: no own answers" in text and "shuffled: own" in text
    # scores identical whether the prompt is sent as messages or as kit's rendered ids
    msgs, answer = frame["messages"].to_list()[idx[0]], texts[0]
    via = post(
        config.endpoints[0] + "/chat/completions",
        {
            "model": config.model,
            "messages": [*msgs, {"role": "assistant", "content": answer}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 1,
            "prompt_logprobs": 1,
            "return_token_ids": True,
        },
    )
    p = render(tok, [msgs], tokenize=True)[0]
    a = encode_many(tok, [answer])[0]
    assert via["prompt_token_ids"] == p + a
    served = [
        e[str(t)]["logprob"] for t, e in zip(a, via["prompt_logprobs"][len(p) :], strict=True)
    ]
    mine = scored(p, a)[0]
    assert max(abs(x - y) for x, y in zip(served, mine, strict=True)) < 1e-4


@pytest.mark.server
def test_vllm_returned_logprobs_agree_with_a_prefill_of_the_same_answer(vllm_server):
    """The two methods of kit.plan.value on one server: sampled answers' logprobs as vLLM
    returns them (own_logprobs) and the same ids scored back by prefill (score)."""
    from kit.run.backends import own_logprobs

    backend = make_backend(vllm_server.api, vllm_server.base_url, vllm_server.model)
    sampling = kit.Sampling(max_tokens=48, temperature=0.7, seed=3)

    async def go():
        try:
            with own_logprobs() as returned:
                for q in QUESTIONS[:6]:
                    msgs = [{"role": "user", "content": q}]
                    await backend.complete(msgs, sampling, timeout=300)
            return [
                (key, got, await score(backend, *key, timeout=300)) for key, got in returned.items()
            ]
        finally:
            await backend.aclose()

    pairs = asyncio.run(go())
    assert len(pairs) == 6  # every answer came with its logprobs, aligned on its ids
    gaps, flips, total, tops = [], [], 0, [0, 0]
    for (_, answer), (lp_dec, top_dec), (lp_pre, top_pre) in pairs:
        total += len(answer)
        tops[0] += sum(top_dec)
        tops[1] += sum(top_pre)
        gaps += [abs(a - b) for a, b in zip(lp_dec, lp_pre, strict=True)]
        flips += [
            (t, round(a - b, 4))
            for t, a, b, x, y in zip(answer, lp_dec, lp_pre, top_dec, top_pre, strict=True)
            if x != y
        ]
    print(
        f"{total} tokens: |decode - prefill| max {max(gaps):.4f} mean {sum(gaps) / total:.5f} "
        f"nats, top-1 {tops}, flips {flips}"
    )
    assert max(gaps) < pv.AGREE, max(gaps)
    # what the measure reports, the mean per token, the same within 0.05 nats (0.01 and 0.022
    # measured in two runs: batching moves bf16 rounding), a tenth of the CLOSE reading's 0.5
    assert sum(gaps) / total < 0.05, sum(gaps) / total
    assert sum(tops) < 2 * total  # sampled at 0.7: some tokens are not the top-1
    # top-1 the same token by token but for near-ties the two sums order apart (each a
    # token within AGREE of the top, by the bound above), so the top-1 shares within 5%
    assert len(flips) <= total * 0.05, (tops, flips)


def fault_config(srv, model_dir, api="sglang", **kw) -> kit.RunConfig:
    url = srv.root_url if api == "sglang" else srv.base_url
    base = dict(
        model="m",
        endpoints=url,
        api=api,
        budgets=1,
        tokenizer=str(model_dir),
        sampling=kit.Sampling(max_tokens=16),
        concurrency=4,
        max_attempts=1,
    )
    return kit.RunConfig(**(base | kw))


ANSWERS = [
    "Water boils at one hundred degrees.",
    "Mercury.",
    "Six.",
    "Red is one.",
    "Paris, the capital.",
    "Hat.",
]


@pytest.mark.server  # the real model's tokenizer; no model server
def test_sglang_generate_logprob_shapes_scored_and_aligned(model_dir, tmp_path):
    frame = pl.concat([prompts("own", ANSWERS), prompts("bare", [None] * 6)])
    with FaultServer(FaultConfig(min_words=4, max_words=12)) as srv:
        # temperature 1: /generate's output logprobs are the raw ones, as a prefill's
        config = fault_config(srv, model_dir, sampling=kit.Sampling(max_tokens=16, temperature=1))
        off = kit.plan.pilot_sync(
            frame, config, per_dataset=6, run_dir=tmp_path / "off", value=False
        )
        requests_off = srv.stats()["paths"]["/generate"]
        on = kit.plan.pilot_sync(frame, config, per_dataset=6, run_dir=tmp_path / "on")
        requests_on = srv.stats()["paths"]["/generate"] - requests_off
        body = srv.last_body
        # at 0.7 they are scaled: the pilot's answers are scored by prefill as the dataset's
        warm = kit.plan.pilot_sync(frame, fault_config(srv, model_dir), per_dataset=6)
        requests_warm = srv.stats()["paths"]["/generate"] - requests_off - requests_on
    assert requests_warm == 12 + 6 + 6 and warm.value["requests"].to_list() == [None, 12]
    # the measurement changes no completion, record or budget
    keep = [
        "dataset",
        "prompt_id",
        "completion_tokens",
        "finish_reason",
        "count_source",
        "prompt_tokens",
    ]
    assert on.frame.select(keep).equals(off.frame.select(keep))
    from kit.run.reader import record_batches

    cols = ["dataset", "prompt_id", "sample", "completion", "output_ids", "completion_tokens"]
    recs = [
        pl.concat(record_batches(tmp_path / d, columns=cols)).sort("prompt_id", "dataset")
        for d in ("off", "on")
    ]
    assert recs[0].equals(recs[1]) and recs[0].height == 12
    b_on = kit.plan.budget({"own": 500, "bare": 500}, on, prompts_available={"own": 6, "bare": 6})
    b_off = kit.plan.budget({"own": 500, "bare": 500}, off, prompts_available={"own": 6, "bare": 6})
    assert b_on.equals(b_off)
    # one request per own answer; the pilot's answers came with their logprobs
    assert requests_on == 12 + 6 and on.value["requests"].to_list() == [None, 6]
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 1
    assert body["sampling_params"]["max_new_tokens"] == 1
    # the numbers are the server's, token by token (aligned on the answer's own positions)
    tok = load_tokenizer(model_dir)
    want_lp, want_top, n = 0.0, 0, 0
    for msgs, answer in zip(frame["messages"][:6].to_list(), ANSWERS, strict=True):
        p = render(tok, [msgs], tokenize=True)[0]
        a = encode_many(tok, [answer])[0] + [tok.eos_token_id]
        for j, t in enumerate(a):
            want_lp += token_logprob(len(p) + j, t)
            want_top += is_top1(len(p) + j, t)
            n += 1
    # the pilot's answers: the output logprobs /generate returned with them, same positions
    mine = pl.concat(
        record_batches(tmp_path / "on", columns=["dataset", "prompt_ids", "output_ids"])
    ).filter(pl.col("dataset") == "own")
    got_lp, got_top, m = 0.0, 0, 0
    for p, out in mine.select("prompt_ids", "output_ids").rows():
        for j, t in enumerate(out):
            got_lp += token_logprob(len(p) + j, t)
            got_top += is_top1(len(p) + j, t)
            m += 1
    v = {r["dataset"]: r for r in on.value.iter_rows(named=True)}
    assert v["bare"]["status"] == "no own answers"
    assert v["own"]["status"] == "measured" and v["own"]["tokens"] == n
    assert v["own"]["own_logprob"] == pytest.approx(want_lp / n)
    assert v["own"]["own_top1"] == pytest.approx(want_top / n)
    assert v["own"]["target_logprob"] == pytest.approx(got_lp / m)
    assert v["own"]["target_top1"] == pytest.approx(got_top / m)
    assert v["own"]["own_logprob_lo"] <= v["own"]["own_logprob"] <= v["own"]["own_logprob_hi"]
    assert on.summary()["value"][1]["own_logprob"] == v["own"]["own_logprob"]


@pytest.mark.server  # the real model's tokenizer; no model server
@pytest.mark.parametrize(
    ("api", "logprobs", "why"),
    [
        ("openai", "ok", "refused a scoring request: .*404"),  # a plain OpenAI endpoint
        ("sglang", "none", "gave no input_token_logprobs"),  # an SGLang that ignores it
        ("sglang", "short", "MalformedAnswer"),  # fewer positions than asked: every one failed
    ],
)
def test_a_server_that_cannot_score_says_not_measured_never_zeros(model_dir, api, logprobs, why):
    with FaultServer(FaultConfig(logprobs=logprobs)) as srv:
        res = kit.plan.pilot_sync(
            prompts("own", ANSWERS), fault_config(srv, model_dir, api), per_dataset=6
        )
    row = res.value.row(0, named=True)
    assert row["status"].startswith("not measured: ") and re.search(why, row["status"]), row
    assert row["own_logprob"] is None and row["own_top1"] is None and row["target_logprob"] is None
    assert res.frame.height == 6 and "not measured" in pv.value_text(res.value)


@pytest.mark.server  # the real model's tokenizer; no model server
def test_answers_longer_than_the_context_are_cut_and_counted(model_dir):
    long = ["word " * 400, "Six.", "word " * 250, "Red.", "Paris.", "word " * 300]
    tok = load_tokenizer(model_dir)
    with FaultServer(FaultConfig(min_words=2, max_words=4)) as srv:
        config = fault_config(srv, model_dir, max_context=200)
        res = kit.plan.pilot_sync(prompts("own", long), config, per_dataset=6)
    row = res.value.row(0, named=True)
    room = [
        200 - len(render(tok, [[{"role": "user", "content": q}]], tokenize=True)[0]) - 1
        for q in QUESTIONS[:6]
    ]
    lengths = [len(a) + 1 for a in encode_many(tok, long)]
    assert row["cut"] == sum(n > r for n, r in zip(lengths, room, strict=True)) == 3
    assert row["tokens"] == sum(min(n, r) for n, r in zip(lengths, room, strict=True))


def test_interval_and_reading():
    per_prompt = [(-2.0, 4, 3), (-6.0, 4, 1), (-1.0, 2, 2)]
    point, lo, hi = pv.interval(per_prompt, 0)
    assert point == pytest.approx(-0.9) and lo < point < hi
    assert pv.interval(per_prompt[:1], 2) == (0.75, None, None)
    row = {"own_logprob": -0.7, "target_logprob": -0.5, "own_top1": 0.8, "target_top1": 0.85}
    assert pv.reading(row).startswith("own answers close")
    assert "regeneration helps" in pv.reading(row | {"own_logprob": -1.5})
    assert pv.reading(row | {"own_logprob": -3.0}).endswith(": regenerate")


def test_kit_plan_prints_and_stores_the_value(tmp_path, monkeypatch, capsys):
    from test_cli import CHAT, fake_pilot, run_main

    def pilot_with_value(prompts, config, **kw):
        res = fake_pilot(prompts, config, **kw)
        scored = {
            "own": [("p1", [-2.0, -3.0], [True, False]), ("p2", [-2.5], [False])],
            "target": [("p1", [-0.5, -0.4], [True, True]), ("p2", [-0.3], [True])],
            "cut": 1,
            "failed": 0,
            "requests": 4,
        }
        res.value = pl.DataFrame([pv._row("chat_general", "measured", scored)], schema=pv.schema())
        return res

    fake_pilot.calls = []
    monkeypatch.setattr(kit.plan, "pilot_sync", pilot_with_value)
    run_dir = tmp_path / "run"
    argv = [
        "plan",
        "--samples",
        str(CHAT),
        "--run-dir",
        str(run_dir),
        "--budget",
        "3000",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--max-tokens",
        "64",
    ]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    assert "chat_general: own -2.50" in out and "1 cut to the context" in out
    assert "far from the target's" in out and ": regenerate" in out
    table = kit.plan.read_plan(run_dir)["table"]
    row = table.filter(pl.col("dataset") == "chat_general").row(0, named=True)
    assert row["own_logprob"] == -2.5 and row["value"].startswith("far from the target's")
    assert kit.plan.read_plan(run_dir)["pilot"]["value"][0]["own_top1"] == pytest.approx(1 / 3)
    code, out, _ = run_main(["plan", "--show", str(run_dir)], capsys)
    assert code == 0 and "chat_general: own -2.50" in out
