"""The figures the docs quote are what the commands print today (issue 41 item 3).

tools/doc_figures.py finds the marked places in README.md and docs/*.md: command outputs and
inline values (re-run and compared), measurements (named command, machine and date; a table
with the columns its command prints), plus every ``kvconnect`` command line in a code block
(parsed by the real CLI) and every quoted repository path (exists).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest

from kvconnect.cli import main
from kvconnect.cli.bench import MARKDOWN_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "tools" / "doc_figures.py")
doc_figures = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("doc_figures", doc_figures)  # its dataclasses look their module up
_spec.loader.exec_module(doc_figures)


def test_every_marked_figure_is_what_its_command_prints_now():
    problems = doc_figures.check()
    assert not problems, "stale docs (regenerate: python tools/doc_figures.py --write):\n" + "\n".join(map(str, problems))


def test_the_docs_hold_generated_figures():
    # the check is not vacuous: the sizing example and the figures quoted in prose are marked
    texts = {p.name: p.read_text() for p in doc_figures.doc_files()}
    assert "<!-- output: kvconnect inspect --preset deepseek-v4-flash" in texts["operations.md"]
    assert texts["operations.md"].count("<!-- value: ") >= 4
    assert "<!-- measured: kvconnect bench" in texts["performance.md"]


def _doc(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "doc.md"
    path.write_text(body)
    return path


V4 = "kvconnect inspect --preset deepseek-v4-flash"


def test_a_stale_output_block_is_found_and_rewritten(tmp_path):
    path = _doc(tmp_path, f"<!-- output: {V4} -->\n```text\n$ {V4}\n... 168 planes ...\n```\n")
    _, problems = doc_figures.process(path, write=False, root=ROOT)
    assert len(problems) == 1 and "differs from what it prints now" in problems[0].what
    new, _ = doc_figures.process(path, write=True, root=ROOT)
    path.write_text(new)
    assert "274 planes in 7 groups  fingerprint ..." in new
    assert doc_figures.process(path, write=False, root=ROOT)[1] == []


def test_a_stale_inline_value_is_found_and_rewritten(tmp_path):
    path = _doc(tmp_path, f"a pool of <!-- value: {V4} --tokens 1M: pool_bytes -->59.95 GiB<!-- /value --> and "
                          f"<!-- value: {V4}: num_planes -->168<!-- /value --> planes\n")
    _, problems = doc_figures.process(path, write=False, root=ROOT)
    assert sorted(p.what.split(" is ")[1] for p in problems) == ["274, the doc says 168", "4.93 GiB, the doc says 59.95 GiB"]
    new, _ = doc_figures.process(path, write=True, root=ROOT)
    assert "-->4.93 GiB<!--" in new and "-->274<!--" in new


def test_measurements_name_their_command_and_run_and_keep_its_columns(tmp_path):
    header = "| " + " | ".join(MARKDOWN_COLUMNS) + " |"
    good = f"<!-- measured: kvconnect bench --preset llama-3.1-8b --markdown; machine: a VM; date: 2026-12-02 -->\n{header}\n"
    assert doc_figures.process(_doc(tmp_path, good), write=False, root=ROOT)[1] == []
    bad = ("<!-- measured: kvconnect bench --preset llama-3.1-8b --markdown; machine: ; date: yesterday -->\n| a | b |\n\n"
           "<!-- measured: kvconnect bench --presets x; machine: m; date: 2026-12-02 -->\n\n"
           "<!-- measured: python benchmarks/no_such.py; machine: m; date: 2026-12-02 -->\n")
    whats = [p.what for p in doc_figures.process(_doc(tmp_path, bad), write=False, root=ROOT)[1]]
    assert any("name the machine" in w for w in whats)
    assert any("date is YYYY-MM-DD" in w for w in whats)
    assert any("has columns ['a', 'b']" in w for w in whats)
    assert any("does not parse" in w for w in whats)
    assert any("must name its command" in w for w in whats)


def test_commands_in_code_blocks_parse_and_quoted_paths_exist(tmp_path):
    body = ("```bash\nkvconnect server --url ipc:///tmp/x.sock --size-gb 1   # fine\n"
            "MC_TCP_BIND_ADDRESS=10.0.0.1 kvconnect server --no-such-option 3\n```\n"
            "see `kvconnect/cli.py` and `kvconnect/cli/bench.py`\n")
    whats = [p.what for p in doc_figures.process(_doc(tmp_path, body), write=False, root=ROOT)[1]]
    assert len(whats) == 2, whats
    assert "`kvconnect/cli.py` is not in the repository" in whats[0]
    assert whats[1].startswith("`kvconnect server --no-such-option 3` does not parse")


def test_bench_prints_the_docs_row_in_the_documented_columns():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "--preset", "llama-3.1-8b", "--layers", "1", "--tokens", "256", "--repeats", "1",
                   "--device", "cpu", "--threads", "1", "--markdown"])
    assert rc == 0
    header, rule, row = out.getvalue().strip().splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == list(MARKDOWN_COLUMNS)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(MARKDOWN_COLUMNS)
    assert cells[0] == "llama-3.1-8b (1, 256)" and cells[2].endswith(("KiB", "MiB"))
    for gbps in (cells[3], cells[5], cells[6]):
        assert float(gbps) > 0


@pytest.mark.parametrize("field", ["pool_bytes", "restore_points.window_part_bytes", "num_planes"])
def test_values_are_formatted_as_the_cli_prints_them(field):
    text = doc_figures.field_text(V4 + " --tokens 1M", field)
    human = doc_figures.run_kvconnect(V4 + " --tokens 1M")
    assert text in human


def test_a_marked_command_that_fails_is_reported_not_fatal(tmp_path):
    path = _doc(tmp_path, "<!-- value: kvconnect inspect --no-such-option: pool_bytes -->1 GiB<!-- /value -->\n"
                          "<!-- output: kvconnect inspect --preset no-such-model -->\n```text\n```\n")
    whats = [p.what for p in doc_figures.process(path, write=False, root=ROOT)[1]]
    assert len(whats) == 2, whats
    assert "exited 2" in whats[0] and "no-such-model" in whats[0]
    assert "pool_bytes of `kvconnect inspect --no-such-option`" in whats[1]
