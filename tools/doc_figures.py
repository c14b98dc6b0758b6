"""The figures the docs quote, made by the commands that produce them (issue 41 item 3).

    python tools/doc_figures.py           # check: exit 1 naming every figure that differs
    python tools/doc_figures.py --write   # regenerate them in place

Three kinds of marked places in README.md and docs/*.md (HTML comments: invisible on GitHub):

- ``<!-- output: kvconnect inspect ... -->`` before a fenced block: the block is ``$ COMMAND``
  and the command's output, run in this process with no KVCONNECT_* / LMCACHE_* variable set
  (the defaults a reader gets). One elision: a layout fingerprint prints as ``fingerprint ...``
  (an identity hash, not a figure to size with; it changes with the identity's format).
- ``<!-- value: kvconnect inspect ...: FIELD -->TEXT<!-- /value -->`` inline: TEXT is FIELD of
  the command's ``--json`` output (a dotted path), bytes (a field naming bytes) as the CLI
  prints them (``4.78 MiB``), counts with thousands separators.
- ``<!-- measured: COMMAND; machine: ...; date: YYYY-MM-DD -->`` before a table of
  measurements: timings cannot be compared to the byte, so the check is that the marker names
  the command that measured them (a ``kvconnect`` command that parses, or a
  ``python benchmarks/NAME.py`` that exists) and the run (machine, date), and, where the command
  prints a table row for the docs (``kvconnect bench --markdown``), that the table has its
  columns. ``--write`` leaves measurements alone: re-measure with the command and paste.

Every ``kvconnect ...`` command line in a fenced block of these files must also parse with the
real command-line parser (an option renamed in the CLI breaks the check, not a user's copy),
and every file path the docs quote in backticks (``kvconnect/...``, ``benchmarks/...``,
``tests/...``) must exist.
tests/test_doc_figures.py runs the check in the core suite (a few seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")

OUTPUT = re.compile(r"<!-- output: (?P<cmd>[^>]*?) -->\n```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
VALUE = re.compile(r"<!-- value: (?P<cmd>[^>]*?): (?P<field>[\w.]+) -->(?P<text>.*?)<!-- /value -->", re.S)
MEASURED = re.compile(r"<!-- measured: (?P<cmd>[^;>]*?); machine: (?P<machine>[^;>]*?); date: (?P<date>[^;>]*?) -->"
                      r"(?=(?P<after>(?:\n[^\n]*){0,3}))")
FENCE = re.compile(r"```[\w-]*\n(.*?)```", re.S)
REPO_PATH = re.compile(r"`((?:kvconnect|benchmarks|tests|tools|examples|csrc|docs)/[\w./-]*\w)`")
FINGERPRINT = re.compile(r"fingerprint [0-9a-f]{12}")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def doc_files(root: Path = ROOT) -> list[Path]:
    out: list[Path] = []
    for pattern in DOCS:
        out += sorted(root.glob(pattern))
    return out


def _kvconnect_argv(command: str) -> list[str]:
    words = shlex.split(command)
    if not words or words[0] != "kvconnect":
        raise ValueError(f"not a kvconnect command: {command!r}")
    return words[1:]


@contextlib.contextmanager
def _reader_env():
    """The environment a reader who set nothing has: no KVCONNECT_* / LMCACHE_* variable."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVCONNECT_", "LMCACHE_"))}
    with mock.patch.dict(os.environ, clean, clear=True):
        yield


_runs: dict[str, str] = {}


def run_kvconnect(command: str) -> str:
    """stdout of ``command`` (``kvconnect ...``) run in this process; ValueError when it fails."""
    if command not in _runs:
        from kvconnect.cli import main

        out, err = io.StringIO(), io.StringIO()
        with _reader_env(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(_kvconnect_argv(command))
            except SystemExit as exc:  # argparse: a usage error
                rc = exc.code
        if rc != 0:
            raise ValueError(f"`{command}` exited {rc}: {err.getvalue().strip()}")
        _runs[command] = out.getvalue()
    return _runs[command]


def parses(command: str) -> Optional[str]:
    """None when ``command`` parses with kvconnect's own parser, else why not."""
    from kvconnect.cli import main

    err = io.StringIO()
    calls = []
    with _reader_env(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        # parse only: every command's run stops before it does anything
        from kvconnect.cli import bench, inspect, serve

        fake = lambda args, config: calls.append(args) or 0  # noqa: E731
        with mock.patch.object(serve, "run", fake), mock.patch.object(inspect, "run", fake), \
                mock.patch.object(bench, "run", fake):
            try:
                rc = main(_kvconnect_argv(command))
            except SystemExit as exc:
                rc = exc.code
    return None if rc == 0 and calls else (err.getvalue().strip().splitlines() or [f"exit {rc}"])[-1]


def expected_output(command: str) -> str:
    return FINGERPRINT.sub("fingerprint ...", f"$ {command}\n{run_kvconnect(command)}")


def field_text(command: str, field: str) -> str:
    from kvconnect.cli.model_args import human_bytes

    value = json.loads(run_kvconnect(command + " --json"))
    for part in field.split("."):
        value = value[part]
    if "bytes" in field.rsplit(".", 1)[-1]:
        return human_bytes(value)
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}" if isinstance(value, (int, float)) else str(value)


@dataclass
class Problem:
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}: {self.what}"


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _table_columns(after: str) -> Optional[list[str]]:
    for line in after.splitlines():
        if line.startswith("|"):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    return None


def _measured_shape(command: str) -> Optional[list[str]]:
    """The columns the measuring command prints for the docs (None: it prints no docs row)."""
    if command.startswith("kvconnect bench") and "--markdown" in shlex.split(command):
        from kvconnect.cli.bench import MARKDOWN_COLUMNS

        return list(MARKDOWN_COLUMNS)
    return None


def process(path: Path, *, write: bool, root: Path = ROOT) -> tuple[str, list[Problem]]:
    """(the file's text with every generated figure as its command makes it, the problems found)."""
    text = path.read_text()
    problems: list[Problem] = []

    def fail(pos: int, what: str) -> None:
        problems.append(Problem(path, _line(text, pos), what))

    def output(m: re.Match) -> str:
        try:
            want = expected_output(m["cmd"])
        except ValueError as exc:
            fail(m.start(), str(exc))
            return m.group(0)
        if m["body"] != want:
            fail(m.start(), f"the output of `{m['cmd']}` differs from what it prints now (python tools/doc_figures.py --write)")
        return f"<!-- output: {m['cmd']} -->\n```{m['lang']}\n{want}```" if write else m.group(0)

    def value(m: re.Match) -> str:
        try:
            want = field_text(m["cmd"], m["field"])
        except (ValueError, KeyError, TypeError) as exc:
            fail(m.start(), f"{m['field']} of `{m['cmd']}`: {exc!r}")
            return m.group(0)
        if m["text"] != want:
            fail(m.start(), f"{m['field']} of `{m['cmd']}` is {want}, the doc says {m['text']}")
        return m.group(0).replace(f"-->{m['text']}<!--", f"-->{want}<!--", 1) if write else m.group(0)

    new = OUTPUT.sub(output, text)
    new = VALUE.sub(value, new)
    for m in MEASURED.finditer(text):
        cmd = m["cmd"].strip()
        if cmd.startswith("kvconnect "):
            why = parses(cmd)
            if why:
                fail(m.start(), f"the measuring command `{cmd}` does not parse: {why}")
        elif not (cmd.startswith("python ") and len(cmd.split()) > 1 and (root / cmd.split()[1]).is_file()):
            fail(m.start(), f"a measurement must name its command (kvconnect ... or python benchmarks/NAME.py), got `{cmd}`")
        if not m["machine"].strip():
            fail(m.start(), "a measurement must name the machine it ran on")
        if not DATE.fullmatch(m["date"].strip()):
            fail(m.start(), f"a measurement's date is YYYY-MM-DD, got {m['date']!r}")
        shape = _measured_shape(cmd)
        if shape is not None:
            columns = _table_columns(m["after"])
            if columns != shape:
                fail(m.start(), f"the table under `{cmd}` has columns {columns}, the command prints {shape}")
    for m in REPO_PATH.finditer(text):
        if not (root / m.group(1)).exists():
            fail(m.start(), f"`{m.group(1)}` is not in the repository")
    for m in FENCE.finditer(text):
        for n, line in enumerate(m.group(1).splitlines()):
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            line = re.sub(r"^(?:\w+=\S+\s+)+", "", line)  # VAR=value prefixes
            if not line.startswith("kvconnect "):
                continue
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            why = parses(command)
            if why:
                problems.append(Problem(path, _line(text, m.start()) + 1 + n, f"`{command}` does not parse: {why}"))
    return new, problems


def check(root: Path = ROOT, *, write: bool = False, files: Optional[list[Path]] = None) -> list[Problem]:
    problems: list[Problem] = []
    for path in files or doc_files(root):
        new, found = process(path, write=write, root=root)
        if write and new != path.read_text():
            path.write_text(new)
        problems += found
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate the figures in place")
    args = parser.parse_args(argv)
    problems = check(write=args.write)
    if args.write:
        problems = check()  # what is left after writing: measurements and commands that fail
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
