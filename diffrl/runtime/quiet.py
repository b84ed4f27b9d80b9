"""Third-party start-up lines that a user can do nothing about, filtered by their exact text.

With torchao installed (the ``[torchao]`` extra), importing diffusers imports torchao, and
every command then opens with three lines before its own output: torch's deprecation of
``register_constant`` on Enum subclasses, logged twice by ``torch.utils._pytree`` for
torchao's own enums (torchao's to change), and diffusers' notice that it cannot import
torchao's tensor classes, which concerns loading checkpoints serialized *by* torchao, which
diffrl never does (its FP8 copies are quantized in memory). An error's one line then came
fourth. Each filter drops one message by its text on the logger that emits it; any other
line from those loggers passes.
"""

from __future__ import annotations

import logging

NOISE = {
    "torch.utils._pytree": "is an Enum subclass and is now natively supported by torch.compile",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
}


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_known_noise() -> None:
    """Install the filters (idempotent: a logger gets each filter once)."""
    for name, text in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
            logger.addFilter(_DropMessage(text))
