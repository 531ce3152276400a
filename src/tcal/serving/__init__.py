"""tcal's students in serving engines: the vLLM plugin (`vllm_plugin`, entry point `vllm.general_plugins`), its
model (`vllm_model`) and a generation helper the export and the tests run with vLLM's Python (`generate`).

Installed with the `serve` extra next to vLLM; nothing here imports tcal's training stack, so the package installed
without its dependencies (`pip install --no-deps`, as `make serve-check` does) is enough for vLLM to load it.
"""
