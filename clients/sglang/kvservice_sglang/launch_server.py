"""``python -m kvservice_sglang.launch_server <sglang server args>``: SGLang's own server with the
kvservice backend registered first (the same as the installed plugin; for environments whose
``SGLANG_PLUGINS`` leaves it out). Spawned SGLang processes import this module again as their
main module, so the backend is registered there too."""

from __future__ import annotations

from kvservice_sglang.plugin import register

register()

if __name__ == "__main__":
    import runpy

    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
