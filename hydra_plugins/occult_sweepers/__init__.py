"""occult-bench Hydra plugins (found by Hydra in the hydra_plugins namespace package)."""
