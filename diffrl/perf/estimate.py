"""Size a config at full size without its weights or a GPU: FLOPs and memory per process.

The config's published architecture (``assets/arch``) is built on the meta device with
the config's LoRA, and torch counts what one iteration executes:

* forward FLOPs per sample and denoising step (classifier-free guidance included), so
  a rollout's FLOPs are this times the plan's NFE;
* training FLOPs per sample (policy forward + backward, with CFG when
  ``objective.train_cfg``, and gradient checkpointing's recompute when enabled);
* activations saved for backward per micro-batch (:mod:`diffrl.perf.memory`); with
  gradient checkpointing, one block's full activations are added for its recompute.

Memory adds the frozen weights (transformer, VAE, the published text encoders, the
reward models), the trainable weights with their gradients and AdamW's two moments (fp32
master weights for LoRA and full fine-tunes alike: 16 bytes per trainable parameter),
a full fine-tune's frozen reference copy, the exploration copy
(FP8 through torchao stores 1 byte per weight; NVFP4 off Blackwell is simulated over a
BF16 copy, 2 bytes), the EMA and DiffusionNFT's old policy (fp32 shadows of the trainable
weights), the trajectory buffer and a Sol-RL exploration pool (its decoded images until
they are scored, and a tree pool's layout; Sol-RL, "FP4 Explore, BF16 Train", Sec. 3).
The pool and the activations are never alive together (the pool is freed before the
regeneration): summing both is an upper bound, and :data:`TRANSIENT_PARTS` names what is
gone when the optimizer steps. VAE-decode and attention transients are not modelled: a
measured peak (``train.py --full-size`` on a GPU) supersedes this.

Sharding (``sharding="fsdp"``, FSDP's FULL_SHARD as accelerate's FSDP2 applies it, one
unit per transformer block): every process keeps 1/N of the transformer's weights
(frozen and trainable), of the gradients and AdamW moments, of the frozen reference copy
and of the EMA / old-policy shadows. It adds what FSDP gathers: the weights of the unit
being computed and of the one prefetched next (two of the largest block, in the weights'
dtype), and during backward that unit's unsharded gradient before its reduce-scatter.
The VAE, the text encoders, the rewards and the exploration copy stay whole on every
process (they run outside the sharded module), and so do activations.
"""

from __future__ import annotations

import re

import torch

from diffrl.config import with_overrides
from diffrl.models.arch import RANDOM_PREFIX, arch_for
from diffrl.perf.flops import benchmark_prompts, count_flops, train_step_fn, velocity_fn
from diffrl.perf.memory import GIB, buffer_bytes, module_bytes, param_bytes, saved_activation_bytes
from diffrl.perf.refiner_memory import refiner_bytes

# open_clip architecture behind each model reward (HPSv2/PickScore: ViT-H-14; CLIPScore and
# the LAION aesthetic head: ViT-L-14); ImageReward is BLIP ViT-L + a BERT-base text tower.
REWARD_ARCH = {
    "hpsv2": "ViT-H-14",
    "hpsv21": "ViT-H-14",
    "pickscore": "ViT-H-14",
    "clipscore": "ViT-L-14",
    "aesthetic": "ViT-L-14",
    "temporal_consistency": "ViT-L-14",
}
IMAGEREWARD_PARAMS = 447e6
# rewards whose models are not open_clip ones, by their published parameter counts: GenEval's
# Mask2Former Swin-S (69M) and CLIP ViT-L/14 colour classifier (428M); OCR's TrOCR-base
# (334M; the PaddleOCR engine runs in Paddle's own memory, a few tens of MB, not counted);
# VideoAlign's Qwen2-VL-2B with its reward head (2.21B)
OTHER_REWARD_PARAMS = {"geneval": 69e6 + 428e6, "ocr": 334e6, "videoalign": 2.21e9}
# per transformer weight, on Hopper: auto is FP8 through torchao there (one byte), NVFP4
# is simulated over BF16 weights (modelopt or the reference quantizer)
EXPLORATION_BYTES = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 2.0, "auto": 1.0}
# torchao's NVFP4 on Blackwell: half a byte per weight and an E4M3 scale per 16
NVFP4_PACKED_BYTES = 0.5 + 1 / 16
POOL = "exploration pool"
FP8_TRAINING = "FP8 training: weights kept for backward"
# bytes per quantized weight the unified FP8 flow's training forward keeps for its backward,
# by (backend, LoRA): torchao's GEMM keeps its high-precision weight operand, for LoRA the
# merged W + BA (a new bf16 tensor per layer), for a full fine-tune the master weight itself
# (nothing new); the reference keeps FP8 codes (one byte) in both cases
FP8_TRAINING_BYTES = {
    ("torchao", True): 2.0,
    ("torchao", False): 0.0,
    ("reference", True): 1.0,
    ("reference", False): 1.0,
}
# parts not alive when the optimizer steps: activations and the FP8 flow's kept weights
# (freed by the backward pass) and the Sol-RL pool (freed once scored, before the regeneration)
TRANSIENT_PARTS = ("activations", POOL, FP8_TRAINING, "refiner activations", "refiner KV cache")


_BLOCK_PREFIX = re.compile(r"^(.*?blocks)\.\d+\.")


def fp8_training_bytes(cfg, transformer: torch.nn.Module, lora: bool) -> float:
    """What the unified FP8 flow (``precision.train: fp8``) keeps for the backward beyond
    BF16 training: :data:`FP8_TRAINING_BYTES` per weight of every layer it quantizes, whole
    on every process (FSDP shards parameters, not the merged weights a forward makes).
    ``backend: auto`` is counted as torchao (what it is on Hopper). The activations its
    GEMMs keep in FP8 instead of BF16 are not subtracted: an upper bound."""
    p = cfg.precision
    if p.train != "fp8":
        return 0.0
    from diffrl.precision.fp8_flow import flow_keep_high, quantized_layers

    quantized, _ = quantized_layers(transformer, flow_keep_high(p, cfg.model.family))
    backend = "reference" if p.backend == "reference" else "torchao"
    by_block: dict[str, int] = {}  # weights per transformer block ("" : outside the blocks)
    for name in quantized:
        layer = transformer.get_submodule(name)
        block = _BLOCK_PREFIX.match(name)
        key = block.group(0) if block else ""
        by_block[key] = by_block.get(key, 0) + getattr(layer, "base_layer", layer).weight.numel()
    outside = by_block.pop("", 0)
    # gradient checkpointing recomputes a block's forward in its backward: only the block
    # being recomputed keeps its weights, not all of them
    inside = max(by_block.values(), default=0) if cfg.model.gradient_checkpointing else sum(by_block.values())
    weights = outside + inside
    return weights * FP8_TRAINING_BYTES[(backend, lora)]


def reward_params(spec) -> float:
    """Parameters of one configured reward (a video wrapper counts its inner reward)."""
    name, args = spec.name, dict(spec.args)
    if name == "video_frames":
        name = args.get("reward", "jpeg_compressibility")
    if name == "imagereward":
        return IMAGEREWARD_PARAMS
    if name == "ocr" and args.get("engine") == "paddleocr":
        return 0.0
    if name in OTHER_REWARD_PARAMS:
        return OTHER_REWARD_PARAMS[name]
    if name not in REWARD_ARCH:
        return 0.0  # weight-free (jpeg, shapeworld)
    import open_clip
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = open_clip.create_model(REWARD_ARCH[name], pretrained=None, device="meta")
    return float(sum(p.numel() for p in model.parameters()))


def _one_forward_model(transformer: torch.nn.Module) -> torch.nn.Module:
    """The model one forward runs: one expert of a routed pair (Wan2.2's ``TwoExperts``:
    same architecture, one of them per sample), else the transformer itself."""
    experts = getattr(transformer, "experts", None)
    return experts[0] if experts else transformer


def _block_count(transformer: torch.nn.Module) -> int:
    model = _one_forward_model(transformer)
    return sum(
        len(m) for n, m in model.named_children() if isinstance(m, torch.nn.ModuleList) and "block" in n
    )


SHARDINGS = ("none", "fsdp")


def _largest_block_bytes(transformer: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter bytes of the largest transformer block: FSDP's unit."""
    blocks = [
        block
        for name, blocks in _one_forward_model(transformer).named_children()
        if isinstance(blocks, torch.nn.ModuleList) and "block" in name
        for block in blocks
    ]
    if not blocks:  # not block-structured: the whole transformer is one unit
        return param_bytes(transformer), param_bytes(transformer, trainable=True)
    largest = max(blocks, key=param_bytes)
    return param_bytes(largest), param_bytes(largest, trainable=True)


def _memory_parts(
    cfg,
    adapter,
    policy,
    text_encoder_bytes: float,
    num_processes: int,
    sharding: str,
    reward_bytes: float,
    exploration_bytes: dict[str, float] = EXPLORATION_BYTES,
) -> dict[str, float]:
    """Per-process bytes by part (see the module docstring); ``exploration_bytes`` is what
    the exploration copy stores per transformer weight, by precision."""
    from diffrl.algorithms import get_objective

    transformer = adapter.transformer
    shard = num_processes if sharding == "fsdp" else 1
    trainable_bytes = param_bytes(transformer, trainable=True)
    fp32_trainable = 4 * sum(p.numel() for p in policy.trainable_parameters())
    shadows = (cfg.train.ema_decay > 0) + get_objective(cfg.objective.name).needs_old_policy
    reference = param_bytes(policy.frozen_reference) if policy.frozen_reference is not None else 0
    total = sum(p.numel() for p in transformer.parameters())
    buffers = buffer_bytes(transformer)  # whole on every process, in every copy
    parts = {
        "transformer (frozen)": param_bytes(transformer, trainable=False) / shard + buffers,
        "VAE": module_bytes(getattr(adapter.pipe, "vae", None)),  # a pixel-space toy has none
        "text encoders": text_encoder_bytes,
        "rewards": reward_bytes,
        "trainable + grads + AdamW": 4 * trainable_bytes / shard,  # weights, grads, two moments
        "reference copy": reference / shard + (buffers if reference else 0),
        "EMA / old policy": shadows * fp32_trainable / shard,
        "exploration copy": (
            total * exploration_bytes[cfg.solrl.precision] + buffers if cfg.solrl.enabled else 0.0
        ),
        FP8_TRAINING: fp8_training_bytes(cfg, transformer, policy.is_lora),
    }
    if sharding == "fsdp":
        unit, unit_trainable = _largest_block_bytes(transformer)
        parts["FSDP gathered units"] = 2 * unit + unit_trainable  # current + prefetched, unit grads
    return parts


def _train_flops(cfg, adapter, guidance: bool) -> int:
    """One sample's training forward and backward. Through the unified FP8 flow
    (``precision.train: fp8``) it is counted with the flow on: LoRA trains through the
    merged weight W + s B A there, so each quantized layer's backward computes a full-size
    weight-gradient GEMM, Q_g(g)^T Q_a(x), that a plain LoRA step skips (about 3x the
    forward instead of 2x: a ceiling of about 1.33x on the FP8 training speed-up over BF16
    LoRA, issue 61)."""
    step = train_step_fn(adapter, 1, guidance)
    if cfg.precision.train != "fp8":
        return count_flops(step)
    from diffrl.precision.fp8_flow import Fp8Flow, flow_keep_high

    keep = flow_keep_high(cfg.precision, cfg.model.family)
    flow = Fp8Flow(adapter.transformer, True, True, cfg.precision.scaling, "reference", keep)
    with flow.phase("train"):
        return count_flops(step)


def _unsharded_parts(cfg, plan: dict, activations: float) -> dict[str, float]:
    """What every process holds whole whatever the sharding: activations, the trajectory
    buffer, a Sol-RL pool and PromptRL's refiner LM."""
    return {
        "activations": activations,
        "trajectory buffer": plan["trajectory_buffer_mib_per_process"] * 2**20,
        POOL: plan.get("solrl_pool_mib_per_process", 0.0) * 2**20,
        **refiner_bytes(cfg),
    }


def estimate_config(cfg, num_processes: int = 8, sharding: str = "none") -> dict:
    """FLOPs and a per-process memory estimate (GiB) for ``cfg`` at full size, with the
    transformer state replicated (``"none"``: DDP) or sharded (``"fsdp"``)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding '{sharding}': use one of {', '.join(SHARDINGS)}")
    from diffrl.models import build_adapter
    from diffrl.models.policy import Policy
    from diffrl.training.plan import derive

    arch = arch_for(cfg.model.pretrained)
    if arch is None:
        raise ValueError(f"no shipped architecture matches '{cfg.model.pretrained}' (assets/arch/*.json)")
    meta_cfg = with_overrides(cfg, [f"model.pretrained={RANDOM_PREFIX}{arch.name}"])
    adapter = build_adapter(meta_cfg.model, device="meta")
    policy = Policy(adapter, meta_cfg.model, seed=cfg.seed)
    transformer = adapter.transformer
    mb = cfg.train.micro_batch_size
    forward = count_flops(velocity_fn(adapter, transformer, 1))
    guidance = cfg.objective.train_cfg
    train = _train_flops(cfg, adapter, guidance)
    activations = saved_activation_bytes(train_step_fn(adapter, mb, guidance))
    if cfg.model.gradient_checkpointing:  # the block being recomputed holds its full activations
        transformer.disable_gradient_checkpointing()
        activations += saved_activation_bytes(train_step_fn(adapter, mb, guidance)) // max(
            _block_count(transformer), 1
        )
    plan = derive(cfg, num_processes)
    shared = _unsharded_parts(cfg, plan, activations)
    # the gold panel stays on the device beside the trained rewards (eval.gold)
    reward_bytes = sum(reward_params(r) for r in [*cfg.rewards, *cfg.eval.gold]) * 4  # fp32 unless configured
    by_sharding = {
        name: {
            **_memory_parts(
                cfg, adapter, policy, arch.text_encoder_params * 2, num_processes, name, reward_bytes
            ),
            **shared,
        }
        for name in SHARDINGS
    }
    parts = by_sharding[sharding]
    total = sum(p.numel() for p in transformer.parameters())
    trainable = sum(p.numel() for p in policy.trainable_parameters())
    gib = {k: v / GIB for k, v in parts.items()}
    nfe = plan["rollout_nfe_per_iteration"] / num_processes
    return {
        "arch": arch.name,
        "params": total - trainable,
        "trainable_params": trainable,
        "forward_tflop_per_sample_step": forward / 1e12,
        "train_tflop_per_sample": train / 1e12,
        "rollout_tflop_per_iteration_per_process": nfe * forward / 1e12,
        "memory_gib": gib,
        "total_gib": sum(gib.values()),
        "total_gib_by_sharding": {k: sum(v.values()) / GIB for k, v in by_sharding.items()},
        "num_processes": num_processes,
        "sharding": sharding,
    }


def estimate_built(
    cfg, adapter, policy, reward_fn=None, num_processes: int = 1, sharding: str = "none"
) -> dict:
    """The same per-process parts (bytes) for a model already built, at whatever size it
    was built (a tiny twin, a mid-size toy, a shrunk full-size run): the text encoders and
    the rewards are counted from their modules instead of the published architecture, the
    activations are measured on the built model, and the exploration copy is sized as the
    backend chosen here stores it (the reference quantizer keeps each dequantized weight in
    the model's dtype; torchao's FP8 stores one byte). What ``scripts/gpu_suite.py`` and
    ``tests/perf/test_estimate_vs_allocation.py`` compare with what a run allocates."""
    from diffrl.training.plan import derive, latent_numel

    vae = getattr(adapter.pipe, "vae", None)
    encoders = sum(module_bytes(m) for m in adapter.frozen_modules() if m is not vae)
    rewards = sum(module_bytes(m) for m in (reward_fn.models if reward_fn is not None else []))
    parts = _memory_parts(
        cfg,
        adapter,
        policy,
        encoders,
        num_processes,
        sharding,
        rewards,
        _built_exploration_bytes(cfg, adapter),
    )
    guidance, mb = cfg.objective.train_cfg, cfg.train.micro_batch_size
    parts["activations"] = saved_activation_bytes(train_step_fn(adapter, mb, guidance))
    plan = derive(cfg, num_processes)
    # the plan sizes latents by the published VAE's downsampling; a twin's may differ
    built_latent = torch.Size(adapter.latent_shape()).numel()
    parts["trajectory buffer"] = (
        plan["trajectory_buffer_mib_per_process"] * 2**20 * built_latent / latent_numel(cfg)
    )
    parts[POOL] = plan.get("solrl_pool_mib_per_process", 0.0) * 2**20  # images at the config's size
    one_sample = adapter.encode_prompts(benchmark_prompts(adapter, 1))  # an edit's prompt carries its image
    per_sample = sum(t.numel() * t.element_size() for t in one_sample.tensors.values())
    parts["rollout conditioning"] = plan["samples_per_process"] * per_sample
    return parts


def _built_exploration_bytes(cfg, adapter) -> dict[str, float]:
    """Bytes per weight of the exploration copy the backend chosen on this device keeps."""
    from diffrl.precision.backends import choose_backend, choose_precision

    element = next(adapter.transformer.parameters()).element_size()
    if not cfg.solrl.enabled:
        return {cfg.solrl.precision: float(element)}
    precision = choose_precision(cfg.solrl.precision)[0]
    backend = choose_backend(precision, cfg.solrl.backend)[0]
    packed = {("fp8", "torchao"): 1.0, ("nvfp4", "torchao"): NVFP4_PACKED_BYTES}
    return {cfg.solrl.precision: packed.get((precision, backend), float(element))}
