"""What a vLLM server's ``kv_role`` lets kvconnect do: look up and load, store, or both.

vLLM names the role of a KV connector in ``--kv-transfer-config``'s ``kv_role``; kvconnect
follows it (docs/vllm.md, "Prefill/decode disaggregation"):

| kv_role       | looks up / loads | stores                                                       |
|---------------|------------------|--------------------------------------------------------------|
| ``kv_both``   | yes              | every chunk a request completes (as without P/D)             |
| ``kv_producer`` | never          | every chunk; a prefill for a remote decode also its partial last chunk |
| ``kv_consumer`` | yes            | nothing; with ``save_decode_cache`` the chunks generated tokens complete |

A producer and a consumer only meet through a tier both can read, so either role without a
shared tier (``server_url``: the node cache server; ``remote_url``: Redis / Valkey) is refused
at start, as is a role vLLM does not define. ``role_policy`` raises ``ConfigError`` once, in
the connector's constructor, before anything is allocated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from kvconnect.config import Config
from kvconnect.errors import ConfigError


class Role(str, enum.Enum):
    BOTH = "kv_both"
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"


@dataclass(frozen=True)
class RolePolicy:
    """The role as the scheduler side applies it.

    loads: the server looks chunks up and loads them. stores_prompt: it stores the chunks of
    prompts. stores_decode: it stores the chunks generated tokens complete (``save_decode_cache``).
    """

    role: Role
    loads: bool
    stores_prompt: bool
    stores_decode: bool

    @property
    def stores(self) -> bool:
        return self.stores_prompt or self.stores_decode


# Config fields naming a tier that another vLLM server (another process) reads too. A new
# shared tier (e.g. Mooncake Store) adds its field here; the node server and Redis are today's.
SHARED_TIER_FIELDS = ("server_url", "remote_url")


def shared_tiers(config: Config) -> tuple[str, ...]:
    """The configured fields of tiers that another server can read (empty: none)."""
    return tuple(name for name in SHARED_TIER_FIELDS if getattr(config, name, None))


def role_policy(kv_role: Optional[str], config: Config) -> RolePolicy:
    """The policy of ``kv_role`` (vLLM's value; None means ``kv_both``) under ``config``.

    Raises ConfigError for a role vLLM does not define, or for a producer / consumer with no
    shared tier (its chunks could never reach the other side).
    """
    raw = "kv_both" if kv_role is None else str(getattr(kv_role, "value", kv_role))
    try:
        role = Role(raw)
    except ValueError:
        raise ConfigError(f"kv_role {raw!r} is not one of {', '.join(r.value for r in Role)} "
                          "(--kv-transfer-config)") from None
    if role is not Role.BOTH and not shared_tiers(config):
        raise ConfigError(
            f"kv_role {role.value!r} needs a tier the other side of the P/D pair can read: set "
            f"{' or '.join(SHARED_TIER_FIELDS)} (KVCONNECT_SERVER_URL for the node cache server, "
            "LMCACHE_REMOTE_URL for Redis / Valkey or mooncakestore://HOST:PORT for Mooncake Store); with only the CPU pool nothing crosses between servers")
    if role is Role.PRODUCER:
        return RolePolicy(role, loads=False, stores_prompt=True, stores_decode=config.save_decode_cache)
    if role is Role.CONSUMER:
        return RolePolicy(role, loads=True, stores_prompt=False, stores_decode=config.save_decode_cache)
    return RolePolicy(role, loads=True, stores_prompt=True, stores_decode=config.save_decode_cache)


BOTH = RolePolicy(Role.BOTH, loads=True, stores_prompt=True, stores_decode=False)
