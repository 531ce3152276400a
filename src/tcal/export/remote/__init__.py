"""Code shipped inside exported checkpoints: the `hf` format's modeling file, `modeling_tcal_hybrid.py`. Its source is
this folder's wrapper (the hybrid's config and causal LM for transformers) and `tcal.student.gdn_torch` (the GDN
layer in torch alone, which tcal's own student runs): `modeling_code` splices the second into the first, so the
shipped file stands without tcal and the GDN maths is written once."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

WRAPPER = Path(__file__).with_name("modeling_tcal_hybrid.py")
SPLICED = "tcal.student.gdn_torch"
FUTURE = "from __future__ import annotations\n"


def modeling_code() -> str:
    """The shipped modeling file's text: WRAPPER with its one line `from tcal.student.gdn_torch import ...` replaced
    by that module's text less its `from __future__` line (the wrapper's own stands at the top)."""
    wrapper = WRAPPER.read_text(encoding="utf-8").splitlines(keepends=True)
    (at,) = [i for i, line in enumerate(wrapper) if line.startswith(f"from {SPLICED} import ")]
    spliced = Path(find_spec(SPLICED).origin).read_text(encoding="utf-8").replace(FUTURE, "", 1)
    return "".join(wrapper[:at]) + spliced + "".join(wrapper[at + 1:])
