"""The thinking variant of the embedded model: a reasoning-target stand-in for the tests.

Same weights as kit's embedded model (a symlink), <think>/</think> in the vocabulary, a chat
template that opens the think block; served by vLLM with `--reasoning-parser deepseek_r1`
(tests/conftest.py's vllm_thinking fixture).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kit.serve.prepare import MARKER, MODEL_NAME, is_prepared, prepare_model

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
