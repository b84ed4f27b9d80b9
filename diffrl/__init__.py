"""diffrl: online RL alignment for diffusers flow-matching models.

Importing the package is cheap and never touches the network: models and reward
weights load only when a run builds them.
"""

__version__ = "0.1.0"
