"""Errors of a Hugging Face checkpoint that ppojax cannot load as given (the user's input, not a ppojax bug)."""


class ModelLoadError(ValueError):
    """A checkpoint directory or `config.json` that cannot be loaded; the message names the file, the value and
    what is expected."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture or options ppojax does not implement (loading it would diverge from
    transformers, so it is refused)."""
