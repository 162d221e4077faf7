"""moecc: a compiler and runtime for offline batch inference of Mixture-of-Experts models
on one small GPU with a large host memory (module-based batching)."""

__version__ = "0.1.0"
