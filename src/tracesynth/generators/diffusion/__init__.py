"""The multi-channel transformer diffusion generator.

from tracesynth.diffusion import TraceSynth, TraceSynthConfig
synth = TraceSynth(TraceSynthConfig(context=1024, channels=6, steps=2000)).fit([trace])
synth.save("model/")
TraceSynth.load("model/").sample(100_000, seed=0)
"""

from tracesynth.diffusion.config import TraceSynthConfig
from tracesynth.diffusion.samplers import AncestralSampler, DDIMSampler, make_sampler
from tracesynth.diffusion.schedule import NoiseSchedule
from tracesynth.diffusion.synth import TraceSynth

__all__ = ["AncestralSampler", "DDIMSampler", "NoiseSchedule", "TraceSynth", "TraceSynthConfig", "make_sampler"]
