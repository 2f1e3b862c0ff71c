"""Baseline generators behind the same fit/sample/save/load interface as the diffusion model."""

from tracesynth.baselines.markov import MarkovChain

__all__ = ["MarkovChain"]
