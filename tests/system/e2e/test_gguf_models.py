"""The GGUF model helper (tests/support/gguf_models.py): a seed decides every byte, so a signed manifest can pin
the sha256 before the file is written anywhere else; what it writes is the llama model it claims to be; and the
ArtifactRef it makes verifies under a policy that trusts the signing key.

No engine here: tests/system/e2e/test_real_engine.py is where llama-server loads these files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import verify_artifact_manifest
from ansible_collections.meridian.node.tests.support.gguf_models import (
    TINY,
    artifact_ref,
    write_model,
    write_not_a_model,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

gguf = pytest.importorskip("gguf")

_WRITE_IN_A_FRESH_PROCESS = """
import sys
from pathlib import Path
from ansible_collections.meridian.node.tests.support.gguf_models import TINY, write_model
print(write_model(Path(sys.argv[1]), TINY, seed=int(sys.argv[2])).sha256)
"""


def test_the_same_seed_writes_the_same_bytes_even_in_another_process_with_another_hash_seed(tmp_path: Path) -> None:
    first = write_model(tmp_path / "a", TINY, seed=7)
    again = write_model(tmp_path / "b", TINY, seed=7)
    # A dict or set ordered by string hashing would differ under another PYTHONHASHSEED.
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_IN_A_FRESH_PROCESS, str(tmp_path / "c"), "7"],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )

    assert first.path.read_bytes() == again.path.read_bytes()
    assert (first.sha256, first.size) == (again.sha256, again.size)
    assert done.stdout.strip() == first.sha256
    assert (tmp_path / "c" / first.path.name).read_bytes() == first.path.read_bytes()


def test_another_seed_writes_other_weights_of_the_same_size(tmp_path: Path) -> None:
    one = write_model(tmp_path / "a", TINY, seed=1)
    two = write_model(tmp_path / "b", TINY, seed=2)

    assert one.sha256 != two.sha256
    assert one.size == two.size


def test_the_file_is_the_llama_model_its_shape_says(tmp_path: Path) -> None:
    model = write_model(tmp_path, TINY, seed=0)
    reader = gguf.GGUFReader(model.path)

    def field(name: str) -> object:
        part = reader.fields[name]
        value = part.parts[part.data[0]]
        return bytes(value).decode() if part.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]

    assert field("general.architecture") == "llama"
    assert field("tokenizer.ggml.model") == "llama"
    assert (field("llama.block_count"), field("llama.embedding_length")) == (TINY.layers, TINY.embedding)
    assert field("llama.context_length") == TINY.context
    names = [tensor.name for tensor in reader.tensors]
    assert names[0] == "token_embd.weight" and names[-1] == "output.weight"
    assert len(names) == 3 + 9 * TINY.layers
    assert 0.2e6 < model.size < 1e6, "tiny stays under a megabyte"
    assert not list(tmp_path.glob(".*")), "no temporary file is left beside the model"


def test_not_a_model_starts_like_a_gguf_and_is_garbage_after_the_version(tmp_path: Path) -> None:
    bad = write_not_a_model(tmp_path, seed=3, size=4096)

    data = bad.path.read_bytes()
    assert data[:8] == b"GGUF" + (3).to_bytes(4, "little")
    assert len(data) == bad.size == 4096
    assert bad.shape is None
    assert write_not_a_model(tmp_path / "again", seed=3, size=4096).sha256 == bad.sha256


def test_the_artifact_ref_verifies_under_the_policy_that_trusts_its_key_and_lists_the_file(tmp_path: Path) -> None:
    model = write_model(tmp_path / "models" / "tiny", TINY, seed=0)
    key = make_key()
    policy = load_policy(write_policy(tmp_path / "etc", control=[make_key()], artifact=[key]))

    ref = artifact_ref(model, key, name="tiny-llama", version="2.0.0")
    verified = verify_artifact_manifest(json.dumps(ref["manifest"]).encode(), policy)

    assert (ref["name"], ref["version"], ref["source"]) == ("tiny-llama", "2.0.0", str(model.path.parent))
    assert (verified.manifest.name, verified.manifest.version) == ("tiny-llama", "2.0.0")
    [entry] = verified.manifest.files
    assert (entry.path, entry.size, entry.sha256) == (model.path.name, model.size, model.sha256)
