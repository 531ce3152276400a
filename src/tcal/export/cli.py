"""`tcal-export SOURCE DEST --format {tcal,hf,qwen3_5,vllm,gguf,...}`: the student in a form other software loads.

    tcal-export outputs/run/ exported/ --format vllm --serve-python .venv-serve/bin/python
    tcal-export outputs/run/ exported-gguf/ --format gguf --outtype q8_0 --serve-python .venv-gguf/bin/python

SOURCE is a run folder (its student/) or a student folder. DEST is written whole or not at all: a format that cannot
hold the student exactly, a damaged SOURCE, or a DEST that is the source, a run's own folders or record, or a
folder this user cannot write is refused in one line (exit 2); an export that does not reproduce the student on the
fixed prompts, or a write the filesystem refuses midway, is not written (exit 1). What the check measured is in
DEST/tcal_export.json. The formats are those of `tcal.registry.EXPORT_FORMATS`, a `TCAL_PLUGINS` package's among
them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tcal.arguments import number
from tcal.errors import ConfigError, config_error_exit
from tcal.export.parity import LOGIT_TOLERANCE
from tcal.export.refusal import ParityFailed
from tcal.registry import EXPORT_FORMATS, PluginError

PROGRAM = "tcal-export"


def main(argv: list[str] | None = None) -> int:
    try:
        formats = EXPORT_FORMATS.names()
    except PluginError as err:
        config_error_exit(err, PROGRAM)
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a run folder (its student/) or a student folder")
    parser.add_argument("dest", type=Path, help="the folder to write (new, empty, or an earlier export)")
    parser.add_argument("--format", required=True, choices=formats, dest="fmt")
    parser.add_argument("--tolerance", type=number(at_least=0), default=LOGIT_TOLERANCE,
                        help=f"largest float32 |logit difference| accepted (default {LOGIT_TOLERANCE:g})")
    parser.add_argument("--serve-python", type=Path,
                        help="--format vllm: a Python with vLLM (e.g. .venv-serve/bin/python) that also serves "
                             "the export and checks it under the bf16 rule; --format gguf: a Python with "
                             "llama-cpp-python (e.g. .venv-gguf/bin/python) whose llama.cpp loads it and is compared "
                             "with transformers")
    parser.add_argument("--outtype", help="--format gguf: the weights' type, f32, f16 (default), bf16, q8_0 or q4_0")
    args = parser.parse_args(argv)
    if args.serve_python is not None and not (args.serve_python.is_file() and os.access(args.serve_python, os.X_OK)):
        parser.error(f"--serve-python {args.serve_python}: not an executable file; expected a Python with vLLM "
                     f"(e.g. .venv-serve/bin/python, made by `make serve-check`)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tcal.export.write import export

    try:
        options = {"outtype": args.outtype} if args.outtype is not None else {}
        record = export(args.source, args.dest, args.fmt, args.tolerance, args.serve_python, options)
    except ConfigError as err:
        config_error_exit(err, PROGRAM)
    except (ParityFailed, OSError) as err:  # OSError: the filesystem refused a write midway (WriteFailed)
        print(f"{PROGRAM}: {err}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"dest": str(args.dest), "format": args.fmt, "parity": record["parity"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
