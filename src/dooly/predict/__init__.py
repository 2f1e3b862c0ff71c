"""The predict layer: per-operator latency models over the profile DB (predictor) and their validation."""
