"""Every generator, behind one protocol and one registry.

- `registry`: the `Generator` protocol and `KINDS`, which maps a kind to its config dataclass (the one place
  of its defaults) and its class; `make_generator`, `load_generator`, `get_kind`, `saved_kind`;
- the token models: `tokens` (what they share), `ar` (autoregressive, kind "ar"), `masked` (masked discrete
  diffusion, kind "masked");
- `diffusion/`: the paper's Gaussian diffusion model (`GaussianDiffusion`, kind "diffusion");
- baselines: `markov` (order-k Markov chain) and `sdv_par` (SDV's PARSynthesizer, optional).
- `distributed`: what the trained kinds share to train under torchrun (DDP, the ranks' agreements).

Importing this package is light (no torch): the registry imports a kind's module when it is used.
"""

from tracesynth.generators.registry import KINDS, Generator, Kind, get_kind, load_generator, make_generator, saved_kind

__all__ = ["KINDS", "Generator", "Kind", "get_kind", "load_generator", "make_generator", "saved_kind"]
