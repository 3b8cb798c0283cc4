"""Errors every layer of the harness may raise (the bottom of the import order)."""


class ConfigError(ValueError):
    """An impossible configuration, found before any rank starts. Its message is one line
    that names the field and the allowed values."""
