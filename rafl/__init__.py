"""rafl: resource-aware heterogeneous federated learning.

Pipeline (see README): data -> supernet train -> search (per device profile) -> federate -> reports.
"""

__version__ = "0.1.0"

from rafl.errors import RaflError, UserInputError  # noqa: E402,F401
