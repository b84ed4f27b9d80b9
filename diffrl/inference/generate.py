"""The one generate-and-score loop: every evaluation (in a run and by
``scripts/evaluate.py``), the papers' protocols, the comparison grids and the benchmarks'
samples go through :func:`generate_and_score`.

Each sample is a prompt, a seed and the noise key ``(tag, prompt index, seed)``
(:func:`plan_samples`), sampled with the deterministic ODE sampler (a few-step model under
``sampling.sde_type: consistency`` with consistency sampling, its noise drawn from the
same key), so the same key gives the same image in any of them, whatever else is sampled
beside it. The work is cut into chunks of ``rollout.batch_size`` in plan order and dealt
to the processes in turn (chunk i to process i mod N), each process encoding its prompts,
sampling, decoding and scoring its chunks under the run's autocast and evaluation guidance; the chunk count is
padded to a multiple of N (the padding chunks are sampled and dropped) so that every
process runs the same forwards, as FSDP's sharded forwards require. Every process gets
every sample's scores back, in plan order.

``encode_alone``: each prompt is encoded on its own, so its embedding does not depend on
which prompts shared its batch and a table of N processes is the table of one (the
protocols); otherwise a process encodes all its prompts in one call (an in-run
evaluation: one text-encoder batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from diffrl.sampling.rollout import rollout_independent
from diffrl.sampling.settings import SamplerSettings


@dataclass(frozen=True)
class Sample:
    """One image to generate: prompt ``index`` of its set, ``seed`` and their noise key."""

    index: int
    prompt: str
    seed: int
    key: tuple
    group: str | None = None  # the prompt's group (task tag, category, style), for tables
    # the text the model is conditioned on when it is not ``prompt`` (a paraphrase, a
    # refiner's rewrite); the rewards always judge the image against ``prompt``
    rendered: str | None = None

    @property
    def conditioning_text(self) -> str:
        return self.prompt if self.rendered is None else self.rendered


def plan_samples(prompts: list[str], seeds: list[int], tag: str, groups=None, rendered=None) -> list[Sample]:
    """Every prompt once per seed, prompt-major, with noise keys (tag, prompt index, seed);
    ``rendered[i]`` (optional) is the text prompt i's images are conditioned on instead of
    the prompt itself, which the rewards still judge them against."""
    groups = groups or [None] * len(prompts)
    rendered = rendered or [None] * len(prompts)
    return [
        Sample(i, prompt, seed, (tag, i, seed), group, text)
        for i, (prompt, group, text) in enumerate(zip(prompts, groups, rendered))
        for seed in seeds
    ]


@dataclass(frozen=True)
class GenerationSettings:
    """How samples are drawn: the evaluation's sampler (ODE), its steps and guidance."""

    sampler: SamplerSettings  # SamplerSettings.for_evaluation(): the batch size, the sigma grid
    num_steps: int  # sampling.eval_num_steps, or sampling.num_steps when unset
    guidance_scale: float | None = None  # eval.guidance_scale; None samples with model.guidance_scale

    @classmethod
    def of(cls, cfg) -> GenerationSettings:
        if isinstance(cfg, cls):
            return cfg
        steps = cfg.sampling.eval_num_steps or cfg.sampling.num_steps
        return cls(SamplerSettings.of(cfg).for_evaluation(), steps, cfg.eval.guidance_scale)


@dataclass
class Scored:
    """A generated sample: its scores by name (NaN where a score does not apply), and
    where asked for, its image (C, H, W) or (F, C, H, W) in [0, 1] and thumbnail."""

    sample: Sample
    position: int  # its place in the plan
    scores: dict[str, float]
    image: torch.Tensor | None = None
    thumbnail: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # a measure's tensors (a histogram)


def generate_and_score(
    session,
    samples: list[Sample],
    settings,
    *,
    model=None,
    reward_fn=None,
    encode_alone: bool = False,
    keep_image: Callable[[int], bool] = lambda position: False,
    thumbnail: Callable[[torch.Tensor], torch.Tensor] | None = None,
    measure: Callable[[torch.Tensor], list[dict]] | None = None,
    write_image: Callable[[Sample, torch.Tensor], None] | None = None,
    progress: str | None = None,
) -> list[Scored]:
    """Generate and score ``samples`` (see the module docstring) with ``session``'s adapter
    and ``model`` (default: the session's policy), scored by ``reward_fn`` (default: the
    session's; None-valued scores when the session has none). ``keep_image(position)``
    keeps a sample's image, ``thumbnail`` maps each image to a kept thumbnail, ``measure``
    maps a chunk of images to each one's measurements (floats join its scores under
    ``monitor/``, tensors its ``extras``), and ``write_image(sample, image)`` is called by
    the process that made it (saving it).
    ``progress``: a label for a progress bar over the batches (main process only), so a
    long evaluation is never minutes of silence."""
    s = GenerationSettings.of(settings)
    acc, adapter = session.acc, session.adapter
    model = session.policy.transformer if model is None else model
    reward_fn = session.reward_fn if reward_fn is None else reward_fn
    chunks = dealt_chunks(len(samples), s.sampler.batch_size, acc.process_index, acc.num_processes)
    mine = [i for chunk, _ in chunks for i in chunk]
    done: list[Scored] = []
    with torch.no_grad(), adapter.guidance_scale_as(s.guidance_scale), acc.autocast():
        prompts = [samples[i].conditioning_text for i in mine]
        cond = adapter.encode_prompts(prompts, one_by_one=encode_alone) if prompts else None
    offset = 0
    quiet = progress is None or not acc.is_local_main_process
    bar = tqdm(total=len(samples), desc=progress, unit="sample", leave=False, disable=quiet)
    for chunk, padding in chunks:
        picked = list(range(offset, offset + len(chunk)))
        offset += len(chunk)
        images = _sample(session, model, cond.select(picked), [samples[i] for i in chunk], s)
        bar.update(len(chunk) * acc.num_processes)  # every process's batch of this round
        if padding:
            continue  # sampled so every process runs the same forwards; not this process's work
        scores = _score(reward_fn, images, [samples[i] for i in chunk])
        measured = measure(images) if measure is not None else [{} for _ in chunk]
        for row, i in enumerate(chunk):
            image = images[row]
            if write_image is not None:
                write_image(samples[i], image)
            kept = image.cpu() if keep_image(i) else None
            thumb = thumbnail(image.unsqueeze(0))[0].cpu() if thumbnail is not None else None
            done.append(_scored(samples[i], i, scores[row], measured[row], kept, thumb))
    bar.close()
    return _gathered(acc, done)


def _sample(session, model, cond, chunk: list[Sample], s: GenerationSettings) -> torch.Tensor:
    adapter, acc = session.adapter, session.acc
    keys = [x.key for x in chunk]
    with torch.no_grad(), adapter.guidance_scale_as(s.guidance_scale), acc.autocast():
        traj = rollout_independent(
            adapter,
            model,
            cond,
            keys,
            s.sampler,
            num_steps=s.num_steps,
            kinds=s.sampler.evaluation_kinds(s.num_steps),
        )
    return traj.images


def _scored(sample: Sample, position: int, scores: dict, measured: dict, image, thumb) -> Scored:
    """A sample's record: a measure's floats join its scores as ``monitor/<name>``, its
    tensors its ``extras``."""
    floats = {f"monitor/{k}": v for k, v in measured.items() if not torch.is_tensor(v)}
    extras = {k: v.cpu() for k, v in measured.items() if torch.is_tensor(v)}
    return Scored(sample, position, {**scores, **floats}, image, thumb, extras)


def _score(reward_fn, images, chunk: list[Sample]) -> list[dict[str, float]]:
    if reward_fn is None:
        return [{} for _ in chunk]
    prompts, keys = [x.prompt for x in chunk], [x.key for x in chunk]
    _, _, logs = reward_fn(images, prompts, {"keys": keys})
    return [{name: float(values[row]) for name, values in logs.items()} for row in range(len(chunk))]


def dealt_chunks(n: int, size: int, rank: int, world: int) -> list[tuple[list[int], bool]]:
    """(sample positions, is padding) of the chunks process ``rank`` runs: every
    ``world``-th chunk of ``size`` consecutive samples, the last one repeated as padding
    until every process has as many."""
    chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    padded = [(c, False) for c in chunks]
    padded += [(chunks[-1], True)] * ((-len(chunks)) % world) if chunks else []
    return padded[rank::world]


def _gathered(acc, done: list[Scored]) -> list[Scored]:
    """Every process's samples on every process, in plan order."""
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        done = gather_object(done)
    return sorted(done, key=lambda x: x.position)


def scored_tensor(scored: list[Scored], names: list[str]) -> torch.Tensor:
    """(n, len(names)) of every sample's scores by name, NaN where one is missing."""
    rows = [[x.scores.get(name, float("nan")) for name in names] for x in scored]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(scored), len(names))
