"""This process's NIXL agent, whose progress thread sleeps between polls.

Ray's nixl transport builds one NIXL agent per process on first use, with NIXL's
defaults: a progress thread that polls the UCX backend with no pause (nixl's Python
wrapper hard-codes `pthrDelay = 0`). That thread keeps a core busy for as long as the
process lives, idle or not, in every prefill rank and decode replica. The thread cannot
simply be turned off: the exporting side must answer the importer's connection and
reads, and without it a fetch never completes.

So each process that uses the transport builds the agent itself, with a progress delay,
and gives it to Ray's transport manager before Ray would build its own. With
`PROGRESS_DELAY_US` an idle process spends a few percent of a core on it, and a fetch is
still quick (bench/RESULTS.md, "KV handoff: copies and transports"). Ray and nixl offer
no setting for this; the two private names used here (`nixl_agent`'s binding module, the
manager's `_nixl_agent`) are checked by `tests/test_nixl_agent.py`, which fails if an
upgrade renames them.
"""

from __future__ import annotations

import os
import sys
import threading
import types

# Long enough to make the idle thread nearly free, short against a transfer: each
# sleep delays only the exporter's next answer to an importer's UCX request.
PROGRESS_DELAY_US = 1000

_lock = threading.Lock()
_installed = False


def install_nixl_agent() -> None:
    """Give Ray's nixl transport this process's agent, once. Must run before the
    process's first `ray.put(..., _tensor_transport="nixl")` or nixl fetch."""
    global _installed
    with _lock:
        if _installed:
            return
        from ray.experimental.rdt.util import get_tensor_transport_manager

        manager = get_tensor_transport_manager("NIXL")
        if manager._nixl_agent is not None:
            raise RuntimeError(
                "Ray built this process's NIXL agent before install_nixl_agent ran; "
                "call it before the process's first nixl transfer"
            )
        backend = manager.select_backend()
        manager._nixl_agent = _agent_with_progress_delay(
            f"baton-{os.getpid()}-{os.urandom(4).hex()}", backend, PROGRESS_DELAY_US
        )
        manager._backend = backend
        _installed = True


def _agent_with_progress_delay(name: str, backend: str, delay_us: int):
    """nixl's own `nixl_agent`, built while its binding module's config class is one
    that keeps `delay_us` whatever the wrapper assigns to `pthrDelay`."""
    from nixl._api import nixl_agent, nixl_agent_config

    wrapper = sys.modules[nixl_agent.__module__]
    binding = wrapper.nixlBind

    class Config(binding.nixlAgentConfig):
        def __setattr__(self, key: str, value) -> None:
            super().__setattr__(key, delay_us if key == "pthrDelay" else value)

    patched = types.ModuleType(binding.__name__)
    patched.__dict__.update(binding.__dict__)
    patched.nixlAgentConfig = Config
    wrapper.nixlBind = patched
    try:
        return nixl_agent(name, nixl_agent_config(backends=[backend]))
    finally:
        wrapper.nixlBind = binding
