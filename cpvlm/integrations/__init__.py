"""Moved: ``cpvlm.integrations.hf`` is now ``cpvlm.hf`` (a compatibility name, see its module)."""
