"""dooly: profile LLM inference operators once, without per-model code, and simulate serving."""

__version__ = "0.1.0"
