"""The `kit` command: prepare, serve, lab, demo, plan, generate, watch, audit, records, export,
validate.

Every subcommand is a thin wrapper over the package (kit.cli.commands; the demo in
kit.cli.demo). `kit plan` builds one kit.RunConfig from its flags, pilots and stores the
plan in the run database; `kit generate` reads it back, applies only the flags given, and
runs or resumes on the plan's server; `kit demo` executes the four notebooks against the
embedded server.

Any kit.errors.KitError is one line on stderr (`kit: error: <what and the fix>`, exit 2;
its exit_code: 1 for a failed write or notebook); a failure of the machine (a full disk, a
read-only or unreadable path) is one line too, exit 1; a run that stops early, or with a
dataset short of its budget (failed, stopped, prompts refused), says why and exits 1; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import sys

from kit.cli.commands import (
    REPO,
    SAMPLES,
    cmd_audit,
    cmd_export,
    cmd_generate,
    cmd_plan,
    cmd_prepare,
    cmd_records,
    cmd_serve,
    cmd_validate,
    cmd_watch,
)
from kit.cli.demo import cmd_demo
from kit.cli.lab import cmd_lab
from kit.data.formats import FORMATS
from kit.errors import KitError
from kit.plan.pilots import PILOT_PER_DATASET
from kit.secrets import redact, redacted_output
from kit.types import RunConfig, Sampling, default

__all__ = ["main", "parser"]


# ---------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `kit: error: <message>; see `kit CMD --help``, exit 2;
    every option's help ends with its default when it has one and does not say it already."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"kit: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


class _DefaultsFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False  # 0 is a default to show
        if unset or action.default == argparse.SUPPRESS or "default" in text:
            return text
        shown = " ".join(action.default) if isinstance(action.default, list) else action.default
        return f"{text} (default: {shown})"


def _server_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument(
        "--base-url",
        action="append" if many else "store",
        help="server base URL"
        + (" (repeat for several)" if many else "")
        + " (default: start the embedded server)",
    )
    p.add_argument("--model", help="model name the server expects (required with --base-url)")
    p.add_argument("--tokenizer", help="local path of the target's tokenizer")
    p.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        help="the embedded server's engine when no --base-url: vllm (the default for a new "
        "plan; returns the token ids) or transformers",
    )


def _run_args(p: argparse.ArgumentParser, d) -> None:
    """The RunConfig flags kit plan sets and kit generate may change (d: their default,
    RunConfig's for kit plan, None for kit generate)."""
    concurrency = d(default(RunConfig, "concurrency"))
    p.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight")
    p.add_argument(
        "--policy",
        choices=["drain", "cancel"],
        default=d("drain"),
        help="a dataset at its budget: let its requests in flight finish, or cancel them",
    )
    p.add_argument(
        "--api",
        choices=["openai", "vllm", "sglang"],
        default=d("openai"),
        help="the server's protocol: OpenAI chat, vLLM's (returns token ids) or SGLang's "
        "/generate (token ids; needs --tokenizer)",
    )
    p.add_argument("--api-key-env", help="NAME of the environment variable holding the API key")
    p.add_argument(
        "--timeout", type=float, help="read timeout per request in s (default: 120 + 0.5/token)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        help="bytes of an answer read at most (default: 64 KiB + 256 per max token + 8 per "
        "byte sent); a longer one is malformed",
    )


BUDGET_HELP = "TOKENS for every dataset, or NAME=TOKENS ... (completion tokens)"


def parser() -> argparse.ArgumentParser:
    """The argument parser of the `kit` command."""
    p = _Parser(prog="kit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("prepare", help="convert the embedded model once").set_defaults(fn=cmd_prepare)

    s = sub.add_parser("serve", help="run the embedded server until interrupted")
    s.add_argument("--host", default="127.0.0.1", help="listen address")
    s.add_argument("--port", type=int, help="TCP port (default: a free one)")
    s.add_argument("--temperature", type=float, default=0.7, help="server-wide sampling")
    s.add_argument("--top-p", type=float, default=1.0, help="server-wide nucleus sampling")
    s.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for start-up (default: vllm 1200, transformers 300)",
    )
    s.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="vllm",
        help="vllm (faster, returns token ids; `make vllm`) or transformers",
    )
    s.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        metavar="-- ENGINE FLAGS",
        help="flags for the engine after `--`, e.g. `kit serve -- --reasoning-parser qwen3 "
        "--enable-scale-out` (vLLM's own; kit sets the model, its name, host and port)",
    )
    s.set_defaults(fn=cmd_serve)

    lab = sub.add_parser(
        "lab", help="JupyterLab on notebooks/, which it saves without outputs (kept on screen)"
    )
    lab.add_argument(
        "jupyter_args",
        nargs=argparse.REMAINDER,
        metavar="-- JUPYTER ARGS",
        help="JupyterLab's own options after `--`, e.g. `kit lab -- --port 8890 --no-browser`",
    )
    lab.set_defaults(fn=cmd_lab)

    d = sub.add_parser(
        "demo", help="run the four notebooks (plan -> generate -> audit -> export) on the samples"
    )
    d.add_argument(
        "--run-dir",
        default=str(REPO / "data" / "runs" / "demo"),
        help="where the run, executed notebooks, charts and export go (cleared first)",
    )
    d.add_argument("--resume", action="store_true", help="keep the demo's run directory")
    _server_args(d)
    d.set_defaults(fn=cmd_demo)

    pl_ = sub.add_parser("plan", help="pilot and plan per-dataset token budgets (or --show one)")
    pl_.add_argument("--show", metavar="RUN_DIR", help="print the plan stored in RUN_DIR and exit")
    pl_.add_argument("--samples", nargs="+", default=[str(SAMPLES)], help="files or folders")
    pl_.add_argument(
        "--format",
        nargs="+",
        metavar="[NAME=]FORMAT",
        help=f"force one prompt format ({', '.join(FORMATS)}) for every source, or NAME=FORMAT "
        "for a dataset (named by its file stem) (default: detect)",
    )
    pl_.add_argument(
        "--mapping",
        nargs="+",
        metavar="[NAME=]JSON",
        help='JSON column mapping for every source, e.g. \'{"prompt": "question", "system": "sys"}\', '
        '\'{"messages": "dialog"}\' or \'{"turns": "turns"}\' (a list of user turns); or one per '
        'dataset: gsm8k=\'{"prompt": "question"}\' humaneval=\'{"prompt": "prompt"}\'',
    )
    pl_.add_argument(
        "--strip",
        action="store_true",
        help="strip leading and trailing whitespace from message contents (default: as given)",
    )
    pl_.add_argument(
        "--turns",
        choices=["last_turn", "all_turns"],
        default="last_turn",
        help="multi-turn prompts: generate the last assistant turn only, or every one in order "
        "(all_turns; needed by lists of user turns such as MT-bench); kept with the plan",
    )
    pl_.add_argument("--run-dir", help="the run directory the plan goes into (required)")
    pl_.add_argument(
        "--budget",
        nargs="+",
        help=f"(required) {BUDGET_HELP}; or bytes of hidden states of an offline EAGLE-3 dump (2TB, 500GiB, "
        "NAME=1TB), converted to completion tokens from the pilot's lengths",
    )
    pl_.add_argument(
        "--target-config",
        metavar="PATH",
        help="the target's config.json or model folder (hidden_size, num_hidden_layers), for the "
        "hidden-state disk of the plan (default: the tokenizer's folder when it holds one)",
    )
    pl_.add_argument(
        "--max-tokens",
        type=int,
        default=default(Sampling, "max_tokens"),
        help="completion tokens per request at most",
    )
    pl_.add_argument(
        "--temperature",
        type=float,
        default=default(Sampling, "temperature"),
        help="sampling temperature",
    )
    pl_.add_argument(
        "--frequency-penalty",
        type=float,
        default=default(Sampling, "frequency_penalty"),
        help="OpenAI frequency_penalty in [-2, 2]: lowers tokens by how often the answer has used "
        "them, which breaks a small model's loops; 0 for a target served without it (sent only "
        "when not 0)",
    )
    pl_.add_argument(
        "--presence-penalty",
        type=float,
        default=default(Sampling, "presence_penalty"),
        help="OpenAI presence_penalty in [-2, 2]: lowers tokens the answer has used at all "
        "(sent only when not 0)",
    )
    pl_.add_argument("--seed", type=int, default=0, help="prompt order and pilot sample")
    pl_.add_argument(
        "--pilot-per-dataset",
        type=int,
        default=PILOT_PER_DATASET,
        help="pilot prompts per dataset (all of them when a dataset has fewer); a pilot stored "
        "in --run-dir with the same model, sampling and server is reused unless this asks more",
    )
    pl_.add_argument(
        "--new-pilot",
        action="store_true",
        help="run a new pilot even when --run-dir holds one made with the same model, sampling "
        "and server (reused by default: no request sent)",
    )
    pl_.add_argument(
        "--throughput", type=float, help="tokens/s of the real run (default: the pilot's)"
    )
    pl_.add_argument(
        "--sample-cap",
        type=int,
        help="a naive samples-per-dataset cap to compare with (default: none)",
    )
    pl_.add_argument(
        "--servers",
        type=int,
        help="time the run on N endpoints: the pilot's tok/s per endpoint x N (default: as piloted)",
    )
    _server_args(pl_, many=True)
    _run_args(pl_, lambda v: v)
    pl_.set_defaults(fn=cmd_plan)

    g = sub.add_parser(
        "generate", help="run or resume the plan in RUN_DIR (flags given replace the plan's)"
    )
    g.add_argument("--run-dir", required=True, help="the run directory `kit plan` wrote")
    g.add_argument("--budget", nargs="+", help=f"{BUDGET_HELP} (default: the plan's)")
    g.add_argument("--force", action="store_true", help="resume despite a changed fingerprint")
    _server_args(g, many=True)
    _run_args(g, lambda v: None)
    g.set_defaults(fn=cmd_generate)

    w = sub.add_parser(
        "watch", help="follow a run started elsewhere: a progress table on stdout until it ends"
    )
    w.add_argument("run_dir", help="the run directory `kit generate` writes")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    w.add_argument(
        "--stall-timeout",
        type=float,
        default=300.0,
        help="stop watching after this many seconds without progress",
    )
    w.set_defaults(fn=cmd_watch)

    a = sub.add_parser("audit", help="audit a run directory")
    a.add_argument("run_dir", help="the run directory")
    a.add_argument(
        "--tokenizer", help="local tokenizer path to decode token ids with (default: the run's)"
    )
    a.set_defaults(fn=cmd_audit)

    r = sub.add_parser(
        "records", help="print a run's records as JSONL (one Record a line, messages as sent)"
    )
    r.add_argument("run_dir", help="the run directory")
    r.add_argument("--dataset", action="append", help="only this dataset (repeat for several)")
    r.set_defaults(fn=cmd_records)

    e = sub.add_parser("export", help="export a run to trainer formats with a manifest")
    e.add_argument("run_dir", help="the run directory")
    e.add_argument("out_dir", help="the export folder (manifest.json goes in it)")
    e.add_argument(
        "--format",
        nargs="+",
        default=["specforge", "token_ids", "parquet"],
        help="formats to write: specforge, token_ids, parquet, hf",
    )
    e.add_argument(
        "--tokenizer", help="local tokenizer path for re-tokenized rows (default: the run's)"
    )
    for flag, text in (
        ("--drop-truncated", "leave out completions cut at max_tokens"),
        (
            "--keep-truncated-conversations",
            "keep `length` rows in the SpecForge JSONL (left out by default, counted)",
        ),
        ("--drop-duplicates", "leave out duplicate completions"),
        ("--trim-to-budget", "per dataset, keep records up to its budget"),
    ):
        e.add_argument(flag, action="store_true", help=text)
    e.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="share of each dataset's prompts in the validation split",
    )
    e.add_argument("--seed", type=int, default=0, help="the validation split's seed")
    e.add_argument("--overwrite", action="store_true", help="replace an export in OUT_DIR")
    e.add_argument(
        "--draft-vocab",
        type=int,
        nargs="?",
        const=32_000,
        metavar="K",
        help="also write draft_vocab/: token frequencies and d2t/t2d of a K-token draft "
        "vocabulary for SpecForge and speculators (default K 32000, capped at the target's)",
    )
    e.add_argument(
        "--target-config",
        metavar="PATH",
        help="the target's config.json or folder, for its vocab_size (default: the run's tokenizer folder)",
    )
    e.set_defaults(fn=cmd_export)

    v = sub.add_parser("validate", help="check an export against its manifest and format")
    v.add_argument("export_dir", help="the export folder (with manifest.json)")
    v.set_defaults(fn=cmd_validate)
    p.description = (
        "Plan, generate, audit and export drafter training data under per-dataset token "
        f"budgets. Commands: {', '.join(sub.choices)}; `kit COMMAND --help` for each."
    )
    return p


# ------------------------------------------------------------------------------ main


def _interrupt(signum, frame) -> None:
    """SIGTERM or SIGHUP outside a run (a run takes them as a clean stop itself) ->
    KeyboardInterrupt."""
    raise KeyboardInterrupt


ADVICE = {"pass force=True": "pass --force", "pass overwrite=True": "pass --overwrite"}


def error_line(exc: BaseException) -> str:
    """`kit: error: <message>`; a multi-line message (a fingerprint diff) keeps its lines."""
    message = str(exc).strip() or type(exc).__name__
    for keyword, flag in ADVICE.items():  # the library's advice, in flags
        message = message.replace(keyword, flag)
    return f"kit: error: {message}"


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (polars) word an OSError
_ADVICE = {
    errno.ENOSPC: "free some space (or choose another directory), then run it again",
    errno.EDQUOT: "free some space (or choose another directory), then run it again",
    errno.EROFS: "choose a writable directory",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
}


def system_error_line(exc: BaseException) -> str | None:
    """`kit: error: <what the system said> (<file>): <advice>` for an OSError, or an error
    of a library that wraps one (polars: "... (os error 28)"); None for anything else."""
    if isinstance(exc, OSError) and exc.errno is not None:
        code, what = exc.errno, exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
    elif match := _OS_ERROR.search(str(exc)):
        code, where = int(match.group(1)), ""
        what = (
            f"{os.strerror(code)} ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})"
        )
    else:
        return None
    advice = _ADVICE.get(code, "")
    return f"kit: error: {what}{where}" + (f": {advice}" if advice else "")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kit` console script."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops as cleanly as Ctrl-C
    signal.signal(signal.SIGHUP, _interrupt)  # and a closed terminal
    with redacted_output():  # every line kit prints without a secret
        return _run(args)


def _run(args) -> int:
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except KitError as exc:  # a StoreWriteError is an OSError: what the system said, advice
        line = system_error_line(exc) if isinstance(exc, OSError) else None
        print(line or error_line(exc), file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        line = system_error_line(exc)
        if line is None:  # kit's own bug: its traceback, with its text redacted
            exc.args = tuple(redact(a) if isinstance(a, str) else a for a in exc.args)
            raise
        print(line, file=sys.stderr)
        return 1
