"""Models for the real llama.cpp engine without a model hub: llama-architecture GGUF files with random weights,
written here by the ``gguf`` package (pure Python and numpy), plus the signed artifact manifest that lets the
agent take them through ``verified_artifact`` like any model.

Two shapes:

* ``TINY``: 2 layers, n_embd 64, F32, about 0.5 MB, written in about 10 ms. llama-server loads it in
  milliseconds (ready about 0.4 s after its container starts) and answers at once: for every test that only
  needs a real engine.
* ``SLOW``: 4 layers, n_embd 1024, F16, context 8192, about 100 MB, written in about a second. On two CPU
  cores four parallel requests make 110-190 tokens a second together, so a few hundred tokens each stay in
  flight for seconds: for drain and stop tests.

The output is a function of the shape and the seed only (seeded numpy, no time, no paths, no dict or set
order that ``PYTHONHASHSEED`` decides), so the bytes and therefore the sha256 a manifest pins are the same
on every machine with the same ``gguf`` and numpy. The vocabulary is a byte-fallback SentencePiece one (the
``llama`` tokenizer): three control tokens, the 256 byte tokens and printable ASCII pieces, so any prompt
tokenizes. Random weights produce gibberish: that is the point of a model that exists only to be served.

Typical use (the fixtures below do the writing once per session)::

    key = make_key()
    ref = artifact_ref(tiny_gguf, key, name="tiny-llama")   # an ArtifactRef for a desired state
    # the policy trusts key as an artifact key and lists tiny_gguf.path.parent in store.local_sources
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ansible_collections.meridian.node.tests.support.llamacpp_image import report
from ansible_collections.meridian.node.tests.support.trust_fixtures import SigningKey, artifact_manifest, envelope

if TYPE_CHECKING:  # numpy comes with gguf (the dev extra): imported where a model is written, not on import
    import numpy as np

__all__ = [
    "MODEL_FILE",
    "SLOW",
    "TINY",
    "GgufModel",
    "ModelShape",
    "artifact_ref",
    "slow_gguf",
    "tiny_gguf",
    "write_model",
    "write_not_a_model",
]

MODEL_FILE = "model.gguf"
# A chat template of our own (ChatML), so that /v1/chat/completions does not depend on llama-server's default.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WEIGHT_STD = 0.02
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters of a llama-architecture model; every weight is drawn from the seed."""

    name: str
    layers: int
    embedding: int
    heads: int
    feed_forward: int
    context: int
    f16: bool

    @property
    def head_dim(self) -> int:
        return self.embedding // self.heads


TINY = ModelShape("tiny", layers=2, embedding=64, heads=4, feed_forward=128, context=512, f16=False)
SLOW = ModelShape("slow", layers=4, embedding=1024, heads=16, feed_forward=2816, context=8192, f16=True)


@dataclass(frozen=True)
class GgufModel:
    """One written model file: where, what, its size and sha256, and how long writing it took."""

    path: Path
    shape: ModelShape | None  # None: not a model at all (``write_not_a_model``)
    seed: int
    size: int
    sha256: str
    seconds: float

    def describe(self) -> str:
        what = self.shape.name if self.shape is not None else "not-a-model"
        return (
            f"GGUF {what} (seed {self.seed}): {self.size / 1e6:.2f} MB, sha256 {self.sha256[:16]}..., "
            f"written in {self.seconds:.2f} s"
        )


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of a byte-fallback SentencePiece vocabulary (no file needed)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    # SentencePiece writes a space as U+2581; the other printable ASCII characters stand for themselves.
    pieces = ["\u2581", *(chr(code) for code in range(0x21, 0x7F))]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def _tensors(shape: ModelShape, vocabulary: int, seed: int) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """Every tensor in a fixed order. numpy shapes are (rows, columns), the reverse of ggml's ``ne``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = np.float16 if shape.f16 else np.float32

    def matrix(rows: int, columns: int) -> np.ndarray[Any, Any]:
        values = rng.standard_normal((rows, columns), dtype=np.float32) * np.float32(_WEIGHT_STD)
        return values.astype(dtype)

    def norm() -> np.ndarray[Any, Any]:
        return np.ones(shape.embedding, dtype=np.float32)  # norms stay F32: llama.cpp reads them as such

    width, ff = shape.embedding, shape.feed_forward
    yield "token_embd.weight", matrix(vocabulary, width)
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        yield f"{block}.attn_norm.weight", norm()
        yield f"{block}.attn_q.weight", matrix(width, width)
        yield f"{block}.attn_k.weight", matrix(width, width)
        yield f"{block}.attn_v.weight", matrix(width, width)
        yield f"{block}.attn_output.weight", matrix(width, width)
        yield f"{block}.ffn_norm.weight", norm()
        yield f"{block}.ffn_gate.weight", matrix(ff, width)
        yield f"{block}.ffn_up.weight", matrix(ff, width)
        yield f"{block}.ffn_down.weight", matrix(width, ff)
    yield "output_norm.weight", norm()
    yield "output.weight", matrix(vocabulary, width)


def _written(target: Path, shape: ModelShape | None, seed: int, started: float) -> GgufModel:
    """The GgufModel of ``target``, just written from ``shape`` and ``seed``: its size and sha256 read back, the
    time since ``started`` (a ``time.monotonic()`` reading) taken as its writing time."""
    digest = hashlib.sha256()
    with target.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return GgufModel(
        path=target,
        shape=shape,
        seed=seed,
        size=target.stat().st_size,
        sha256=digest.hexdigest(),
        seconds=time.monotonic() - started,
    )


def write_model(directory: Path, shape: ModelShape = TINY, seed: int = 0, filename: str = MODEL_FILE) -> GgufModel:
    """Write ``directory/filename``, a llama GGUF of ``shape`` with weights drawn from ``seed`` (atomically:
    a reader never sees half a file, and a model that is there is whole)."""
    import gguf

    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = _vocabulary()
    handle, temporary = tempfile.mkstemp(prefix=f".{filename}-", dir=directory)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(temporary, arch="llama")
        writer.add_name(f"meridian-node random {shape.name} seed {seed}")
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.embedding)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.feed_forward)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.heads)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if shape.f16 else gguf.LlamaFileType.ALL_F32)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_chat_template(_CHAT_TEMPLATE)
        for name, tensor in _tensors(shape, len(tokens), seed):
            writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        target = directory / filename
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return _written(target, shape, seed, started)


def write_not_a_model(directory: Path, seed: int = 0, size: int = 64 * 1024, filename: str = MODEL_FILE) -> GgufModel:
    """A file that starts like a GGUF (magic, version 3) and continues with random bytes: it can be signed
    and verified like any artifact, and llama-server must refuse to load it."""
    import numpy as np

    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    garbage = np.random.default_rng(seed).integers(0, 256, size=size - 8, dtype=np.uint8).tobytes()
    target = directory / filename
    target.write_bytes(_GGUF_MAGIC + (3).to_bytes(4, "little") + garbage)
    return _written(target, None, seed, started)


def artifact_ref(
    model: GgufModel, key: SigningKey, *, name: str, version: str = "1.0.0", source: Path | None = None
) -> dict[str, Any]:
    """A desired state's ArtifactRef for ``model``: its file listed (path, size, sha256) in an ArtifactManifest
    signed by ``key``, fetched from ``source`` (default the model's directory; the policy's
    ``store.local_sources`` must list it)."""
    manifest = artifact_manifest(
        name=name,
        version=version,
        files=[{"path": model.path.name, "size": model.size, "sha256": model.sha256}],
    )
    return {
        "name": name,
        "version": version,
        "manifest": envelope("artifact-manifest", manifest, [key]),
        "source": str(source if source is not None else model.path.parent),
    }


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> GgufModel:
    """The tiny model (seed 0), written once per session into a directory of its own."""
    model = write_model(tmp_path_factory.mktemp("gguf-tiny"), TINY, seed=0)
    report(request, model.describe())
    return model


@pytest.fixture(scope="session")
def slow_gguf(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> GgufModel:
    """The slow model (seed 0), written once per session into a directory of its own."""
    model = write_model(tmp_path_factory.mktemp("gguf-slow"), SLOW, seed=0)
    report(request, model.describe())
    return model
