"""Data for tests, benchmarks and load tests: the development datasets next to this repository,
query files, and synthetic clustered vectors."""
from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATASETS = REPO.parent / "shared" / "datasets"   # ../shared/datasets, beside the checkout
CRANFIELD = DATASETS / "cranfield"
CACM = DATASETS / "cacm"


def read_queries(path: Path) -> list[str]:
    """Query texts from a BEIR queries.jsonl ({_id, text}), a directory holding one, or a plain
    text file (one per line): the product's reader (`search-client --queries`), texts only."""
    from server.client import read_queries as read

    path = Path(path)
    if path.is_dir():
        path = path / "queries.jsonl"
    return [text for _, text in read(path) if text.strip()]


def clustered(n: int, dim: int, seed: int = 0, clusters: int = 200, latent: int = 24,
              spread: float = 1.0, noise: float = 0.3, n_queries: int = 0):
    """Clustered, low-intrinsic-dimension unit vectors (isotropic Gaussian data makes every ANN
    index look perfect). Returns the base vectors, or (base, queries) when n_queries > 0."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, latent)).astype(np.float32)
    proj = (rng.standard_normal((latent, dim)) / np.sqrt(latent)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        out = np.empty((m, dim), np.float32)
        for s in range(0, m, 50_000):
            e = min(m, s + 50_000)
            z = centres[rng.integers(0, clusters, e - s)] + spread * rng.standard_normal(
                (e - s, latent)).astype(np.float32)
            x = z @ proj + noise * rng.standard_normal((e - s, dim)).astype(np.float32)
            out[s:e] = x / np.linalg.norm(x, axis=1, keepdims=True)
        return out

    base = draw(n)
    return (base, draw(n_queries)) if n_queries else base


def synthetic(n: int, n_queries: int, dim: int, clusters: int, latent: int, spread: float,
              noise: float, seed: int):
    """(base, queries) from `clustered`, the benchmarks' historical signature."""
    return clustered(n, dim, seed, clusters, latent, spread, noise, n_queries)
