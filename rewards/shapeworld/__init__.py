"""ShapeWorld: an offline text-to-image task whose ground truth is computable from pixels
(a miniature of GenEval, Ghosh et al. 2023). ``grammar`` defines the prompts and the
train / held-out split, ``render`` draws scenes that satisfy them, ``verifier`` scores
images against prompts (the ``shapeworld`` reward) and ``fidelity`` measures background
damage. The toy model that is aligned on it lives in :mod:`diffrl.toy`."""

from rewards.shapeworld.verifier import (
    Detection,
    ShapeWorldVerifier,
    Verdict,
    breakdown,
    classify_shape,
    connected_components,
    detect,
    verify,
)

__all__ = [
    "Detection",
    "ShapeWorldVerifier",
    "Verdict",
    "breakdown",
    "classify_shape",
    "connected_components",
    "detect",
    "verify",
]
