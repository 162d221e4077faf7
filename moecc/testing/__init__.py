"""Test helpers: tiny deterministic Mixture-of-Experts checkpoints and tokenizers."""
