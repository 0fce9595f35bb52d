"""Clover: block-diffusion language models on a hybrid Gated-DeltaNet / gated-attention MoE backbone.

`import clover` is cheap: the public names below are imported on first use (PEP 562), so the
`clover` command answers `--help` and argument mistakes without loading torch or transformers.
The Auto classes (`AutoConfig` / `AutoModel` / `AutoModelForCausalLM`) are registered by
`clover.models` itself, which is imported here at once when transformers is already loaded and
otherwise right after transformers is first imported (see `clover.utils.lazy`), so
`import clover; AutoModel.from_pretrained(clover_folder)` works either way.
"""

from importlib import import_module

from .utils.lazy import after_import

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "CloverCache": "models", "CloverConfig": "models", "CloverForBlockDiffusion": "models", "CloverModel": "models",
    "preset_config": "models", "Generation": "api", "generate": "api", "load": "api", "decide": "decision",
    "generate_json": "structured",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    if not name.startswith("_"):  # `clover.api`, `clover.engine`, ... as after the eager import of old
        try:
            return import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'clover' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _register_auto_classes() -> None:
    try:
        import_module(".models", __name__)  # registers the Auto classes (clover/models/__init__.py)
    except ImportError:  # clover.models is itself mid-import (it registers when it finishes)
        pass


after_import("transformers", _register_auto_classes)
