"""Inference: generating text from a trained checkpoint."""
