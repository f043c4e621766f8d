"""Errors of a Hugging Face checkpoint that ppojax cannot load as given (the user's input, not a ppojax bug):
defined in `ppojax.errors`, importable from here."""
from ppojax.errors import ModelLoadError, UnsupportedModelError

__all__ = ["ModelLoadError", "UnsupportedModelError"]
