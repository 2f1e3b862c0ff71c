"""The paper's Gaussian diffusion generator: a multi-channel transformer denoising continuous latents.

from tracesynth.generators.diffusion import GaussianDiffusion, GaussianDiffusionConfig
synth = GaussianDiffusion(GaussianDiffusionConfig(context=1024, channels=6, steps=2000)).fit([trace])
synth.save("model/")
GaussianDiffusion.load("model/").sample(100_000, seed=0)
"""

from tracesynth.generators.diffusion.config import GaussianDiffusionConfig
from tracesynth.generators.diffusion.gaussian import GaussianDiffusion
from tracesynth.generators.diffusion.samplers import AncestralSampler, DDIMSampler, make_sampler
from tracesynth.generators.diffusion.schedule import NoiseSchedule

__all__ = [
    "AncestralSampler",
    "DDIMSampler",
    "GaussianDiffusion",
    "GaussianDiffusionConfig",
    "NoiseSchedule",
    "make_sampler",
]
