"""Bridges from model libraries to vidattn's ops.

Each submodule imports its library only when it is used, so ``import vidattn`` (and ``import
vidattn.integrations``) work without any of them installed:

- ``vidattn.integrations.diffusers``: ``enable(model, mode="dense" | "vsa")`` and
  ``disable(model)`` for diffusers' ``WanTransformer3DModel``.
"""
from __future__ import annotations

__all__ = ["diffusers"]


def __getattr__(name):
    # Lazy: ``vidattn.integrations.diffusers`` is importable by attribute access without
    # importing it (and so diffusers' absence costing nothing) until someone asks for it.
    if name == "diffusers":
        import importlib

        return importlib.import_module(f"{__name__}.diffusers")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
