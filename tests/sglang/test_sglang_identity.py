"""SGLang's model identity (issue 39 item 2): ``path@revision#digest`` of SGLang's own ``ModelConfig``.

The backend is built as SGLang's scheduler builds it: inside a runtime context made from
SGLang's own ``ServerArgs`` (``sglang.srt.runtime_context.create_context`` / ``use_context``,
the API SGLang uses to run a model's work under its config), so ``KVConnectStorage`` reads the
``ModelConfig`` SGLang builds from the model directory (revision, Hugging Face config, dtype).
Pages go to a disk tier and a fresh backend asks for them: the same revision hits, another
revision at the same path misses, and so does the same path rewritten with a config whose KV
differs. The engine-level check (a real SGLang engine at revision r2 loads nothing of r1's
pages) is ``test_sglang_e2e.py::test_another_revision_at_the_same_path_misses``.
"""

from __future__ import annotations

import json
import shutil

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
pytest.importorskip("transformers")

from sglang.srt.runtime_context import create_context, use_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.utils.hf_transformers.config import get_config  # noqa: E402

from kvconnect.integrations.sglang import KVConnectStorage  # noqa: E402
from host_pools import fill, idx, keys, mha_pool, storage_config  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support import tiny_models

    return tiny_models.make_llama(str(tmp_path_factory.mktemp("identity") / "llama"))


def scheduler_backend(tmp_path, pool, model_path, revision):
    """A backend constructed under SGLang's runtime context of ``model_path`` at ``revision``."""
    args = ServerArgs(model_path=model_path, revision=revision, device="cpu", dtype="float32",
                      skip_tokenizer_init=True, attention_backend="torch_native")
    with use_context(create_context(args, role="scheduler")):
        b = KVConnectStorage(storage_config(tmp_path, model=model_path), {})
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, "kv")
    b.on_host_pools_registered()
    return b


def test_a_revision_change_misses_the_same_revision_hits(tmp_path, model_dir):
    pool = mha_pool("layer_first")
    fill(pool)
    ks = keys(3, "identity")
    writer = scheduler_backend(tmp_path, pool, model_dir, "r1")
    assert writer.model_identity.startswith(f"{model_dir}@r1#"), writer.model_identity
    assert writer.batch_set_v1(ks, idx([0, 1, 2])) == [True] * 3
    assert writer.flush(10)
    writer.close()

    same = scheduler_backend(tmp_path, mha_pool("layer_first"), model_dir, "r1")
    assert same.model_identity == writer.model_identity  # every server of r1 names it alike
    assert same.batch_exists(ks) == 3
    same.close()
    other = scheduler_backend(tmp_path, mha_pool("layer_first"), model_dir, "r2")
    assert other.model_identity.startswith(f"{model_dir}@r2#")
    assert other.batch_exists(ks) == 0
    other.close()


def test_the_same_path_rewritten_with_another_kv_config_misses(tmp_path, model_dir):
    """A directory rewritten in place, no revision at all: the config digest tells the two apart."""
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    pool = mha_pool("layer_first")
    fill(pool)
    ks = keys(2, "rewritten")
    first = scheduler_backend(tmp_path, pool, str(path), None)
    assert first.batch_set_v1(ks, idx([0, 1])) == [True, True]
    assert first.flush(10)
    first.close()
    assert scheduler_backend(tmp_path, mha_pool("layer_first"), str(path), None).batch_exists(ks) == 2
    config = json.loads((path / "config.json").read_text())
    rope = config.get("rope_parameters") or config  # transformers 5 keeps rope_theta in rope_parameters
    rope["rope_theta"] = float(rope.get("rope_theta") or 10000.0) * 2
    (path / "config.json").write_text(json.dumps(config))
    get_config.cache_clear()  # SGLang caches a path's config per process: a restarted server reads it again
    again = scheduler_backend(tmp_path, mha_pool("layer_first"), str(path), None)
    assert again.model_identity.split("#")[0] == first.model_identity.split("#")[0]  # same name@revision
    assert again.model_identity != first.model_identity
    assert again.batch_exists(ks) == 0
    again.close()


def test_outside_a_scheduler_the_storage_configs_model_name_is_the_name(tmp_path):
    b = KVConnectStorage(storage_config(tmp_path, model="tiny"), {})
    assert b.model_identity.startswith("tiny@#")
    named = KVConnectStorage(storage_config(tmp_path, model="tiny", model_name="org/tiny@v3"), {})
    assert named.model_identity == "org/tiny@v3"  # a model_name set wins, as in the vLLM adapter
