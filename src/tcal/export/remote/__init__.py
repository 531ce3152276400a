"""Code shipped inside exported checkpoints (copied, never imported by tcal): `modeling_tcal_hybrid.py` is the `hf`
format's modeling file. A package so that installs of tcal carry it."""
