"""vLLM-Ascend 0.23.0.post1's cache specs (and its vLLM 0.23's), read from the installed packages.

Every ``KVCacheSpec`` class either package defines is served, refused by name with a reason, or an
abstract base (``specs.known_specs`` for the release), and docs/vllm.md's "Cache specs" table
lists it: a new spec fails here instead of passing silently. And why the DeepSeek V4 C128 window-free
rule stays off on this release: its compressor state is read only inside the AscendC op
``torch.ops._C_ascend.compressor``, whose code is not in the package.
"""

from __future__ import annotations

import re
from pathlib import Path

from support import spec_classes
from kvconnect.integrations.vllm import engine_tables, specs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def test_every_installed_spec_class_has_a_rule_and_a_docs_row():
    found = spec_classes.spec_classes("vllm", "vllm_ascend")
    for name in ("AscendMLAAttentionSpec", "AscendSlidingWindowMLASpec", "TQFullAttentionSpec"):
        assert name in found, name
    unknown = set(found) - specs.known_specs(engine_tables.VLLM_ASCEND_0_23)
    assert not unknown, f"vLLM-Ascend 0.23 spec classes with no kvconnect rule: {sorted(unknown)}"
    text = DOCS.read_text()
    table = text[text.index("## Cache specs"):]
    table = table[:table.find("\n## ", 1)]
    missing = [name for name in found if f"`{name}`" not in table]
    assert not missing, f"docs/vllm.md's Cache specs table lacks {missing}"


def test_c128_state_is_read_only_by_the_ascendc_compressor_so_the_rule_stays_off():
    root = spec_classes.package_dir("vllm_ascend")
    readers = {}
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        for call in re.findall(r"torch\.ops\._C_ascend\.compressor\((.*?)\)\n", text, re.DOTALL):
            readers.setdefault(str(path.relative_to(root)), []).append(re.sub(r"\s+", "", call))
    assert readers, "no AscendC compressor call found"
    for calls in readers.values():
        for call in calls:  # the whole state cache and its block table go in; which rows it reads is inside
            assert "state_cache" in call and "state_block_table=" in call and "cmp_ratio=" in call, call
    # the op's code ships compiled, with no source and no meta function to read its reads from
    assert not [p for p in root.rglob("*") if "compressor" in p.name.lower() and p.suffix in (".cpp", ".h", ".py")]
    assert "compressor" not in (root / "meta_registration.py").read_text()
    assert engine_tables.VLLM_ASCEND_0_23.window_free == () and engine_tables.VLLM_ASCEND_MAIN.window_free == ()
