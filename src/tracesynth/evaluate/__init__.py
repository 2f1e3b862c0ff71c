"""Evaluation harness: splits and windows, the shared classifier, downstream tasks, metrics, experiments."""
