"""lightning-tp: Megatron-class parallelism for unchanged Lightning projects."""

__version__ = "0.1.0"
