"""tcal's students in serving engines: the vLLM plugin (`vllm_plugin`, entry point `vllm.general_plugins`), its
model (`vllm_model`) and a generation helper the export and the tests run with vLLM's Python (`generate`).

Installed with the `serve` extra next to vLLM; nothing here imports tcal's training stack, so the package installed
without its dependencies (`pip install --no-deps`, as `make serve-check` does) is enough for vLLM to load it.
"""

ARCHITECTURE = "TcalHybridForCausalLM"  # the plugin's name in vLLM's model registry; `--format vllm` writes it
MODEL_TYPE = "tcal_hybrid"  # the checkpoint's model_type the plugin teaches transformers to parse
# The teacher families the plugin builds kept layers for are `tcal.registry.VLLM_FAMILIES`.
