"""Serving: :class:`Engine`, continuous batching over a slot pool on device, and its request handles
(:class:`Request`, :class:`Chunk`, :class:`Completion`). The OpenAI-compatible HTTP server is
``python -m sparkjax.serve``."""

from .engine import Chunk, Completion, Engine, Request

__all__ = ["Chunk", "Completion", "Engine", "Request"]
