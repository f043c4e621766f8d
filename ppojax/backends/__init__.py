"""Backend-specific code, reached from above through one seam (never imported by the models' math)."""
