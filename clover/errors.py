"""Errors every layer may raise. `UserError`: a mistake in what the user asked for (a missing model
folder, a bad option); the CLI reports it as one line on stderr with exit code 2, the API lets it
propagate. Its home is here so that the library (api.py, loaders) need not import the CLI."""


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line, exit code 2."""
