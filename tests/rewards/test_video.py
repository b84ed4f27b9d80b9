"""Video rewards: uniform frame sampling, image rewards over frames (mean / min), CLIP
temporal consistency against an independent cosine, and the VLM extension point."""

import pytest
import torch
import torch.nn.functional as F

import rewards
from rewards.clip_common import normalize, resize_shortest_and_center_crop
from rewards.images import RewardInputError
from rewards.video import VideoVLMReward, uniform_frames


@pytest.mark.parametrize(
    "frames,count,expected",
    [
        (9, 3, [0, 4, 8]),
        (10, 4, [0, 3, 6, 9]),
        (5, 8, [0, 1, 2, 3, 4]),
        (7, 1, [3]),
        (2, 2, [0, 1]),
    ],
)
def test_uniform_frames(frames, count, expected):
    assert uniform_frames(frames, count) == expected


def _clip(b=2, f=9, size=16, seed=0):
    return torch.rand(b, f, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("aggregate", ["mean", "min"])
def test_frame_reward_aggregates_the_image_reward_over_sampled_frames(aggregate):
    video = _clip()
    reward = rewards.build("video_frames", reward="jpeg_compressibility", num_frames=3, aggregate=aggregate)
    out = reward(video, ["a", "b"], {})
    image = rewards.build("jpeg_compressibility")
    per = torch.stack([image(video[:, i], None, {})["jpeg_compressibility"] for i in (0, 4, 8)], 1)
    expected = per.mean(1) if aggregate == "mean" else per.min(1).values
    torch.testing.assert_close(out["video_frames"], expected)
    torch.testing.assert_close(
        torch.cat([reward(video[i : i + 1], ["x"], {})["video_frames"] for i in range(2)]),
        out["video_frames"],
    )  # batch-size invariant


def test_video_rewards_reject_images_and_bad_arguments():
    with pytest.raises(RewardInputError, match="expected \\(B, F, 3, H, W\\)"):
        rewards.build("video_frames")(torch.rand(2, 3, 16, 16), None, {})
    with pytest.raises(ValueError, match="aggregate must be one of"):
        rewards.build("video_frames", aggregate="max")
    with pytest.raises(rewards.UnknownRewardError, match="unknown reward 'hpsv9'"):
        rewards.build("video_frames", reward="hpsv9")


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    path = tmp_path_factory.mktemp("tiny_clip_vision")
    CLIPVisionModelWithProjection(cfg).save_pretrained(path)
    return str(path)


def test_temporal_consistency_is_the_mean_adjacent_cosine(tiny_clip_dir):
    reward = rewards.build("temporal_consistency", pretrained=tiny_clip_dir, num_frames=4)
    still = _clip(f=1).repeat(1, 5, 1, 1, 1)
    torch.testing.assert_close(reward(still)["temporal_consistency"], torch.ones(2))
    video = _clip(f=7, size=40)
    out = reward(video)
    idx = uniform_frames(7, 4)
    # preprocessing is CLIP's (tested against CLIPImageProcessor in test_clip_rewards); the
    # aggregation is checked here with an independent cosine
    pixels = normalize(resize_shortest_and_center_crop(video[:, idx].flatten(0, 1), 32))
    with torch.no_grad():
        emb = reward.model(pixel_values=pixels).image_embeds.reshape(2, 4, -1)
    cos = F.cosine_similarity(emb[:, 1:], emb[:, :-1], dim=-1)
    torch.testing.assert_close(out["temporal_consistency"], cos.mean(1), atol=1e-5, rtol=1e-5)
    assert bool((out["temporal_consistency_min"] <= out["temporal_consistency"] + 1e-6).all())


def test_temporal_consistency_missing_weights_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no directory at"):
        rewards.build("temporal_consistency", pretrained=str(tmp_path / "nope"))


class _MotionVLM(VideoVLMReward):
    """A stand-in VLM: rewards clips whose frames change (a real one would run a model)."""

    name = "motion_vlm"
    num_frames = 3

    def score_videos(self, clips, prompts):
        self.seen = clips.shape
        return {self.name: (clips[:, 1:] - clips[:, :-1]).abs().mean(dim=(1, 2, 3, 4))}


def test_vlm_extension_point_registers_and_samples_frames():
    rewards.register("motion_vlm", "tests.rewards.test_video:_MotionVLM")
    reward = rewards.build("motion_vlm")
    out = reward(_clip(f=9), ["a", "b"], {})
    assert reward.seen == (2, 3, 3, 16, 16) and out["motion_vlm"].shape == (2,)
    with pytest.raises(RewardInputError, match="one prompt per clip"):
        reward(_clip(f=9), ["a"], {})
    with pytest.raises(NotImplementedError, match="must implement score_videos"):
        VideoVLMReward()(_clip(), ["a", "b"], {})


def test_first_frame_scores_frame_zero_only():
    """``frames: first`` gives the inner reward's score of frame 0, whatever the others hold."""
    inner = rewards.build("jpeg_compressibility")
    video = torch.rand(2, 5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    reward = rewards.build("video_frames", reward="jpeg_compressibility", frames="first")
    expected = inner(video[:, 0], ["x", "y"], {})["jpeg_compressibility"]
    torch.testing.assert_close(reward(video, ["x", "y"], {})["video_frames"], expected)
    changed = video.clone()
    changed[:, 1:] = 0.5  # every later frame replaced: the score stays
    torch.testing.assert_close(reward(changed, ["x", "y"], {})["video_frames"], expected)
    with pytest.raises(ValueError, match="frames must be one of"):
        rewards.build("video_frames", frames="last")
