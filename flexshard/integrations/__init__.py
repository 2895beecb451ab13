"""Integrations with training frameworks; each imports its framework, so import them explicitly."""
