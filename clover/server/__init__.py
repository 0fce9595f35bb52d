"""OpenAI-compatible HTTP server with continuous batching (`clover serve`)."""

from .app import Settings, create_app
from .scheduler import Scheduler

__all__ = ["Scheduler", "Settings", "create_app"]
