"""Documents and their splits, token streams, and synthetic retrieval sequences."""
