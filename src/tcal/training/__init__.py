"""Training stages (DESIGN section 7): data module, Stage 1 / Stage 2 LightningModules, curves, runner."""
