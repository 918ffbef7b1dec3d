"""The names of the files the engine keeps in a run dir, in a module without torch: the commands
check a run dir (``rafl federate --resume``) before torch loads."""

from __future__ import annotations

#: the engine's checkpoint after each complete round (:class:`rafl.federation.engine.Engine`)
CHECKPOINT = "checkpoint.safetensors"

__all__ = ["CHECKPOINT"]
