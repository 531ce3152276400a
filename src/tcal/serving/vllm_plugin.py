"""The vLLM plugin: makes vLLM serve `tcal-export --format vllm` checkpoints (architecture `TcalHybridForCausalLM`).

vLLM calls `register` in every process it starts (entry point group `vllm.general_plugins`, see pyproject.toml),
before it reads a model's config. Three registrations, each needed:

- transformers' `AutoConfig` learns `model_type: tcal_hybrid` (`TcalHybridServeConfig`), so vLLM can parse the
  checkpoint's config without tcal's training code;
- vLLM's model registry maps the architecture name to `tcal.serving.vllm_model.TcalHybridForCausalLM` (by path, so the
  model module is imported only when such a checkpoint is served);
- vLLM's per-architecture config hook (`MODELS_CONFIG_MAP`) gets `TcalHybridConfigHook`: vLLM applies its
  architecture-specific config updates by name, and a name it does not know would get none. The hook keeps the GDN
  recurrent state in float32 (the student's own precision; vLLM otherwise stores it in the model's bfloat16).
"""

from __future__ import annotations

import logging

from tcal.serving import ARCHITECTURE, MODEL_TYPE

STATE_DTYPE = "float32"
log = logging.getLogger(__name__)

def teacher_fields(teacher) -> dict:
    """The teacher's config entries a serving engine reads at the top level (sizes, RoPE, activation)."""
    skip = {"model_type", "architectures", "layer_types", "transformers_version", "auto_map", "dtype", "torch_dtype"}
    return {key: value for key, value in teacher.to_dict().items() if key not in skip}


def serve_config_class():
    """A transformers config for `tcal_hybrid`: the teacher's config nested as `teacher_config` and mirrored at the top
    level, `layer_types` the student's (`linear_attention` for a GDN layer), and `gdn_norm_eps`."""
    from transformers import AutoConfig, PretrainedConfig

    class TcalHybridServeConfig(PretrainedConfig):
        model_type = MODEL_TYPE

        def __init__(self, teacher_config=None, layer_types=None, gdn_norm_eps: float = 1e-5, **kwargs):
            if isinstance(teacher_config, dict):
                teacher_config = AutoConfig.for_model(**teacher_config)
            mirrored = teacher_fields(teacher_config) if teacher_config is not None else {}
            for key in mirrored:
                kwargs.pop(key, None)
            super().__init__(**kwargs)
            self.teacher_config = teacher_config
            self.layer_types = list(layer_types) if layer_types is not None else None
            self.gdn_norm_eps = gdn_norm_eps
            for key, value in mirrored.items():
                setattr(self, key, value)

        def to_dict(self):
            out = super().to_dict()
            if isinstance(self.teacher_config, PretrainedConfig):
                out["teacher_config"] = self.teacher_config.to_dict()
            return out

    return TcalHybridServeConfig


def config_hook_class():
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class TcalHybridConfigHook(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            cache = vllm_config.cache_config
            if cache.mamba_ssm_cache_dtype == "auto":
                cache.mamba_ssm_cache_dtype = STATE_DTYPE
            elif cache.mamba_ssm_cache_dtype != STATE_DTYPE:
                log.warning("tcal hybrid: GDN state kept in %s as requested (the student's is %s)",
                            cache.mamba_ssm_cache_dtype, STATE_DTYPE)

    return TcalHybridConfigHook


def register() -> None:
    """The entry point: idempotent, as vLLM may call it more than once per process."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, serve_config_class())
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "tcal.serving.vllm_model:TcalHybridForCausalLM")
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, config_hook_class())
