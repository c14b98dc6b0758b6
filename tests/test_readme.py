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
