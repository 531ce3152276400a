"""The `serve` group: real engines on this CPU (`make serve-check`, which builds the venvs it needs and sets
TCAL_SERVE_VENV / TCAL_HF_VENV). vLLM runs in its own venv (.venv-serve) through `python -m tcal.serving.generate`;
the `hf` and `qwen3_5` exports are loaded in a venv holding only torch and transformers (.venv-hf).

- The default SmolLM2 student (uniform 50%, `make run`'s `full` init shortened to `SMOLLM2_PHASE2_STEPS` Phase 2
  steps per layer, stage none), exported `--format vllm`, served by vLLM in bf16, passes the bf16 rule against the
  float32 student (`tcal.export.parity`); the same export with a wrong norm convention fails it. A naive or Phase-1
  student would not do: its own bf16 forward in transformers already fails the rule against its float32 one (the
  random GDN branches amplify rounding), so no engine could pass it.
- A tiny Qwen3 student exported `--format qwen3_5` is served by vLLM under its stock `Qwen3_5ForCausalLM` and matches
  the student in float32 through transformers without tcal; a tiny Qwen2 student is served through the plugin.
- The SmolLM2 student's `hf` export loads and generates in the torch-and-transformers venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import make_teacher
from safetensors.torch import load_file, save_file

from tcal.export.parity import GREEDY_TOKENS, TOP_K, engine_agreement, greedy, logits, parity_prompts
from tcal.export.write import export

pytestmark = pytest.mark.serve

SERVE_VENV = os.environ.get("TCAL_SERVE_VENV")
HF_VENV = os.environ.get("TCAL_HF_VENV")
if not SERVE_VENV or not (Path(SERVE_VENV) / "bin" / "python").is_file():
    pytest.skip("serve group: needs vLLM's venv; run `make serve-check` (builds .venv-serve and runs it)",
                allow_module_level=True)
SERVE_PYTHON = (Path(SERVE_VENV) / "bin" / "python").absolute()
HF_PYTHON = (Path(HF_VENV or ".venv-hf") / "bin" / "python").absolute()
ENGINE_TIMEOUT_S = 600


def serve(folder: Path, prompts) -> dict:
    """vLLM's greedy tokens and top-k for `prompts` (bf16, this CPU)."""
    request = json.dumps({"model": str(folder), "prompts": prompts, "tokens": GREEDY_TOKENS, "top_k": TOP_K})
    done = subprocess.run([str(SERVE_PYTHON), "-m", "tcal.serving.generate"], input=request, capture_output=True,
                          text=True, timeout=ENGINE_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


HF_LOAD = """
import importlib.util, json, sys, torch
from transformers import AutoModelForCausalLM
assert importlib.util.find_spec("tcal") is None, "tcal is importable in this venv"
request = json.loads(sys.stdin.read())
model = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float32, trust_remote_code=True).eval()
out = {"class": type(model).__module__ + "." + type(model).__name__, "logits": [], "greedy": []}
with torch.no_grad():
    for prompt in request["prompts"]:
        ids = torch.tensor([prompt])
        out["logits"].append(model(ids, use_cache=False).logits[0].tolist())
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request["tokens"],
                                   min_new_tokens=request["tokens"], do_sample=False, pad_token_id=0)
        out["greedy"].append(generated[0, len(prompt):].tolist())
print(json.dumps(out))
"""


def load_without_tcal(folder: Path, prompts) -> dict:
    """Logits and greedy tokens of `folder` loaded by transformers in the venv without tcal."""
    assert HF_PYTHON.is_file(), f"{HF_PYTHON} missing: `make serve-check` builds it"
    request = json.dumps({"model": str(folder), "prompts": prompts, "tokens": GREEDY_TOKENS})
    # one thread, as this process computes the student's logits: float32 sums in another order differ by ~1e-4
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run([str(HF_PYTHON), "-c", HF_LOAD], input=request, capture_output=True, text=True,
                          timeout=ENGINE_TIMEOUT_S, check=False, cwd=folder.parent, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SMOLLM2_PHASE2_STEPS = 30  # per layer (the default is 300); the calibrated layers are cached for the next run


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(float32 student, tokenizer, its folder, its fixed prompts): SmolLM2-135M, uniform 50%, short `full` init."""
    from tcal import api
    from tcal.retention.uniform import uniform_layers
    from tcal.settings import CalibrationSettings, DataSettings, Phase2Settings, default_teacher, init_settings

    teacher = api.load_teacher(default_teacher())
    student = api.build_student(teacher, uniform_layers(teacher.num_layers, 0.5))
    api.initialize(student, teacher, api.load_data(DataSettings()), init_settings("full"),
                   calibration=CalibrationSettings(phase2=Phase2Settings(steps=SMOLLM2_PHASE2_STEPS)))
    folder = api.save(student, teacher.tokenizer, tmp_path_factory.mktemp("smollm2") / "student")
    return student, teacher.tokenizer, folder, parity_prompts(teacher.tokenizer, student.config.vocab_size)


def test_smollm2_student_served_by_vllm_passes_the_bf16_rule(smollm2, tmp_path):
    student, _, folder, prompts = smollm2
    record = export(folder, tmp_path / "vllm", "vllm", serve_python=SERVE_PYTHON)
    check = record["engine_check"]
    assert check["checked"] and check["passed"], check["summary"]
    assert check["engine"]["architecture"] == "TcalHybridForCausalLM" and check["engine"]["dtype"] == "bfloat16"
    assert check["engine"]["gdn_state_dtype"] == "float32"  # the plugin's config hook, as the student keeps it


def test_broken_vllm_export_fails_the_bf16_rule(smollm2, tmp_path):
    """The GDN layers' gated-norm weights written zero-centred (w - 1), as Qwen3.5 stores its other norms."""
    student, _, folder, prompts = smollm2
    export(folder, tmp_path / "vllm", "vllm")
    weights_file = tmp_path / "vllm" / "model.safetensors"
    weights = load_file(weights_file)
    broken = {name: tensor - 1.0 if name.endswith("self_attn.o_norm.weight") else tensor
              for name, tensor in weights.items()}
    assert any(not torch.equal(broken[name], weights[name]) for name in weights)
    save_file(broken, weights_file, metadata={"format": "pt"})
    answer = serve(tmp_path / "vllm", prompts)
    agreement = engine_agreement(student, prompts, answer["tokens"], answer["top_k"])
    assert not agreement.passed, agreement.summary()


def test_smollm2_hf_export_generates_without_tcal(smollm2, tmp_path):
    student, _, folder, prompts = smollm2
    export(folder, tmp_path / "hf", "hf")
    loaded = load_without_tcal(tmp_path / "hf", prompts)
    assert loaded["class"].endswith("modeling_tcal_hybrid.TcalHybridForCausalLM")
    for prompt, their_logits, their_greedy in zip(prompts, loaded["logits"], loaded["greedy"], strict=True):
        assert (torch.tensor(their_logits) - logits(student, prompt)).abs().max().item() <= 1e-4
        assert their_greedy == greedy(student, prompt)


def tiny_student(family: str):
    """A tiny student vLLM's CPU GDN path takes (head dim 64), eps equal across norms (exact Qwen3.5 map)."""
    from tcal.student.convert import build_student

    teacher = make_teacher(family, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                           rms_norm_eps=1e-5)
    return build_student(teacher, [0, 2])


def test_qwen3_5_export_served_by_stock_vllm_and_transformers(tmp_path):
    from tcal.student.export import export_student

    student = tiny_student("qwen3")
    folder = export_student(student, None, tmp_path / "student")
    record = export(folder, tmp_path / "q35", "qwen3_5")
    prompts = parity_prompts(None, student.config.vocab_size)
    answer = serve(tmp_path / "q35", prompts)
    assert answer["engine"]["architecture"] == "Qwen3_5ForCausalLM"
    agreement = engine_agreement(student, prompts, answer["tokens"], answer["top_k"])
    assert agreement.passed, agreement.summary()
    loaded = load_without_tcal(tmp_path / "q35", prompts)
    assert loaded["class"] == "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5ForCausalLM"
    worst = max((torch.tensor(theirs) - logits(student, prompt)).abs().max().item()
                for prompt, theirs in zip(prompts, loaded["logits"], strict=True))
    assert worst <= 1e-4 and record["parity"]["passed"]


def test_qwen2_student_served_through_the_plugin(tmp_path):
    from tcal.student.export import export_student

    student = tiny_student("qwen2")
    folder = export_student(student, None, tmp_path / "student")
    record = export(folder, tmp_path / "vllm", "vllm", serve_python=SERVE_PYTHON)
    assert record["engine_check"]["passed"], record["engine_check"]["summary"]
