"""Memory of PromptRL's refiner LM per process, from its published architecture.

The LM is replicated on every process (``diffrl.training.refiner_update``). Its parts:

* its weights in ``refiner.dtype`` (a vision-language refiner's vision tower included:
  it is loaded, though never run on text);
* what trains: LoRA on every linear layer of the language model, ``r (d_in + d_out)``
  weights each, or every weight (``refiner.lora_rank: 0``, as UniRL trains it) with a
  frozen reference copy in ``refiner.dtype``; 16 bytes per trained weight (fp32 weight,
  gradient and AdamW's two moments);
* the training forward's saved activations, 34 bytes per token, hidden unit and layer
  for 16-bit training without recomputation (Korthikanti et al. 2022, Sec. 4.1, attention
  scores left out as a fused attention kernel keeps none), plus the fp32 logits and
  their log-softmax over the vocabulary;
* the generation's key-value cache for one group of rewrites.

Each sequence is counted at ``PROMPT_TOKENS`` of request plus ``refiner.max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_TOKENS = 128  # PromptRL's request and a GenEval / Pick-a-Pic prompt, tokenized


@dataclass(frozen=True)
class LmArch:
    params: float  # every weight the checkpoint loads
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def lora_params(self, rank: int) -> float:
        """LoRA weights on the language model's seven projections per layer."""
        head = self.hidden // self.heads
        kv = self.kv_heads * head
        widths = [
            (self.hidden, self.hidden),  # q
            (self.hidden, kv),  # k
            (self.hidden, kv),  # v
            (self.hidden, self.hidden),  # o
            (self.hidden, self.intermediate),  # gate
            (self.hidden, self.intermediate),  # up
            (self.intermediate, self.hidden),  # down
        ]
        return rank * self.layers * sum(a + b for a, b in widths)


# published configurations (the models' config.json); Qwen2.5-VL-3B-Instruct is
# PromptRL's refiner (G-U-N/UniRL), its language model is Qwen2.5-3B's
LM_ARCH = {
    "Qwen/Qwen2.5-VL-3B-Instruct": LmArch(3.75e9, 2048, 11008, 36, 16, 2, 151936),
    "Qwen/Qwen2.5-3B-Instruct": LmArch(3.09e9, 2048, 11008, 36, 16, 2, 151936),
    "Qwen/Qwen2.5-1.5B-Instruct": LmArch(1.54e9, 1536, 8960, 28, 12, 2, 151936),
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def refiner_bytes(cfg) -> dict[str, float]:
    """Bytes per process by part for ``cfg.refiner`` (empty without a refiner); a model not
    in :data:`LM_ARCH` is refused with the names that are."""
    r = cfg.refiner
    if r.model is None:
        return {}
    arch = LM_ARCH.get(r.model)
    if arch is None:
        raise ValueError(
            f"no published architecture for refiner.model '{r.model}' in diffrl.perf.refiner_memory.LM_ARCH "
            f"({', '.join(LM_ARCH)}); add its config's numbers there to estimate it"
        )
    weight = _DTYPE_BYTES[r.dtype]
    trained = arch.lora_params(r.lora_rank) if r.lora_rank else arch.params
    tokens = cfg.train.micro_batch_size * (PROMPT_TOKENS + r.max_new_tokens)
    head = arch.hidden // arch.heads
    kv_cache = (
        2 * arch.layers * arch.kv_heads * head * (PROMPT_TOKENS + r.max_new_tokens) * cfg.rollout.group_size
    )
    return {
        "refiner LM (frozen)": arch.params * weight,
        "refiner trained + grads + AdamW": 16 * trained,
        "refiner reference copy": 0.0 if r.lora_rank else arch.params * weight,
        "refiner activations": 34 * tokens * arch.hidden * arch.layers + 2 * 4 * tokens * arch.vocab,
        "refiner KV cache": kv_cache * weight,
    }
