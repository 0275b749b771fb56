"""Integrations with other libraries; each module imports its library lazily (optional extras)."""
