"""swiftune: fast, memory-lean fine-tuning of large language models."""

__version__ = "0.1.0"

from . import kernels  # noqa: F401  (kernels are the base layer; cheap to import)
