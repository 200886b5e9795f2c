"""aionvme's version: a leaf any module may import (the package's
``__init__`` re-exports it; pyproject.toml's version must match)."""

__version__ = "0.1.0"
