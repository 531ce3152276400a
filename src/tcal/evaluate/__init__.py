"""Perplexity, lm-eval harness and long-context evaluation."""
