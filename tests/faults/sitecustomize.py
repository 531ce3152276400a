"""Test-only faults in the processes a test starts: a test puts this folder on PYTHONPATH (Python imports
`sitecustomize` at start-up) and describes one fault in $TCAL_TEST_FAULT, as JSON:

    {"call": "tcal.api:build_student", "rank": 1, "when": {"seed": 1}, "raise": "RuntimeError", "message": "..."}

In the process whose $RANK is `rank` (one of the ranks a job starts; the job's own process has no $RANK), the
function `call` is replaced by one that raises `raise` (a builtin exception or one of `tcal.errors`) with
`message` when its arguments match `when` (argument name, or a dotted path into an argument such as
"cfg.seed", -> value), and otherwise calls the original. With `"nan": true` instead of `raise`, a matching call
returns the original's result with its (first) tensor multiplied by NaN; with `"sleep": seconds`, it waits that
long first (a rank busy alone). $TCAL_TEST_FAULT may also hold a list of faults. Nothing is changed where it is
unset.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import json
import os
import time


def _matches(bound: inspect.BoundArguments, when: dict) -> bool:
    for path, expected in when.items():
        name, *attributes = path.split(".")
        value = bound.arguments[name]
        for attribute in attributes:
            value = getattr(value, attribute)
        if value != expected:
            return False
    return True


def _install(fault: dict) -> None:
    if os.environ.get("RANK") != str(fault["rank"]):
        return
    module_name, function_name = fault["call"].split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, function_name)
    signature = inspect.signature(original)
    errors = importlib.import_module("tcal.errors")
    error = getattr(builtins, fault["raise"], None) or getattr(errors, fault["raise"]) if "raise" in fault else None

    @functools.wraps(original)
    def faulty(*args, **kwargs):
        if not _matches(signature.bind(*args, **kwargs), fault.get("when", {})):
            return original(*args, **kwargs)
        if "sleep" in fault:
            time.sleep(float(fault["sleep"]))
            return original(*args, **kwargs)
        if error is not None:
            raise error(fault["message"])
        result = original(*args, **kwargs)
        if isinstance(result, tuple):
            return (result[0] * float("nan"), *result[1:])
        return result * float("nan")

    setattr(module, function_name, faulty)


if os.environ.get("TCAL_TEST_FAULT"):
    _faults = json.loads(os.environ["TCAL_TEST_FAULT"])
    for _fault in _faults if isinstance(_faults, list) else [_faults]:
        _install(_fault)
