"""KVarN as a vLLM 0.26 plugin: `vllm serve M --kv-cache-dtype kvarn_k4v2_g128 --block-size 128` on stock vLLM.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml); vLLM calls it once in every process (front
end, engine core, each worker). It is idempotent, imports vLLM only when called, and does nothing but warn on vLLM
versions other than 0.26.x. To load vLLM without it, leave it out of vLLM's own plugin list (VLLM_PLUGINS).
See docs/vllm-backend.md.
"""
from __future__ import annotations

import logging
import os
import threading

from .common import SUPPORTED_VLLM, is_kvarn, kvarn_dtype_names

__all__ = ["register", "is_kvarn", "kvarn_dtype_names", "state"]

_LOCK = threading.Lock()
_STATE: dict = {"registered": False, "applied": [], "vllm_version": None, "pid": None}


def state() -> dict:
    return dict(_STATE)


def register() -> None:
    """Register the KVarN backend and the kvarn_* kv-cache dtypes with vLLM (once per process)."""
    with _LOCK:
        if _STATE["registered"] and _STATE["pid"] == os.getpid():
            return
        _STATE.update(registered=True, pid=os.getpid(), applied=[])
        log = logging.getLogger("vllm.kvarn")
        try:
            import vllm
        except Exception as e:  # noqa: BLE001 - no vLLM here: nothing to register
            log.debug("kvarn: vLLM not importable (%s); plugin inactive", e)
            return
        version = str(getattr(vllm, "__version__", ""))
        _STATE["vllm_version"] = version
        if not version.startswith(SUPPORTED_VLLM):
            log.warning("kvarn: this plugin targets vLLM %sx, found %s; the kvarn_* kv-cache dtypes are NOT "
                        "registered", SUPPORTED_VLLM, version or "an unknown version")
            return
        from . import patches

        from .. import settings
        from ..kernels.runtime import note_compile_cache

        note_compile_cache()  # before vLLM compiles the model and moves Triton's cache (the warm-up compiles here)

        if settings.get("KVARN_LOG_COMPILES"):  # a log line per Triton compile, timed
            from ..kernels.runtime import install_compile_log

            install_compile_log()
        _STATE["applied"] = patches.apply()
        log.debug("kvarn: plugin registered (%s)", ", ".join(_STATE["applied"]))
