"""TEST HARNESS: a process that imports an engine once and forks one child per engine run.

    python tests/support/zygote.py MODULE [MODULE ...]

Importing vLLM and torch takes ~12 s of a ~17 s tiny-model run on this project's 2-core CI
machine, and the vLLM stage makes dozens of runs. This process imports the named modules once,
with the environment the runs will have (the caller starts one zygote per interpreter and
``PYTHONPATH``), then serves requests read from stdin, one JSON object a line::

    {"argv": [script, arg, ...], "env": {...}, "cwd": DIR, "log": FILE}
    {"module": NAME, "argv": [arg, ...], "env": {...}, "cwd": DIR, "log": FILE}

For each it forks a child that is what ``python script arg ...`` (or ``python -m NAME arg ...``)
would be after those imports: a session of its own, stdin from /dev/null, stdout and stderr to
``log``, the request's environment (plus the variables the imports themselves set, as a fresh
interpreter would have them), ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them for a
script (a module: the module's file, the working directory), the script or module run as
``__main__``, then Python's own shutdown order (non-daemon threads joined, ``atexit`` handlers
run, streams flushed). It answers ``{"pid": N}`` when the child starts (in the order of the
requests) and ``{"exit": N, "rc": RC}`` when child N ends (a signal ``-S``, as ``subprocess``
reports it). Children may run at the same time (the ``vllm serve`` of a P/D cluster); the zygote
reaps each one as it ends, so their exit codes reach the caller only through these answers.
At the end of stdin the zygote kills the session of every child still running, then exits.

Nothing here changes the engine: the child runs the engine's unmodified code; only the import
is shared. The zygote itself starts no thread and runs no torch op before it forks (an OpenMP
pool made before ``fork`` would not survive in the child).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys


def _child(request: dict, base_env: dict) -> None:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    set_by_imports = {k: v for k, v in os.environ.items() if k not in base_env}
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in set_by_imports.items():
        os.environ.setdefault(key, value)
    os.chdir(request["cwd"])
    module = request.get("module")
    if module is None:
        script = os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][1:]]
        sys.path[0] = os.path.dirname(script)
    else:  # as ``python -m``: argv[0] becomes the module's file (runpy sets it), the working directory first on the path
        sys.argv = ["-m", *request["argv"]]
        sys.path[0] = os.getcwd()
    code = 0
    try:
        import runpy

        if module is None:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:  # the interpreter's own shutdown order: threads, then atexit, then the streams
        import atexit
        import threading

        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _reply(reply, **fields) -> None:
    reply.write(json.dumps(fields) + "\n")


def main() -> None:
    base_env = dict(os.environ)
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel
    os.dup2(2, 1)  # whatever the imports print goes to stderr, never into the protocol
    for name in sys.argv[1:]:
        importlib.import_module(name)
    _reply(reply, ready=True)
    children: dict[int, int] = {}  # a pidfd (readable once the child ended) -> the child's pid
    pending = b""
    while True:
        ready, _, _ = select.select([0, *children], [], [])
        for fd in ready:
            if fd != 0:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _reply(reply, exit=pid, rc=os.waitstatus_to_exitcode(status))
                continue
            data = os.read(0, 65536)
            if not data:  # the caller is gone: no child outlives the zygote unwatched
                for pidfd, pid in children.items():
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.waitpid(pid, 0)
                    os.close(pidfd)
                return
            pending += data
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                if not line.strip():
                    continue
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    reply.close()
                    for pidfd in children:
                        os.close(pidfd)
                    _child(request, base_env)
                children[os.pidfd_open(pid)] = pid
                _reply(reply, pid=pid)


if __name__ == "__main__":
    main()
