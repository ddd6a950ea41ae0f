"""Integrations with model libraries; each subpackage needs its library (e.g. ``cpvlm[hf]``)."""
