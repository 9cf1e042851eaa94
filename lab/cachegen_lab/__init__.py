"""The lab: everything that measures the library (quality, benchmarks, reports, plots).

Nothing in the library imports it; it imports the library like any user would.
"""

# The lab's peer codecs become modes of every lab process (cachegen_lab.peers).
from cachegen_lab import peers  # noqa: E402, F401
