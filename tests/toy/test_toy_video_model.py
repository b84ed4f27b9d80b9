"""The toy video family (a Wan-class DiT on ShapeWorld clips) and its pretraining."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from diffrl.config import ModelConfig, load_config
from diffrl.models import ModelLoadError, build_adapter
from diffrl.models.toy_video import SHIPPED, ToyVideoPipeline
from diffrl.sampling.rollout import rollout_independent
from tests.helpers import assert_save_and_lora_round_trip

PROMPTS = ["a red circle moving left", "a blue square moving up"]


def tiny_cfg(**kw) -> ModelConfig:
    base = {"family": "toy_video", "pretrained": "tiny", "height": 32, "width": 32, "num_frames": 3}
    return ModelConfig(**{**base, **kw})


def test_wan_classes_and_pixel_clips():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    adapter = build_adapter(tiny_cfg())
    assert isinstance(adapter.pipe.transformer, WanTransformer3DModel)
    assert isinstance(adapter.pipe.text_encoder, UMT5EncoderModel)
    assert isinstance(adapter.pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert adapter.latent_shape() == (3, 3, 32, 32)
    x = torch.linspace(-3, 3, 2 * 3 * 3 * 32 * 32).view(2, 3, 3, 32, 32)
    clips = adapter.decode(x)
    assert clips.shape == (2, 3, 3, 32, 32)  # (B, F, 3, H, W)
    assert torch.equal(clips[:, 1], ((x[:, :, 1] + 1) / 2).clamp(0, 1))


def test_tokenizer_keeps_the_image_ids_and_reads_the_video_words():
    from diffrl.models.toy import word_tokenizer
    from diffrl.models.toy_video import MAX_TOKENS, VIDEO_WORDS

    image, video = word_tokenizer(), word_tokenizer(MAX_TOKENS, extra_words=VIDEO_WORDS)
    assert all(video.get_vocab()[w] == i for w, i in image.get_vocab().items())
    ids = video("a red circle moving down").input_ids  # <bos> 5 words <eos>
    assert video.unk_token_id not in ids and len(ids) == 7
    assert len(video("a red circle moving down", padding="max_length").input_ids) == MAX_TOKENS


def test_adapter_ode_rollout_matches_the_pipeline_sampler():
    """Two code paths: diffrl's rollout (adapter velocity, Wan call) and ToyVideoPipeline.__call__."""
    cfg = load_config(
        "toy_video_flowgrpo",
        ["model.pretrained=tiny", "model.num_frames=3", "model.guidance_scale=2.0"],
    )
    adapter = build_adapter(cfg.model)
    steps = 4
    cond = adapter.encode_prompts(PROMPTS)
    traj = rollout_independent(
        adapter, adapter.transformer, cond, [("k", 0), ("k", 1)], cfg, num_steps=steps, kinds=["ode"] * steps
    )
    clips = adapter.pipe(
        PROMPTS, num_frames=3, num_inference_steps=steps, guidance_scale=2.0, latents=traj.latents[:, 0]
    )
    assert clips.shape == traj.images.shape == (2, 3, 3, 32, 32)
    assert torch.allclose(clips, traj.images, atol=1e-5)


def test_save_pretrained_round_trip_and_lora(tmp_path):
    x = torch.randn(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert_save_and_lora_round_trip(tmp_path, build_adapter, tiny_cfg(), ToyVideoPipeline, x, PROMPTS)


def test_shipped_model_loads_by_name_and_checks_resolution():
    assert (SHIPPED / "model_index.json").is_file()
    assert sum(f.stat().st_size for f in SHIPPED.rglob("*.safetensors")) < 20e6
    adapter = build_adapter(tiny_cfg(pretrained="shapeworld_video", num_frames=5))
    cond = adapter.encode_prompts(PROMPTS[:1])
    v = adapter.velocity(adapter.transformer, torch.zeros(1, 3, 5, 32, 32), torch.tensor([0.5]), cond)
    assert torch.isfinite(v).all()
    with pytest.raises(ModelLoadError, match="set model.height and model.width to 32"):
        build_adapter(tiny_cfg(pretrained="shapeworld_video", height=64, width=64, num_frames=5))
    with pytest.raises(ModelLoadError, match="set model.num_frames to a multiple of 5 \\(it is 3\\)"):
        build_adapter(tiny_cfg(pretrained="shapeworld_video"))


def test_missing_shipped_weights_are_one_error_naming_the_rebuild(tmp_path, monkeypatch):
    import diffrl.models.toy_video as toy_video

    monkeypatch.setattr(toy_video, "SHIPPED", tmp_path / "assets" / "toy_video_model")
    with pytest.raises(
        ModelLoadError, match="restore assets/toy_video_model from git or rebuild it with scripts/"
    ):
        build_adapter(tiny_cfg(pretrained="shapeworld_video"))


def test_caption_noise_sets_that_share_of_clips_and_each_fails_its_caption():
    """The verifier (an independent reader of the frames) fails the moves clause of every
    noisy clip against its caption and passes every clean one."""
    from diffrl.toy.pretrain_video import VideoPretrainConfig, clip_motions, render_clips
    from rewards.shapeworld.video import ShapeWorldVideoVerifier, video_split

    captions = (video_split()[0] * 8)[:400]
    clean = clip_motions(captions, 0.0, random.Random(0))
    assert all(moving == 1 and m.caption() == c for (m, moving), c in zip(clean, captions))
    noisy = clip_motions(captions, 0.4, random.Random(0))
    changed = [i for i, (m, moving) in enumerate(noisy) if moving == 0 or m.caption() != captions[i]]
    assert abs(len(changed) / 400 - 0.4) < 0.1  # binomial sd 0.024
    assert 0 < sum(noisy[i][1] == 0 for i in changed) < len(changed)  # some stand still, some move
    picked = changed[:24] + [i for i in range(400) if i not in changed][:24]
    clips = render_clips([noisy[i] for i in picked], random.Random(1), VideoPretrainConfig())
    scores = ShapeWorldVideoVerifier()((clips.permute(0, 2, 1, 3, 4) + 1) / 2, [captions[i] for i in picked])
    assert scores["shapeworld_video_moves"].tolist() == [0.0] * 24 + [1.0] * 24


def test_pretraining_is_reproducible_from_its_seed_and_continues_from_init(tmp_path):
    from diffrl.toy.pretrain_video import VideoPretrainConfig, pretrain_video

    def run(name, steps, seed=0, **kw):
        out = str(tmp_path / name)
        cfg = VideoPretrainConfig(
            out=out, steps=steps, batch_size=4, eval_every=steps, eval_steps=2, seed=seed, **kw
        )
        log = pretrain_video(cfg, log=lambda *_: None)
        assert [row["step"] for row in log["history"]] == [steps]
        return ToyVideoPipeline.from_pretrained(tmp_path / name).transformer.state_dict()

    first, again, other = run("a", 2), run("b", 2), run("c", 2, seed=1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
    # continued from 'a' with a zero learning rate, the weights stay 'a' exactly
    held = run("d", 1, init=str(tmp_path / "a"), lr=0.0)
    assert all(torch.equal(first[k], held[k]) for k in first)


def test_pretrain_video_script_rejects_bad_arguments_in_one_line(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_toy_video.py"
    spec = importlib.util.spec_from_file_location("pretrain_toy_video", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--resolution", "30", "--out", "/nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("error: --resolution must be a multiple of 8")
    assert script.main(["--frames", "9", "--step-px", "4"]) == 2
    assert "carry an object out of a 32 px frame" in capsys.readouterr().err
    assert script.main(["--caption-noise", "1.0"]) == 2
    assert "--caption-noise must be in [0, 1)" in capsys.readouterr().err
    assert script.main(["--init", "/nonexistent/model"]) == 2
    assert "is not a saved toy video model" in capsys.readouterr().err
    assert script.main(["--sigma-location", "2.5,0", "--sigma-weights", "1"]) == 2
    assert "--sigma-weights as many non-negative weights" in capsys.readouterr().err
    assert script.main(["--frame-patch", "2"]) == 2
    assert "--frames (5) must be a multiple of --frame-patch (2)" in capsys.readouterr().err


def test_clips_render_in_wan_layout():
    from diffrl.toy.pretrain_video import VideoPretrainConfig, clip_motions, render_clips

    motions = clip_motions(["a red circle moving right"], 0.0, random.Random(0))
    clips = render_clips(motions, random.Random(0), VideoPretrainConfig(frames=4))
    assert clips.shape == (1, 3, 4, 32, 32) and clips.min() >= -1 and clips.max() <= 1
    # the red object's centre of mass moves right by step_px per frame
    red = (clips[0, 0] > 0.5) & (clips[0, 1] < 0) & (clips[0, 2] < 0)
    xs = [float(np.nonzero(red[f].numpy())[1].mean()) for f in range(4)]
    assert np.allclose(np.diff(xs), 3.0)


def test_video_config_trains_and_its_control_optimises_only_the_random_reward(tmp_path):
    """One iteration of configs/toy_video_flowgrpo.yaml on the shipped model moves the LoRA
    and logs the video verifier; the control run (docs/BENCHMARKS.md) optimises
    random_control alone while still logging shapeworld_video (weight 0)."""
    from diffrl.training.trainer import Trainer
    from tests.helpers import quick_config

    small = ["train.max_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.at_start=false"]
    small += ["rollout.batch_size=8", "train.micro_batch_size=8", "logging.trackers=[]"]
    control = "rewards=[{name: random_control, weight: 1.0}, {name: shapeworld_video, weight: 0.0}]"
    for name, extra in (("rl", []), ("control", [control])):
        trainer = Trainer(quick_config("toy_video_flowgrpo", tmp_path / name, *small, *extra))
        start = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
        (row,) = [r for r in trainer.fit() if "reward/mean" in r]
        assert any(not torch.equal(a, p) for a, p in zip(start, trainer.policy.trainable_parameters()))
        assert 0.0 <= row["reward/shapeworld_video/mean"] <= 1.0
        optimised = "reward/shapeworld_video/mean" if name == "rl" else "reward/random_control/mean"
        assert row["reward/mean"] == pytest.approx(row[optimised], abs=1e-6)


class _ClipDrawingModel:
    """Stand-in for the toy video pipeline whose x0 prediction from any noise is a clip of
    the caption's motion (or, with ``always``, of that direction whatever the caption says)."""

    def __init__(self, always: str | None = None):
        self.config = type("C", (), {"resolution": 32})()
        self.always = always

    def text_embeddings(self, captions):
        return captions

    def velocity(self, x, sigma, captions):
        import random

        import numpy as np

        from rewards.shapeworld.video import Motion, parse_motion, render_clip

        rnd = random.Random(0)
        motions = [parse_motion(c) for c in captions]
        if self.always:
            motions = [Motion(m.colour, m.shape, self.always) for m in motions]
        clips = np.stack([render_clip(m, rnd, 5, 32, 3) for m in motions])  # (B, F, H, W, 3)
        x0 = torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
        return (x - x0) / sigma.view(-1, 1, 1, 1, 1)

    def __call__(self, captions, num_frames, num_inference_steps, generator):
        """Samples: the predicted clips in [0, 1], (B, F, 3, H, W)."""
        sigma = torch.ones(len(captions))
        x0 = -self.velocity(torch.zeros(len(captions), 3, num_frames, 32, 32), sigma, captions)
        return ((x0 + 1) / 2).permute(0, 2, 1, 3, 4)


def test_sampled_motion_probe_reads_the_direction_of_the_samples():
    from diffrl.toy.motion_probe import sampled_motion

    reads = sampled_motion(_ClipDrawingModel(), seeds=(0, 1))
    assert all(abs(reads[d] - 12.0) < 1e-3 for d in ("left", "right", "up", "down"))
    deaf = sampled_motion(_ClipDrawingModel(always="down"))
    assert abs(deaf["down"] - 12.0) < 1e-3 and abs(deaf["up"] + 12.0) < 1e-3 and abs(deaf["mean"]) < 1e-3


def test_motion_probe_reads_the_direction_from_the_predicted_clip():
    from diffrl.toy.motion_probe import motion_mass

    reads = motion_mass(_ClipDrawingModel())
    # the drawn object travels 3 px x 4 frames along its direction: its centroid by 12 px
    assert all(abs(reads[d] - 12.0) < 1e-3 for d in ("left", "right", "up", "down"))
    deaf = motion_mass(_ClipDrawingModel(always="right"))
    assert abs(deaf["right"] - 12.0) < 1e-3 and abs(deaf["left"] + 12.0) < 1e-3
    assert abs(deaf["up"]) < 1e-3 and abs(deaf["mean"]) < 1e-3  # a deaf model's shifts cancel


def test_the_video_dit_has_no_absolute_position_unlike_the_image_mmdit():
    """Why the image recipe's position stage does not carry over (docs/BENCHMARKS.md, the
    video toy): Wan's DiT encodes position only by RoPE, which is relative, so a constant
    clip gives every token (every patch of every frame) the same output, and no caption
    can put an object at an absolute place from pure noise. SD3's MMDiT adds absolute
    sin-cos position embeddings, so the same test varies by token there."""
    from diffrl.models import tiny
    from diffrl.models.toy import ToyPipeline, build_components
    from diffrl.models.toy_video import build_components as video_components

    with tiny.seeded(0):
        video = ToyVideoPipeline(**video_components())
        image = ToyPipeline(**build_components())
    with torch.no_grad():
        out = video.velocity(
            torch.zeros(1, 3, 5, 32, 32), torch.tensor([0.98]), video.text_embeddings(PROMPTS[:1])
        )
        tokens = out[0].reshape(3, 5, 4, 8, 4, 8).permute(1, 2, 4, 0, 3, 5).reshape(80, -1)
        assert (tokens - tokens[0]).abs().max() < 1e-5
        assert (tokens[0] - tokens[0].mean()).abs().max() > 1e-3  # within a patch it varies
        cond = image.text_embeddings(["a red circle to the left"])
        cond = cond if isinstance(cond, tuple) else (cond,)
        out = image.velocity(torch.zeros(1, 3, 32, 32), torch.tensor([0.98]), *cond)
        patches = out[0].reshape(3, 4, 8, 4, 8).permute(1, 3, 0, 2, 4).reshape(16, -1)
        assert (patches - patches[0]).abs().max() > 1e-3


def test_clip_kinds_caption_what_the_clip_shows():
    """direction clips keep the caption; moving clips drop the direction word but still move
    (the verifier, told the direction, passes them); still clips drop "moving" too and stand
    still. The motion is always the training caption's."""
    from diffrl.toy.pretrain_video import VideoPretrainConfig, clip_motions, kind_captions, render_clips
    from rewards.shapeworld.video import ShapeWorldVideoVerifier

    captions = ["a red circle moving left", "a blue square moving up", "a green triangle moving down"]
    shown, moving = kind_captions(captions, ["direction", "moving", "still"])
    assert shown == ["a red circle moving left", "a blue square moving", "a green triangle"]
    assert moving == [1, 1, 0] and kind_captions([""], ["still"]) == ([""], [0])  # dropped stays ""
    motions = [(m, k * mult) for (m, mult), k in zip(clip_motions(captions, 0.0, random.Random(0)), moving)]
    clips = render_clips(motions, random.Random(0), VideoPretrainConfig())
    scores = ShapeWorldVideoVerifier()((clips.permute(0, 2, 1, 3, 4) + 1) / 2, captions)
    assert scores["shapeworld_video_moves"].tolist() == [1.0, 1.0, 0.0]
    assert scores["shapeworld_video_coherent"].tolist() == [1.0, 1.0, 1.0]


def test_video_curriculum_stages_and_their_errors(tmp_path):
    """Stages switch at their step and carry their own density; a bad stage is one error
    naming the clip kinds; no curriculum is direction clips only."""
    from diffrl.toy.pretrain_video import VideoPretrainConfig, _stages
    from diffrl.toy.recipe import stage_at

    stages = _stages(VideoPretrainConfig(curriculum="0,1,1@10~2.0; 1,1,0", sigma_location="0.5"))
    assert [s.kind_weights for s in stages] == [(0.0, 1.0, 1.0), (1.0, 1.0, 0.0)]
    assert stages[0].density.locations == (2.0,) and stages[1].density.locations == (0.5,)
    assert [stage_at(stages, n) for n in (1, 10, 11, 500)] == [0, 0, 1, 1]
    assert [s.kind_weights for s in _stages(VideoPretrainConfig(curriculum=""))] == [(1.0, 0.0, 0.0)]
    assert [s.steps for s in _stages(VideoPretrainConfig())] == [1000, 1000, None]  # the shipped recipe
    with pytest.raises(ValueError, match="direction, moving, still"):
        _stages(VideoPretrainConfig(curriculum="0,1@10; 1,1,0"))


class _FramewiseModel:
    """x0 prediction = tanh of the noise, frame by frame, or (``tied``) of frame 0's noise
    in every frame: the two ends of frame_coupling."""

    def __init__(self, tied: bool):
        self.config = type("C", (), {"resolution": 32})()
        self.tied = tied

    def text_embeddings(self, captions):
        return captions

    def velocity(self, x, sigma, captions):
        x0 = torch.tanh(x[:, :, :1].expand_as(x) if self.tied else x)
        return (x - x0) / sigma.view(-1, 1, 1, 1, 1)


def test_frame_coupling_separates_tied_from_framewise_predictions():
    from diffrl.toy.motion_probe import frame_coupling

    assert frame_coupling(_FramewiseModel(tied=True)) == pytest.approx(1.0, abs=1e-5)
    assert frame_coupling(_FramewiseModel(tied=False)) == pytest.approx(0.0, abs=1e-6)


def test_tube_patches_roll_out_as_the_pipeline_samples(tmp_path):
    """A model whose tokens span frames (``frame_patch``, as a Wan token spans 4 frames
    through its VAE) loads from a directory and rolls out through diffrl's Wan call
    exactly as its own sampler draws it."""
    from diffrl.models import tiny
    from diffrl.models.toy_video import build_components

    with tiny.seeded(0):
        pipe = ToyVideoPipeline(**build_components(frame_patch=5, head_dim=12))
    assert pipe.transformer.config.patch_size == (5, 8, 8)
    pipe.save_pretrained(tmp_path / "tube")
    overrides = [f"model.pretrained={tmp_path / 'tube'}", "model.num_frames=5", "data.allow_toy_prompts=true"]
    cfg = load_config("toy_video_flowgrpo", overrides)
    adapter = build_adapter(cfg.model)
    cond = adapter.encode_prompts(PROMPTS)
    traj = rollout_independent(adapter, adapter.transformer, cond, [("k", 0), ("k", 1)], cfg, 3, ["ode"] * 3)
    clips = pipe(PROMPTS, num_frames=5, num_inference_steps=3, latents=traj.latents[:, 0])
    assert clips.shape == traj.images.shape == (2, 5, 3, 32, 32)
    assert torch.allclose(clips, traj.images, atol=1e-5)
