"""Training stages (docs/method.md, sections "Stage 1: alignment" and "Stage 2: distillation"): data module,
Stage 1 / Stage 2 LightningModules, curves, runner."""
