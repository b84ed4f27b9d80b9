import io

import pytest
import torch
from PIL import Image

import rewards
from rewards.combine import MultiReward
from rewards.images import RewardInputError


def test_registry_lists_jpeg_and_rejects_unknown_with_suggestion():
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(rewards.available())
    with pytest.raises(
        rewards.UnknownRewardError, match="Did you mean 'jpeg_compressibility'.*Valid rewards"
    ):
        rewards.build("jpeg_compresibility")


def test_jpeg_size_matches_pil_encoding():
    torch.manual_seed(0)
    imgs = torch.rand(2, 3, 32, 32)
    out = rewards.build("jpeg_compressibility")(imgs, ["a", "b"], {})
    for i in range(2):
        arr = (imgs[i].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=95)
        assert out["jpeg_size_kb"][i].item() == pytest.approx(buf.tell() / 1000)
    assert torch.equal(out["jpeg_compressibility"], -out["jpeg_size_kb"])
    inc = rewards.build("jpeg_incompressibility")(imgs, ["a", "b"], {})
    assert torch.equal(inc["jpeg_incompressibility"], out["jpeg_size_kb"])


def test_flat_image_more_compressible_than_noise():
    flat, noise = torch.full((1, 3, 64, 64), 0.5), torch.rand(1, 3, 64, 64)
    r = rewards.build("jpeg_compressibility")
    assert r(flat, ["x"], {})["jpeg_compressibility"] > r(noise, ["x"], {})["jpeg_compressibility"]


def test_pil_input_and_video_input_and_batch_invariance():
    r = rewards.build("jpeg_compressibility")
    imgs = torch.rand(3, 3, 16, 16)
    batch = r(imgs, None, {})["jpeg_size_kb"]
    singles = torch.cat([r(imgs[i : i + 1], None, {})["jpeg_size_kb"] for i in range(3)])
    assert torch.equal(batch, singles)
    pil = [Image.fromarray((imgs[i] * 255).round().byte().permute(1, 2, 0).numpy()) for i in range(3)]
    torch.testing.assert_close(r(pil, None, {})["jpeg_size_kb"], batch)
    video = torch.stack([imgs, imgs.flip(0)], dim=1)  # (3, 2, 3, H, W)
    assert r(video, None, {})["jpeg_size_kb"].shape == (3,)


def test_wrong_shape_is_a_clear_error():
    with pytest.raises(RewardInputError, match=r"\(B, 3, H, W\).*got shape \(2, 16, 16\)"):
        rewards.build("jpeg_compressibility")(torch.rand(2, 16, 16), None, {})


def test_multireward_weights_and_components():
    spec = lambda n, w: type("S", (), {"name": n, "weight": w, "args": {}})()  # noqa: E731
    multi = MultiReward([spec("jpeg_compressibility", 2.0), spec("jpeg_incompressibility", 0.5)])
    imgs = torch.rand(2, 3, 16, 16)
    total, comps, logs = multi(imgs, ["a", "b"])
    size = logs["jpeg_size_kb"]
    torch.testing.assert_close(comps, torch.stack([-size, size], 1))
    torch.testing.assert_close(total, -2.0 * size + 0.5 * size)


def test_one_reward_twice_needs_labels_and_logs_each_apart():
    from diffrl.config import RewardSpec

    twice = [
        RewardSpec(name="jpeg_compressibility"),
        RewardSpec(name="jpeg_compressibility", args={"quality": 10}),
    ]
    with pytest.raises(rewards.RewardArgsError, match="distinct `label`"):
        MultiReward(twice)
    twice[1].label = "jpeg_q10"
    multi = MultiReward(twice)
    imgs = torch.rand(2, 3, 16, 16)
    total, comps, logs = multi(imgs, ["a", "b"])
    q95, q10 = (
        rewards.build("jpeg_compressibility")(imgs),
        rewards.build("jpeg_compressibility", quality=10)(imgs),
    )
    torch.testing.assert_close(
        comps, torch.stack([q95["jpeg_compressibility"], q10["jpeg_compressibility"]], 1)
    )
    assert logs["jpeg_size_kb"].equal(q95["jpeg_size_kb"]) and logs["jpeg_q10/jpeg_size_kb"].equal(
        q10["jpeg_size_kb"]
    )
    assert multi.names == ["jpeg_compressibility", "jpeg_q10"] and twice[1].key == "jpeg_q10"


class _DeviceRecorder:
    name = "device_recorder"

    def __init__(self):
        self.device = None

    def to(self, device):
        self.device = device
        return self

    def __call__(self, images, prompts, metadata):
        return {self.name: images.flatten(1).mean(1)}


def test_multireward_moves_model_rewards_to_the_policy_device():
    from diffrl.config import RewardSpec

    rewards.register("device_recorder", "tests.rewards.test_registry_and_jpeg:_DeviceRecorder")
    multi = MultiReward([RewardSpec(name="device_recorder"), RewardSpec(name="jpeg_compressibility")])
    assert multi.to("cpu") is multi
    assert multi.models[0].device == "cpu"  # jpeg has no .to and is left alone
    total, comps, logs = multi(torch.rand(2, 3, 16, 16), ["a", "b"])
    assert comps.shape == (2, 2) and set(logs) >= {"device_recorder", "jpeg_compressibility"}
