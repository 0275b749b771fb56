"""LongNet models (``longnet.py``) and the function that applies sequence parallelism to them
from outside (``parallelize.py``)."""

from .longnet import PRESETS, LongNetConfig, LongNetEncoder, LongNetLM
from .parallelize import parallelize

__all__ = ["PRESETS", "LongNetConfig", "LongNetEncoder", "LongNetLM", "parallelize"]
