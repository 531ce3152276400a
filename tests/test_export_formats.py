"""`tcal-export` without a serving engine: the exact Qwen3.5 map through stock transformers, the self-contained `hf`
checkpoint, the `vllm` checkpoint's config, the parity record, an export that fails parity left unwritten, and
the one-line refusals. Tiny random students (seconds); the engines themselves are in test_serve.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from conftest import make_teacher

from tcal.export.cli import main as export_main
from tcal.export.formats import REMOTE_CODE
from tcal.export.parity import compare, parity_prompts
from tcal.export.qwen3_5 import qwen3_5_model, torch_reference_kernels
from tcal.export.refusal import ExportRefused, ParityFailed
from tcal.export.remote import WRAPPER, modeling_code
from tcal.export.write import EXPORT_RECORD, export
from tcal.store.files import MANIFEST
from tcal.student import gdn_torch
from tcal.student.convert import build_student
from tcal.student.export import export_student

# The student's GDN norm eps: Qwen3.5 has one eps for every norm (tcal.export.qwen3_5), equal here so the map is exact.
EPS = 1e-5


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    """{family: (student, its saved folder)} for a Qwen3 and a Llama student with layers 1 and 3 converted."""
    out = {}
    for family in ("qwen3", "llama"):
        student = build_student(make_teacher(family, rms_norm_eps=EPS), [0, 2])
        folder = export_student(student, None, tmp_path_factory.mktemp(family) / "student")
        out[family] = (student, folder)
    return out


def test_qwen3_5_export_is_stock_transformers_within_tolerance(students, tmp_path):
    student, folder = students["qwen3"]
    record = export(folder, tmp_path / "q35", "qwen3_5")
    config = json.loads((tmp_path / "q35" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    assert record["parity"]["passed"] and record["parity"]["max_abs_logit_diff"] <= 1e-4
    assert record["parity"]["greedy_identical"] == record["parity"]["prompts"] == 3
    assert record["rms_norm_eps"]["written"] == student.config.gdn_norm_eps
    written = json.loads((tmp_path / "q35" / EXPORT_RECORD).read_text())
    assert written == record
    assert EXPORT_RECORD in json.loads((tmp_path / "q35" / MANIFEST).read_text())["files"]


def test_wrong_norm_convention_fails_parity(students):
    """The fault the bf16 rule is built to catch, here in float32: Qwen3.5's zero-centred norms written as w."""
    student, _ = students["qwen3"]
    broken = qwen3_5_model(student)
    with torch.no_grad():
        for name, parameter in broken.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                parameter += 1.0
    with torch_reference_kernels():
        right = compare(student, qwen3_5_model(student), parity_prompts(None, 101))
        wrong = compare(student, broken, parity_prompts(None, 101))
    assert right.passed
    assert not wrong.passed and wrong.max_abs_logit_diff > 1000 * right.max_abs_logit_diff


def test_export_failing_parity_is_not_written(students, tmp_path):
    _, folder = students["qwen3"]
    with pytest.raises(ParityFailed, match="does not reproduce the student"):
        export(folder, tmp_path / "q35", "qwen3_5", tolerance=0.0)  # float32 rounding alone exceeds 0
    assert list(tmp_path.iterdir()) == []  # neither the export nor a temporary sibling


def test_hf_export_loads_its_own_code(students, tmp_path):
    student, folder = students["llama"]
    record = export(folder, tmp_path / "hf", "hf", )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tcal_hybrid.TcalHybridForCausalLM"
    assert config["model_type"] != student.config.model_type  # where tcal is installed, its class does not win
    assert (tmp_path / "hf" / REMOTE_CODE.name).read_bytes() == modeling_code().encode("utf-8")
    assert record["parity"]["passed"]


def test_the_hf_export_runs_every_call_a_user_makes(students, tmp_path):
    """Through stock transformers and the shipped code: a plain forward (every argument at its default), generate
    with the cache, and a left-padded batch each give the student's logits and tokens; the record lists the calls."""
    from transformers import AutoModelForCausalLM

    from tcal.export.parity import CALLS, greedy, padded_batch

    student, folder = students["llama"]
    record = export(folder, tmp_path / "hf", "hf")
    assert record["parity"]["passed"] and record["parity"]["calls"] == list(CALLS)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32).eval()
    prompts = parity_prompts(None, student.config.vocab_size)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            assert torch.allclose(model(ids).logits, student(ids).logits, atol=1e-4)
            assert greedy(model, prompt) == greedy(student, prompt)
        (got, got_tokens), (want, want_tokens) = padded_batch(model, prompts), padded_batch(student, prompts)
    assert got_tokens == want_tokens and all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, want))


def test_parity_fails_an_export_that_cannot_make_a_user_s_call_or_pad(students):
    """The faults a use_cache=False forward alone never meets: code that needs an argument a plain call does not pass,
    and code that ignores the attention mask of a padded batch."""
    import copy

    student, _ = students["llama"]
    prompts = parity_prompts(None, student.config.vocab_size)
    needs_use_cache = copy.deepcopy(student)
    forward = needs_use_cache.forward

    def forward_needing_use_cache(*args, use_cache=None, **kwargs):
        if use_cache is None:
            raise AttributeError("'TcalHybridConfig' object has no attribute 'use_cache'")
        return forward(*args, use_cache=use_cache, **kwargs)

    needs_use_cache.forward = forward_needing_use_cache
    failed = compare(student, needs_use_cache, prompts)
    assert not failed.passed and failed.failed_call.startswith("plain forward (AttributeError: ")
    assert "fails a plain forward" in failed.summary()
    ignores_padding = copy.deepcopy(student)
    unmasked = ignores_padding.forward
    ignores_padding.forward = lambda *args, attention_mask=None, **kwargs: unmasked(*args, **kwargs)
    padded = compare(student, ignores_padding, prompts)
    assert not padded.passed and padded.failed_call is None and padded.max_abs_logit_diff > 1e-2
    assert compare(student, copy.deepcopy(student), prompts).passed


def imported_roots(code: str) -> set[str]:
    tree = ast.parse(code)
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return roots


def test_hf_modeling_code_imports_torch_and_transformers_only():
    """The shipped file, and the GDN module tcal splices into it, import nothing of tcal's."""
    shipped, spliced = imported_roots(modeling_code()), imported_roots(Path(gdn_torch.__file__).read_text())
    assert "tcal" in imported_roots(WRAPPER.read_text())  # the wrapper as it stands in tcal: what the splice replaces
    assert shipped <= {"__future__", "math", "torch", "transformers"}, shipped
    assert spliced <= {"__future__", "math", "torch", "transformers"}, spliced


def test_the_hf_modeling_file_is_the_wrapper_with_the_student_s_gdn_layer_spliced_in():
    """The GDN maths written once: the shipped file is the wrapper with its line importing `tcal.student.gdn_torch`
    replaced by that module's text, less its `from __future__` line (the wrapper's stands at the top), and tcal's own
    GDN layer is that module's."""
    from tcal.student.gdn import GatedDeltaNet

    future = "from __future__ import annotations\n"
    splice = "from tcal.student.gdn_torch import GatedDeltaNet, padding_mask\n"
    head, found, tail = WRAPPER.read_text().partition(splice)
    maths = Path(gdn_torch.__file__).read_text()
    assert found and maths.count(future) == 1
    assert modeling_code() == head + maths.replace(future, "") + tail
    assert issubclass(GatedDeltaNet, gdn_torch.GatedDeltaNet)
    assert {"_heads", "qkv", "gates", "mix", "project_out"}.isdisjoint(vars(GatedDeltaNet))  # adds, never rewrites


def test_vllm_export_names_the_plugin_and_says_the_engine_was_not_checked(students, tmp_path):
    _, folder = students["llama"]
    record = export(folder, tmp_path / "v", "vllm")
    assert json.loads((tmp_path / "v" / "config.json").read_text())["architectures"] == ["TcalHybridForCausalLM"]
    assert record["parity"]["max_abs_logit_diff"] == 0.0  # the same weights, read back by the same code
    assert record["engine_check"] == {"checked": False, "why": "no vLLM interpreter given (--serve-python)"}


def test_run_folder_source_is_its_student(students, tmp_path):
    _, folder = students["llama"]
    run = folder.parent
    record = export(run, tmp_path / "t", "tcal")
    assert record["source"] == str(folder.resolve())


def test_qwen3_5_refuses_a_llama_student_in_one_line(students, tmp_path, capsys):
    _, folder = students["llama"]
    with pytest.raises(ExportRefused) as refused:
        export(folder, tmp_path / "q35", "qwen3_5")
    assert "\n" not in str(refused.value) and "'llama'" in str(refused.value) and "QK-norm" in str(refused.value)
    with pytest.raises(SystemExit) as exited:
        export_main([str(folder), str(tmp_path / "q35"), "--format", "qwen3_5"])
    assert exited.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "q35").exists()


def test_source_that_is_not_a_student_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ExportRefused, match="no student there"):
        export(tmp_path / "run", tmp_path / "out", "tcal")


def snapshot(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def run_folder(students, tmp_path):
    """A run folder as `tcal` leaves it: its student (saved by the run), record, checkpoints and logs."""
    import shutil

    from conftest import example_record

    _, folder = students["llama"]
    run = tmp_path / "run"
    shutil.copytree(folder, run / "student")
    (run / "results.json").write_text(json.dumps(example_record("complete", student_path=str(run / "student"))))
    (run / "checkpoints" / "distill").mkdir(parents=True)
    (run / "checkpoints" / "distill" / "last.ckpt").write_bytes(b"a checkpoint")
    (run / "logs").mkdir()
    (run / "logs" / "metrics.csv").write_text("step\n0\n")
    return run


@pytest.mark.parametrize("source,dest,match", [
    ("run", "run/student", r"run/student is the student it exports"),
    ("run/student", "run/student", r"run/student is the student it exports"),
    ("run", "run/hf", r"run/hf is inside SOURCE"),
    ("run/student", "run/student/hf", r"run/student/hf is inside the student it exports"),
    ("run/student", "run", r"run holds the student it exports"),
    ("other", "run", r"run is the run folder .*run: an export never writes into a run's"),
    ("other", "run/student", r"run/student is .*run/student, a part of the run"),
    ("other", "run/checkpoints/align", r"run/checkpoints/align is .*run/checkpoints, a part of the run"),
    ("other", "run/logs/hf", r"run/logs/hf is .*run/logs, a part of the run"),
    ("other", "saved", r"saved holds a student tcal saved \(no tcal_export.json: not an earlier tcal-export\)"),
], ids=lambda value: value if isinstance(value, str) and "/" not in value[:3] else None)
def test_an_export_never_writes_into_its_source_or_a_run_s_own_folders(source, dest, match, run_folder, students):
    """An export's DEST is refused before any work, and nothing changes, when it is the source (or inside or above
    it), a run folder or what a run holds of its own, or a student tcal saved; the run still exports afterwards."""
    root = run_folder.parent
    export_student(students["llama"][0], None, root / "other")
    export_student(students["llama"][0], None, root / "saved")
    before = snapshot(root)
    with pytest.raises(ExportRefused, match=match) as refused:
        export(root / source, root / dest, "hf")
    assert "\n" not in str(refused.value) and snapshot(root) == before
    assert export(run_folder, root / "exported", "tcal")["parity"]["passed"]


def test_tcal_export_into_the_run_s_own_student_is_one_line_and_keeps_it(run_folder, tmp_path, capsys):
    before = snapshot(run_folder)
    with pytest.raises(SystemExit) as exited:
        export_main([str(run_folder), str(run_folder / "student"), "--format", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "is the student it exports" in err[0], err
    assert snapshot(run_folder) == before
    assert export_main([str(run_folder), str(tmp_path / "hf"), "--format", "hf"]) == 0


@pytest.mark.parametrize("damage,named", [
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:1000]),
     "model.safetensors: the student's weights cannot be read"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header"),
     "model.safetensors: the student's weights cannot be read"),
    (lambda f: (f / "model.safetensors").unlink(), "the student's weights cannot be read"),
    (lambda f: (f / "config.json").write_text("{not json"), "config.json cannot be read (JSONDecodeError"),
], ids=["truncated", "not_safetensors", "missing", "config_not_json"])
def test_a_damaged_source_is_one_line_naming_the_file(damage, named, students, tmp_path, capsys):
    import shutil

    _, folder = students["llama"]
    source = shutil.copytree(folder, tmp_path / "student")
    damage(source)
    with pytest.raises(SystemExit) as exited:
        export_main([str(source), str(tmp_path / "out"), "--format", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and named in err[0], err
    assert "Traceback" not in err[0] and not (tmp_path / "out").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc: a folder no user can write in")
def test_a_dest_that_cannot_be_written_is_one_line_before_any_work(students, tmp_path, capsys, monkeypatch):
    _, folder = students["llama"]
    with pytest.raises(SystemExit) as exited:
        export_main([str(folder), "/proc/tcal-export/hf", "--format", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "/proc/tcal-export/hf cannot be written" in err[0], err
    from tcal.store import files

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_manifest", disk_full)  # a write refused midway, after the check passed
    assert export_main([str(folder), str(tmp_path / "full"), "--format", "tcal"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"tcal-export: cannot write {tmp_path / 'full'}: No space left on device (ENOSPC)")
    assert not (tmp_path / "full").exists()


@pytest.mark.parametrize("flags,named", [
    (["--tolerance", "nan"], "argument --tolerance: 'nan'"),
    (["--tolerance", "-0.5"], "argument --tolerance: '-0.5'"),
    (["--tolerance", "inf"], "argument --tolerance: 'inf'"),
    (["--serve-python", "/no/such/python"], "--serve-python /no/such/python: not an executable file"),
], ids=["nan", "negative", "inf", "serve_python_missing"])
def test_arguments_that_cannot_mean_anything_are_one_line_before_any_work(flags, named, students, tmp_path, capsys,
                                                                          monkeypatch):
    """A tolerance that is NaN, negative or infinite (once: the whole export ran, then "does not reproduce the
    student"), or a --serve-python that is not there: one line, exit code 2, the student never loaded."""
    from tcal.export import write

    def loaded(*args, **kwargs):
        raise AssertionError("the student was loaded")

    monkeypatch.setattr(write, "load_student", loaded)
    _, folder = students["llama"]
    with pytest.raises(SystemExit) as exited:
        export_main([str(folder), str(tmp_path / "out"), "--format", "vllm", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and named in err[-1] and "Traceback" not in "\n".join(err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["earlier_export", "not_made_yet"])
def test_a_dest_spelled_through_a_symlink_is_exported_through_it(target, students, tmp_path, capsys):
    """DEST a symbolic link to an earlier export (once: the whole export ran, then the replace failed and left an
    empty `.old` beside it), or to a folder not made yet: the export replaces the folder the link points at, the
    link stays, and nothing else is left beside them."""
    _, folder = students["llama"]
    real = tmp_path / "exports" / "v1"
    if target == "earlier_export":
        export(folder, real, "tcal")
    else:
        real.parent.mkdir()
    (tmp_path / "current").symlink_to(Path("exports") / "v1")
    assert export_main([str(folder), str(tmp_path / "current"), "--format", "hf"]) == 0, capsys.readouterr().err
    assert (tmp_path / "current").is_symlink() and (tmp_path / "current").resolve() == real.resolve()
    assert json.loads((real / EXPORT_RECORD).read_text())["format"] == "hf"
    assert (real / REMOTE_CODE.name).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "exports"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]


def test_a_replace_the_filesystem_refuses_leaves_the_earlier_export_and_no_old_folder(students, tmp_path,
                                                                                       monkeypatch):
    """The first rename of a replace (the earlier export moved aside) refused: the earlier export is whole where it
    was and no empty `.old` folder is left beside it."""
    from tcal.store import files

    _, folder = students["llama"]
    export(folder, tmp_path / "hf", "tcal")
    before = snapshot(tmp_path / "hf")
    real_replace = files.os.replace

    def refuse_moving_aside(source, target):
        if str(target).endswith(".old"):
            raise OSError(16, "Device or resource busy")
        return real_replace(source, target)

    monkeypatch.setattr(files.os, "replace", refuse_moving_aside)
    with pytest.raises(OSError, match="Device or resource busy"):
        export(folder, tmp_path / "hf", "hf")
    assert snapshot(tmp_path / "hf") == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def word_tokenizer():
    """A tiny fast tokenizer (whole words of the test vocabulary) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{f"w{i}": i for i in range(60)}, "[UNK]": 60}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[UNK]")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    return tokenizer


@pytest.fixture
def pointing_source(students, tmp_path):
    """A student folder whose configs point beyond what a student's save writes: its tokenizer's `auto_map` names a
    module SOURCE holds (code that raises when run), its config's `auto_map` one it does not, its tokenizer config
    names a data file SOURCE holds, one it does not, and two outside it (`../`, an absolute path); its generation
    defaults sample."""
    student, _ = students["llama"]
    source = export_student(student, word_tokenizer(), tmp_path / "student")
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (tmp_path / "outside.txt").write_text("beside SOURCE, not in it\n")
    tokenizer_config.update({"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]},
                             "extra_vocab_file": "extra_vocab.txt", "merges_file": "gone.txt",
                             "up_file": "../outside.txt", "absolute_file": str(tmp_path / "outside.txt")})
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (source / "tokenization_custom.py").write_text("raise RuntimeError('SOURCE code ran')\n")
    (source / "extra_vocab.txt").write_text("w1\nw2\n")
    config = json.loads((source / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (source / "config.json").write_text(json.dumps(config))
    (source / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7,
                                                               "eos_token_id": 5}))
    return source


@pytest.mark.parametrize("fmt", ["tcal", "hf", "vllm"])
def test_an_export_carries_what_its_configs_name_or_drops_the_pointer(fmt, pointing_source, tmp_path):
    """Every file DEST's configs name is in DEST (once: the tokenizer's `auto_map` named a module the export did not
    carry, so `trust_remote_code=True` could not load it, and the config's named one too): a data file is carried,
    SOURCE's code and a file SOURCE lacks lose their pointer, and DEST loads as its format's users load it, with
    SOURCE's tokenizer, chat template and generation defaults."""
    from transformers import AutoTokenizer, GenerationConfig

    dest = tmp_path / fmt
    record = export(pointing_source, dest, fmt)
    tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
    config = json.loads((dest / "config.json").read_text())
    assert not {"auto_map", "merges_file", "up_file", "absolute_file"} & set(tokenizer_config)
    assert config.get("auto_map") == ({"AutoConfig": "modeling_tcal_hybrid.TcalHybridConfig",
                                       "AutoModelForCausalLM": "modeling_tcal_hybrid.TcalHybridForCausalLM"}
                                      if fmt == "hf" else None)
    assert tokenizer_config["extra_vocab_file"] == "extra_vocab.txt"
    assert (dest / "extra_vocab.txt").read_text() == "w1\nw2\n"
    assert not (dest / "tokenization_custom.py").exists() and not (dest / "modeling_custom.py").exists()
    expected = word_tokenizer()
    loaded = AutoTokenizer.from_pretrained(dest, trust_remote_code=fmt == "hf")
    assert loaded("w3 w7 w59 zz")["input_ids"] == expected("w3 w7 w59 zz")["input_ids"] == [3, 7, 59, 60]
    assert loaded.chat_template == expected.chat_template
    defaults = GenerationConfig.from_pretrained(dest)
    assert (defaults.do_sample, defaults.temperature, defaults.eos_token_id) == (True, 0.7, 5)
    dropped = {(d["config"], d["key"]) for d in record["companions"]["dropped"]}
    assert {("tokenizer_config.json", key) for key in ("auto_map.AutoTokenizer", "merges_file", "up_file",
                                                       "absolute_file")} <= dropped
    assert sorted(p.name for p in dest.iterdir() if p.suffix == ".txt") == ["extra_vocab.txt"]
    assert record["loads"]["checked"] == ["tokenizer", "chat_template", "generation_config"]


def test_an_export_whose_configs_name_a_file_it_lacks_is_not_written(pointing_source, tmp_path, monkeypatch):
    """The check itself: with nothing carried nor dropped, DEST's configs name files it lacks, and nothing is
    written."""
    from tcal.export.formats import ExportFormat

    monkeypatch.setattr(ExportFormat, "carry", lambda self, source, folder: {})
    with pytest.raises(ParityFailed, match=r"configs name files it does not hold: .*tokenization_custom\.py"):
        export(pointing_source, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()


def test_an_export_killed_between_its_renames_through_a_link_is_put_back_and_replaced(students, tmp_path):
    """An export through a link killed after it moved the earlier export aside (`.old`, its writer dead) and before
    the new one took its place: the next export through the link puts the earlier one back, then replaces it; the
    link stays a link and nothing is left beside the folder."""
    import socket
    import subprocess
    import sys

    _, folder = students["llama"]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    exports = tmp_path / "exports"
    export(folder, exports / f".v1.tcal-{socket.gethostname()}-{dead.pid}-abc123.old", "tcal")
    (tmp_path / "current").symlink_to(exports / "v1")
    assert export(folder, tmp_path / "current", "hf")["parity"]["passed"]
    assert (tmp_path / "current").is_symlink() and (exports / "v1" / REMOTE_CODE.name).is_file()
    assert sorted(p.name for p in exports.iterdir()) == ["v1"]


def test_a_dest_that_is_a_link_loop_is_one_line_before_any_work(students, tmp_path, capsys):
    _, folder = students["llama"]
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(SystemExit) as exited:
        export_main([str(folder), str(tmp_path / "a"), "--format", "tcal"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "is a symbolic link that cannot be followed" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
