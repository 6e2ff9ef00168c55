"""dpcc-megatron: dynamic policy calibration (DPCC) for RL post-training on Megatron-Core.

Importing the package has no side effects: the CPU execution layer for tests and
the CPU demo lives in :mod:`dpcc_megatron.testing` and is switched on explicitly.
"""

__version__ = "0.1.0"
