"""What each `tcal-export --format` does, as an `ExportFormat` object named in `tcal.registry.EXPORT_FORMATS`:
refuse a student it cannot hold, write it, reload what it wrote as the format's users load it, and add what its check
measured to the export's record. `tcal.export.write` runs the same steps for every format; a new format is one module
holding its `ExportFormat` plus one `declare` line (in tcal's registry, or in a `TCAL_PLUGINS` package's module).

- `tcal`: the hybrid as tcal saves it (reloaded with tcal imported).
- `hf`: the same checkpoint plus its own modeling code (`remote/modeling_tcal_hybrid.py`) and an `auto_map`,
  reloaded with `trust_remote_code=True` through that code.
- `vllm`: the checkpoint of tcal's vLLM plugin (`tcal.serving`): the plugin's architecture name, and with a vLLM
  interpreter (`serve_python`) the engine's own check under the bfloat16 rule.
- `qwen3_5`: stock `Qwen3_5ForCausalLM` (`tcal.export.qwen3_5.QWEN3_5`).
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import torch

from tcal.export.companions import carry_or_drop, loads_as_source
from tcal.export.parity import Parity, compare, engine_agreement
from tcal.export.refusal import ExportRefused, ParityFailed
from tcal.export.remote import modeling_code
from tcal.registry import VLLM_FAMILIES
from tcal.serving import ARCHITECTURE

log = logging.getLogger(__name__)

REMOTE_CODE = Path(__file__).parent / "remote" / "modeling_tcal_hybrid.py"


class ExportFormat:
    """One format. Each step has the default of a checkpoint transformers loads with tcal imported; a format
    overrides what differs. `tcal.export.write.export` calls, in order: `check` (before any work), `write` (into a
    temporary folder), `check_written` (the parity check, and record entries), and, when parity passed,
    `after_parity` (more record entries, or ParityFailed). `options` names what `configured` takes from the
    command line (`--outtype` for gguf); most formats take none."""

    options: tuple[str, ...] = ()

    def configured(self, **options):
        """This format with the options `tcal-export` was given for it (only names in `options` reach it)."""
        return self

    trust_remote_code = False  # what the format's users pass to transformers' loaders (the model's and tokenizer's)

    def check(self, config) -> None:
        """Raise ExportRefused when the student of `config` (its `HybridConfig`) cannot be held exactly."""

    def write(self, student, tokenizer, folder: Path) -> None:
        """Write the student (and its tokenizer, when not None) into `folder`: tcal's own checkpoint, its config.json
        rewritten with `edit_config`'s changes."""
        from tcal.student.export import write_student

        write_student(student, tokenizer, folder)
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        self.edit_config(config, folder)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def edit_config(self, config: dict, folder: Path) -> None:
        """Change the written config.json (`config`, in place); files the format adds go into `folder`."""

    def reload(self, folder: Path):
        """What was written, loaded as a user of the format loads it (float32, eval mode)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def check_written(self, student, folder: Path, prompts: list[list[int]], tolerance: float) -> tuple[Parity, dict]:
        """The reloaded export compared with the student on `prompts`, and the record entries the format adds."""
        return compare(student, self.reload(folder), prompts, tolerance), {}

    def after_parity(self, student, folder: Path, prompts: list[list[int]], serve_python: Path | None) -> dict:
        """Record entries of further checks once parity passed (raise ParityFailed to refuse the export)."""
        return {}

    def carry(self, source: Path, folder: Path) -> dict:
        """The files beside the student that DEST's users read, carried from SOURCE's student folder `source` into the
        written export `folder` or their pointers dropped (`tcal.export.companions`); the record's entry."""
        return carry_or_drop(source, folder)

    def loads(self, folder: Path, source: Path, tokenizer) -> dict:
        """DEST loaded as the format's users load it (its tokenizer, generation defaults, the files its configs name)
        against SOURCE's; ParityFailed naming what differs."""
        return loads_as_source(folder, source, tokenizer, self.trust_remote_code)


class TcalFormat(ExportFormat):
    """`tcal`: the hybrid as tcal saves it (`model_type: tcal_hybrid`; loading needs `import tcal`)."""


class HfFormat(ExportFormat):
    """`hf`: loaded with `trust_remote_code=True` where tcal is not installed (torch and transformers only)."""

    trust_remote_code = True

    def edit_config(self, config: dict, folder: Path) -> None:
        (folder / REMOTE_CODE.name).write_text(modeling_code(), encoding="utf-8")
        module = REMOTE_CODE.stem
        config["auto_map"] = {"AutoConfig": f"{module}.TcalHybridConfig",
                              "AutoModelForCausalLM": f"{module}.TcalHybridForCausalLM"}
        config["architectures"] = ["TcalHybridForCausalLM"]
        config["model_type"] = "tcal_hybrid_hf"

    def reload(self, folder: Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     trust_remote_code=self.trust_remote_code)
        if "tcal" in type(model).__module__.split(".")[0]:
            raise RuntimeError(f"--format hf reloaded through {type(model).__module__}, not the shipped modeling code")
        return model.eval()


class VllmFormat(ExportFormat):
    """`vllm`: the checkpoint of tcal's vLLM plugin, for every teacher family the plugin builds
    (`tcal.registry.VLLM_FAMILIES`). The reload here reads the same config and weights the plugin does."""

    def check(self, config) -> None:
        family = config.teacher_config.model_type
        if family not in VLLM_FAMILIES:
            raise ExportRefused(f"--format vllm: the plugin serves {', '.join(VLLM_FAMILIES.names())} students; "
                                f"this one's teacher is {family!r}")

    def edit_config(self, config: dict, folder: Path) -> None:
        config["architectures"] = [ARCHITECTURE]

    def after_parity(self, student, folder: Path, prompts: list[list[int]], serve_python: Path | None) -> dict:
        """`engine_check`: vLLM's own check (`engine_check`) when a vLLM interpreter is given."""
        if serve_python is None:
            log.info("vLLM engine check skipped: no vLLM interpreter given (--serve-python)")
            return {"engine_check": {"checked": False, "why": "no vLLM interpreter given (--serve-python)"}}
        engine = engine_check(folder, student, prompts, Path(serve_python))
        log.info("vLLM engine check: %s", engine["summary"])
        if not engine["passed"]:
            raise ParityFailed(f"--format vllm: vLLM's bf16 output fails the agreement rule ({engine['summary']})")
        return {"engine_check": {"checked": True, **engine}}


def engine_check(folder: Path, student, prompts: list[list[int]], serve_python: Path) -> dict:
    """The vLLM engine's greedy tokens and top-k on `prompts` (a subprocess of `serve_python`, bfloat16 on this
    machine's CPU), judged by the bfloat16 rule against the float32 student."""
    from tcal.export.parity import GREEDY_TOKENS, TOP_K

    request = json.dumps({"model": str(folder), "prompts": prompts, "tokens": GREEDY_TOKENS, "top_k": TOP_K})
    done = subprocess.run([str(serve_python), "-m", "tcal.serving.generate"], input=request, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise ParityFailed(f"vLLM ({serve_python}) could not serve the export: {tail[0]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    agreement = engine_agreement(student, prompts, answer["tokens"], answer["top_k"])
    return {**agreement.record(), "engine": answer["engine"], "summary": agreement.summary()}


TCAL = TcalFormat()
HF = HfFormat()
VLLM = VllmFormat()
