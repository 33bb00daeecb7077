"""lmsys: the systems side of training Transformer language models, as one CLI."""

__version__ = "0.2.0"
