"""tracesynth: learn from real kernel traces, generate synthetic ones that keep their invariants."""

from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace

__all__ = ["Trace", "TraceSynthError"]
__version__ = "0.1.0"
