"""Loading teachers and tokenizers: a GGUF file shipped in a pip package, a hub id or local folder, or a
tiny random config for tests. Every path ends in a plain `PreTrainedModel` in eval mode.

`teacher_architecture` and `meta_model` give a teacher's shape without its weights (planning, parameter counts):
the paper teachers ship their published config.json as `teacher.architecture`."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig

from tcal.errors import ConfigError
from tcal.hub import hub_offline, looks_local
from tcal.runtime.progress import throttle_transformers_bars
from tcal.settings.teacher import TeacherSettings
from tcal.store.cache import key_lock
from tcal.store.files import write_folder_atomic
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def package_file(package: str, filename: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (it ships {filename})")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{filename} not found in package {package!r} at {path}")
    return path


def resolve_pretrained(path: str) -> str:
    """A local folder, or a hub id; fails clearly for a missing local folder or an unreachable hub."""
    expanded = Path(path).expanduser()
    if expanded.is_dir():
        return str(expanded)
    if looks_local(path):
        raise FileNotFoundError(f"teacher.path={path!r}: no such local folder")
    return path


def _from_pretrained(loader, path: str, trust_remote_code: bool = False, **kwargs):
    """`loader.from_pretrained` with remote code off unless the teacher config turns it on; a clear error when a
    hub id cannot be fetched."""
    try:
        return loader.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except OSError as err:
        hint = "HF_HUB_OFFLINE is set" if hub_offline() else "the model hub may be unreachable from this machine"
        raise RuntimeError(
            f"teacher.path={path!r} is not a local folder and could not be loaded from the hub ({hint}). "
            f"Download it elsewhere and pass teacher.path=/local/folder. Cause: {err}"
        ) from err


def _gguf_folder(teacher: TeacherSettings, cache_dir: Path) -> Path:
    return Path(cache_dir) / "teachers" / teacher.name


def _gguf_cached(teacher: TeacherSettings, cache_dir: Path, dtype: torch.dtype) -> Path:
    """Convert the packaged GGUF teacher once into a safetensors folder (dequantized, tokenizer included)."""
    folder = _gguf_folder(teacher, cache_dir)
    if _converted(folder):
        return folder
    with key_lock(folder):  # parallel jobs convert once: the others wait, then use the folder
        if _converted(folder):
            return folder
        return _convert_gguf(teacher, folder, dtype)


def _converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _convert_gguf(teacher: TeacherSettings, folder: Path, dtype: torch.dtype) -> Path:
    gguf = package_file(teacher.package, teacher.gguf_file)
    log.info("converting %s to safetensors in %s (once)", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(quantized.state_dict())

    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_folder_atomic(folder, write, replace=False)


def _gguf_tokenizer(source, cache_dir: Path) -> Path:
    """The folder of a packaged GGUF's tokenizer: the converted teacher's when it is there, else the tokenizer alone,
    converted once under `tokenizers/<name>` (a few MB), so a teacher that only borrows the tokenizer (the tiny test
    teachers) never writes the dequantized weights. Both are the GGUF's tokenizer saved the same way."""
    teacher = _gguf_folder(source, cache_dir)
    if _converted(teacher):
        return teacher
    folder = Path(cache_dir) / "tokenizers" / source.name
    if (folder / "tokenizer_config.json").is_file():
        return folder
    with key_lock(folder):
        if (folder / "tokenizer_config.json").is_file():
            return folder
        gguf = package_file(source.package, source.gguf_file)
        log.info("converting the tokenizer of %s in %s (once)", gguf.name, folder)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return write_folder_atomic(folder, tokenizer.save_pretrained, replace=False)


def trust_remote_code(teacher: TeacherSettings) -> bool:
    """Code shipped with a checkpoint runs only when the teacher config says `trust_remote_code: true`."""
    return bool(teacher.trust_remote_code)


def load_tokenizer(teacher: TeacherSettings, cache_dir: str | Path):
    """The teacher's tokenizer, or the one its `tokenizer` node names (tiny test teachers borrow SmolLM2's)."""
    source = teacher.tokenizer or teacher  # TokenizerSettings, or a mapping of its keys in a config node
    if getattr(source, "path", None):
        return _from_pretrained(AutoTokenizer, resolve_pretrained(source.path), trust_remote_code(teacher))
    if getattr(source, "gguf_file", None):
        return AutoTokenizer.from_pretrained(_gguf_tokenizer(source, Path(cache_dir)))
    raise ValueError(f"teacher {teacher.name!r} names no tokenizer: set teacher.path or teacher.tokenizer")


def load_teacher(teacher: TeacherSettings, cache_dir: str | Path):
    """(teacher model in eval mode, tokenizer) from `TeacherSettings` (or a `conf/teacher/*.yaml` node)."""
    throttle_transformers_bars()
    dtype = torch_dtype(teacher.dtype)
    cache_dir = Path(cache_dir)
    attn = teacher.attn_implementation
    if teacher.path:
        path = resolve_pretrained(teacher.path)
        trust = trust_remote_code(teacher)
        adapter_for(_from_pretrained(AutoConfig, path, trust))
        model = _from_pretrained(AutoModelForCausalLM, path, trust, dtype=dtype, attn_implementation=attn)
    elif teacher.gguf_file:
        folder = _gguf_cached(teacher, cache_dir, dtype)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn)
    elif teacher.config:
        config = config_from_node(teacher.config)
        adapter_for(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(teacher.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    else:
        raise ValueError(f"teacher {teacher.name!r} needs one of: path (hub id or folder), gguf_file, config")
    adapter_for(model.config).check(model)
    model.eval().requires_grad_(False)
    return model, load_tokenizer(teacher, cache_dir)


def config_from_node(node: dict) -> PreTrainedConfig:
    """A transformers config from a mapping of config.json keys (`model_type` names the family)."""
    return AutoConfig.for_model(**dict(node))


def teacher_architecture(teacher: TeacherSettings, cache_dir: str | Path) -> PreTrainedConfig:
    """The teacher's architecture, without loading its weights: a local `teacher.path` folder's config.json, else
    the published config.json shipped as `teacher.architecture` (paper teachers), else the random `teacher.config`
    (tiny teachers), else the packaged GGUF's metadata (its converted folder's config.json once it exists)."""
    local = Path(str(teacher.path)).expanduser() if teacher.path else None
    if local is not None and local.is_dir():
        return _from_pretrained(AutoConfig, str(local), trust_remote_code(teacher))
    for key in ("architecture", "config"):
        if getattr(teacher, key):
            return config_from_node(getattr(teacher, key))
    if teacher.gguf_file:
        folder = _gguf_folder(teacher, Path(cache_dir))
        if (folder / "config.json").is_file():
            return AutoConfig.from_pretrained(folder)
        gguf = package_file(teacher.package, teacher.gguf_file)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    raise ConfigError(f"teacher {teacher.name!r}: teacher.path={teacher.path!r} is a hub id and no architecture ships "
                      f"with it; pass teacher.path=/local/folder (its config.json is read) or add teacher.architecture")


def meta_model(config: PreTrainedConfig, dtype: torch.dtype = torch.float32):
    """The causal LM of `config` on the meta device: every parameter's shape and dtype, no storage, no init cost."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied output head counts once)."""
    return sum(p.numel() for p in model.parameters())
