"""OpenAI-compatible HTTP server with continuous batching (`clover serve`)."""

from .app import Settings, create_app
from .scheduler import EngineKey, Scheduler

__all__ = ["EngineKey", "Scheduler", "Settings", "create_app"]
