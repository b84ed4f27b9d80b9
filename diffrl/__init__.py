"""diffrl: online RL alignment for diffusers flow-matching models.

Importing the package is cheap and never touches the network: models and reward
weights load only when a run builds them.
"""

__version__ = "0.1.0"

from diffrl.runtime.quiet import quiet_known_noise as _quiet_known_noise

_quiet_known_noise()  # before any diffusers or torchao import: see diffrl/runtime/quiet.py
