"""Baseline generators behind the same Generator protocol as the diffusion model (see tracesynth.generator)."""

from tracesynth.baselines.markov import MarkovChain

__all__ = ["MarkovChain"]
