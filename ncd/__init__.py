"""ncd: compile neural circuit diagram specs to fused Triton kernels wrapped as PyTorch ops."""

from .cache import CacheError
from .errors import NcdError
from .ir import Program
from .pipeline import FrontEnd, front_end, load_spec


def load(path, cache_dir=None, sizes=None, options=None, config=None):
    """Compile a spec (cached by content hash, size overrides, options and config overrides) and return its op; see
    `ncd.ops.load`."""
    from .ops import load as _load

    return _load(path, cache_dir, sizes, options, config)


__version__ = "0.1.0"

__all__ = ["CacheError", "FrontEnd", "NcdError", "Program", "__version__", "front_end", "load", "load_spec"]
