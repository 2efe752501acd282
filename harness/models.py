"""Tiny randomly initialised transformer models with MiniLM's tokenizer: the real code paths
(tokenizer, torch or ONNX, pooling, batching) in milliseconds, no real weights. Quality claims
never use them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
TINY_EMBEDDER_NAME = "tiny-test-embedder"


def _tokenizer_files(dst: Path) -> None:
    from server.backends.models import packaged_minilm_dir

    src = packaged_minilm_dir()
    for name in TOKENIZER_FILES:
        shutil.copy2(src / name, dst / name)


def tiny_embedder_dir(d: Path) -> Path:
    """A 1-layer, 32-wide BERT sentence embedder in `d`."""
    import torch
    from transformers import BertConfig, BertModel

    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(d)
    _tokenizer_files(d)
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return d


def tiny_reranker_dir(d: Path, layers: int = 1, hidden: int = 32) -> Path:
    """A BERT sequence-classification cross-encoder in `d` (1 label: the relevance logit)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 32), intermediate_size=hidden * 2,
        max_position_embeddings=512 if layers > 1 else 256, num_labels=1)).save_pretrained(d)
    _tokenizer_files(d)
    return d
