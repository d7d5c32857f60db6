"""ncd: compile neural circuit diagram specs to fused Triton kernels wrapped as PyTorch ops."""

from .errors import NcdError
from .ir import Program
from .pipeline import FrontEnd, front_end, load_spec

__version__ = "0.1.0"

__all__ = ["FrontEnd", "NcdError", "Program", "__version__", "front_end", "load_spec"]
