"""How a prompt is put to the refiner LM and how its rewrite is read back.

* ``promptrl``: PromptRL's request (G-U-N/UniRL@53c28c9 ``unirl/train_geneval.py``, one
  user message, no system prompt; the wording here is ours): rewrite the prompt so that
  an image generator renders every entity, count, colour and position precisely, the
  rewrite between ``<answer>`` and ``</answer>``, through the LM's chat template. The
  rewrite is the last tagged span; an answer without tags is taken whole and earns no
  format reward (UniRL ``qwenflux_inference.py``: the last ``<answer>(.*?)</answer>``
  match, else the stripped text).
* ``plain``: the prompt, the tokenizer's separator, then the rewrite (the ShapeWorld
  refiner, pretrained that way); no format to reward.
"""

from __future__ import annotations

import re

PROMPTRL_INSTRUCTION = (
    "rewrite this image prompt so that an image generator draws it exactly : keep every object , count , "
    "colour and position , and make it more precise and detailed . give only the rewrite between "
    "<answer> and </answer> . prompt :"
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
TEMPLATES = ("promptrl", "plain")


def request(tokenizer, template: str, prompt: str) -> str:
    """The text the LM continues with its rewrite of ``prompt``."""
    if template == "plain":
        return f"{tokenizer.bos_token or ''} {prompt} {tokenizer.sep_token or ':'}".strip()
    message = [{"role": "user", "content": f"{PROMPTRL_INSTRUCTION} {prompt}"}]
    return tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)


def read_answer(template: str, completion: str) -> tuple[str, bool]:
    """(the rewrite, whether it came in the template's format) of a decoded completion."""
    if template == "plain":
        return " ".join(completion.split()), False
    found = _ANSWER.findall(completion)
    if found:
        return " ".join(found[-1].split()), True
    return " ".join(completion.split()), False
