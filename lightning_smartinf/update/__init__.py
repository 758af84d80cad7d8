"""Updaters: where the optimizer update runs."""
