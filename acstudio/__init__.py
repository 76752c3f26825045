"""AC Studio: measure a whole PyTorch training step, plan activation checkpointing with mu-TWO, rewrite it."""

__version__ = "0.1.0"
