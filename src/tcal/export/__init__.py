"""The student outside tcal: `tcal-export SOURCE DEST --format {tcal,hf,qwen3_5,vllm}` (`tcal.export.cli`); each
format an `ExportFormat` (`tcal.export.formats`) named in `tcal.registry.EXPORT_FORMATS`, where a plugin adds more.

- `tcal`: the hybrid as tcal saves it (`model_type: tcal_hybrid`; loading needs `import tcal`).
- `hf`: the same checkpoint plus its own modeling code (`modeling_tcal_hybrid.py`, torch and transformers only:
  `remote/`'s wrapper with the student's GDN layer, `tcal.student.gdn_torch`, spliced in) and an `auto_map`, loaded
  with `trust_remote_code=True` where tcal is not installed.
- `qwen3_5`: a Qwen3-family student as transformers' and vLLM's stock `Qwen3_5ForCausalLM` (`tcal.export.qwen3_5`).
- `vllm`: the checkpoint of the vLLM plugin shipped with tcal (`tcal.serving`), for every family tcal converts.

Every export is written into a temporary sibling of DEST, reloaded from there, compared with the student on fixed
prompts (`tcal.export.parity`), and moved into place only when the comparison passes (`tcal.export.write`).
"""
