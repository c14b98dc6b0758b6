"""Choosing a model's KV layout on the command line (shared by ``inspect`` and ``bench``)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Optional

from ..integrations import presets
from ..config import Config
from ..errors import ConfigError
from ..layout.chunk_size import choose_chunk_size, layout_rules
from ..layout.spec import DCPSpec


def add_model_args(p: argparse.ArgumentParser, config: Config) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"a named model: {', '.join(presets.PRESETS)}")
    src.add_argument("--config", help="a Hugging Face config.json (or its directory)")
    p.add_argument("--engine", default="vllm", choices=presets.ENGINES, help="whose cache layout (default vllm)")
    p.add_argument("--block-size", type=int, default=None, help="engine block size in tokens (default: the engine's for the model)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (KV heads are split across ranks)")
    p.add_argument("--dcp", type=int, default=1, help="decode context parallel size (MLA tokens are split across ranks)")
    p.add_argument("--dcp-interleave", type=int, default=1, help="tokens per DCP run (vLLM's dcp_kv_cache_interleave_size)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype for --config (default: the model's torch_dtype)")
    p.add_argument("--chunk-size", type=int, default=config.chunk_size, help="tokens per chunk (default LMCACHE_CHUNK_SIZE; 0 or unset: chosen from the layout)")


def parse_tokens(text: str) -> int:
    """``4096``, ``32k``, ``1M`` (decimal: k = 1,000, M = 1,000,000) -> a positive int."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise ConfigError(f"not a token count: {text!r} (e.g. 4096, 32k, 1M)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if value < 1 or value != int(value):
        raise ConfigError(f"a token count must be a positive integer, got {text!r}")
    return int(value)


def model_of(args: argparse.Namespace, *, layers: Optional[int] = None) -> presets.ModelKV:
    """The ModelKV the arguments name. Raises ConfigError / LayoutError on bad input."""
    if args.chunk_size < 0:
        raise ConfigError(f"--chunk-size must be >= 0 (0: chosen from the layout), got {args.chunk_size}")
    if args.block_size is not None and args.block_size <= 0:
        raise ConfigError(f"--block-size must be > 0, got {args.block_size}")
    if args.tp < 1 or args.dcp < 1 or args.dcp_interleave < 1:
        raise ConfigError("--tp, --dcp and --dcp-interleave must be >= 1")
    dcp = DCPSpec(rank=0, size=args.dcp, interleave_tokens=args.dcp_interleave)
    if args.preset:
        kw = dict(engine=args.engine, tp=args.tp, dcp=dcp, block_size=args.block_size, layers=layers)
        return presets.preset(args.preset, **kw)
    path = args.config
    import os

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if layers is not None and isinstance(hf, dict):
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        text["num_hidden_layers"] = layers
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
    return presets.from_hf_config(hf, name=name, kv_dtype=args.kv_dtype, engine=args.engine, tp=args.tp, dcp=dcp,
                                  block_size=args.block_size)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def settle_chunk_size(args: argparse.Namespace, layout) -> str:
    """Give ``args.chunk_size`` the layout's choice when it is 0 (unset), as an engine would;
    returns the words the output shows (why this size)."""
    if args.chunk_size:
        return "set"
    choice = choose_chunk_size(layout_rules(layout))
    args.chunk_size = choice.tokens
    return choice.reason
