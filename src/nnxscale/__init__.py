"""nnxscale: the library of the book Scaling Flax NNX."""

__version__ = "0.1.0"
