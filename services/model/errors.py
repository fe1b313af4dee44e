"""Errors the model package raises to whoever loads a model (the engine re-exports them)."""


class ModelLoadError(RuntimeError):
    """A model folder is missing a file, has a corrupt one, or names an unsupported model."""
