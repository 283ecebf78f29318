"""Run in .venv-trainers by tests/test_draftvocab.py: load kit's draft_vocab/ files with
SpecForge's and speculators' own code and print what each trainer ends up with, as JSON.

    .venv-trainers/bin/python tests/trainers_vocab.py EXPORT/draft_vocab K V
"""

from __future__ import annotations


def ids(d2t, t2d) -> dict:
    return {
        "d2t": d2t.tolist(),
        "t2d": t2d.nonzero().flatten().tolist(),
        "t2d_len": len(t2d),
        "d2t_dtype": str(d2t.dtype),
        "t2d_dtype": str(t2d.dtype),
    }


def specforge(folder, k: int, v: int) -> dict:
    """The draft model's buffers after SpecForge's load_vocab_mapping(vocab_mapping.pt), its
    own consistency check, and its mapping rebuilt from kit's counts in id order."""
    from collections import Counter

    import torch
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=v,
        num_hidden_layers=1,
    )
    cfg.draft_vocab_size = k
    model = LlamaForCausalLMEagle3(cfg)
    model.load_vocab_mapping(f"{folder}/vocab_mapping.pt")
    validate_vocab_mapping_consistency(model.t2d, model.d2t)
    freq = torch.load(f"{folder}/token_freq.pt", weights_only=True)
    d2t, t2d = process_token_dict_to_mappings(Counter(dict(sorted(freq.items()))), k, v)
    return {"loaded": ids(model.d2t, model.t2d), "from_counts": ids(d2t, t2d)}


def speculators(folder, k: int, v: int) -> dict:
    """speculators' trainer: its .npy loader into a draft model's buffers (its own shape
    checks), and the mapping it builds from token_freq.pt when given no .npy."""
    import types

    import numpy as np
    import torch
    from speculators.model import DraftVocabMixin
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import LlamaConfig

    class Draft(DraftVocabMixin):
        def __init__(self, config):
            super().__init__()
            self._init_vocab(config)

    # speculators/train/cli.py _load_mappings, verbatim (importing that module needs
    # pydantic_settings, which .venv-trainers does not hold): np.load, torch.from_numpy
    d2t = torch.from_numpy(np.load(f"{folder}/d2t-{k}.npy"))
    t2d = torch.from_numpy(np.load(f"{folder}/t2d-{k}.npy"))
    size = d2t.shape[0]
    layer = LlamaConfig(hidden_size=32, vocab_size=v)
    model = Draft(types.SimpleNamespace(transformer_layer_config=layer, draft_vocab_size=size))
    model.load_vocab_mappings(t2d, d2t)
    freq = torch.load(f"{folder}/token_freq.pt", weights_only=True)
    b_d2t, b_t2d = build_vocab_mappings_from_distribution(freq, k, v)
    return {
        "loaded": ids(model.d2t, model.t2d),
        "from_freq": ids(b_d2t, b_t2d),
        "token_freq": {str(t): c for t, c in freq.items()},
    }


if __name__ == "__main__":
    import json
    import sys

    folder, k, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(
        json.dumps({"specforge": specforge(folder, k, v), "speculators": speculators(folder, k, v)})
    )
