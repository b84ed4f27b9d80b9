"""Tensor preprocessing of the CLIP-family rewards against the official transforms.

HPSv2: ``ResizeMaxSize`` (longest side, centred zero pad) re-implemented with torchvision.
PickScore / CLIPScore / aesthetic: transformers' ``CLIPImageProcessor`` on PIL images.
"""

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TVF
from PIL import Image

from rewards.clip_common import (
    CLIP_MEAN,
    CLIP_STD,
    normalize,
    resize_longest_and_pad,
    resize_shortest_and_center_crop,
)
from rewards.images import to_tensor_batch


def images(n=1, h=40, w=56, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def smooth_pil(h, w, seed):
    """A low-frequency image (what generators produce), as uint8 PIL."""
    low = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    img = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=True)[0]
    return Image.fromarray((img * 255).round().byte().permute(1, 2, 0).numpy())


def test_normalisation_constants_are_openai_clip():
    assert CLIP_MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert CLIP_STD == (0.26862954, 0.26130258, 0.27577711)
    x = torch.ones(1, 3, 2, 2)
    torch.testing.assert_close(
        normalize(x)[0, :, 0, 0], (1 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    )


def test_pad_vs_crop_on_a_wide_image_hand_checked():
    img = torch.ones(1, 3, 112, 224)  # already 224 wide: neither transform resamples it
    padded = resize_longest_and_pad(img, 224)
    assert padded.shape == (1, 3, 224, 224)
    # 112 rows of padding split evenly, zero fill: rows 0-55 and 168-223 black
    assert padded[..., :56, :].abs().max() == 0 and padded[..., 168:, :].abs().max() == 0
    assert torch.equal(padded[..., 56:168, :], img)
    cropped = resize_shortest_and_center_crop(img, 224)  # 112 -> 224 tall, 448 wide, centre 224
    assert cropped.shape == (1, 3, 224, 224)
    torch.testing.assert_close(cropped, torch.ones_like(cropped))


def test_pad_is_centred_with_the_odd_row_at_the_bottom():
    img = torch.arange(221.0).view(1, 1, 221, 1).expand(1, 3, 221, 224) / 221
    out = resize_longest_and_pad(img, 224)  # pad 3 rows: top 3 // 2 = 1, bottom 2
    assert out[..., 0, :].abs().max() == 0 and out[..., 222:, :].abs().max() == 0
    assert torch.equal(out[..., 1:222, :], img)
    # scaled case: 101x200 -> round(101 * 1.12) = 113 rows, pad 111 = 55 top + 56 bottom
    out = resize_longest_and_pad(torch.full((1, 3, 101, 200), 0.5), 224)
    rows = (out[0, 0, :, 100] > 0.25).nonzero().flatten()
    assert (rows.min().item(), rows.max().item(), len(rows)) == (55, 167, 113)


def test_centre_crop_offset_hand_checked():
    cols = torch.arange(231.0).view(1, 1, 1, 231).expand(1, 3, 224, 231)
    out = resize_shortest_and_center_crop(cols, 224)  # int((231 - 224) / 2) = 3
    assert out[0, 0, 0, 0].item() == 3 and out[0, 0, 0, -1].item() == 226


def official_resize_max_size(img: torch.Tensor, max_size: int) -> torch.Tensor:
    """HPSv2's ResizeMaxSize (hpsv2/src/open_clip/transform.py) on a ToTensor'd image, with torchvision."""
    height, width = img.shape[1:]
    scale = max_size / float(max(height, width))
    new_size = tuple(round(dim * scale) for dim in (height, width))
    img = TVF.resize(img, list(new_size), TVF.InterpolationMode.BICUBIC)
    pad_h, pad_w = max_size - new_size[0], max_size - new_size[1]
    return TVF.pad(img, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)


@pytest.mark.parametrize("hw", [(300, 200), (101, 400), (64, 48), (512, 512)])
def test_hps_preprocessing_matches_official_transform(hw):
    img = images(1, *hw, seed=hw[0])
    ref = TVF.normalize(official_resize_max_size(img[0], 224), CLIP_MEAN, CLIP_STD)
    torch.testing.assert_close(normalize(resize_longest_and_pad(img, 224))[0], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("hw", [(300, 200), (101, 400), (64, 48), (230, 224)])
def test_clip_preprocessing_matches_clip_image_processor(hw):
    """Tolerance: the processor rounds the resized image (and PIL its intermediate pass) to
    uint8, while ours stays float for gradients: at most ~1/255 per pixel apart."""
    from transformers import CLIPImageProcessor

    pil = [
        smooth_pil(*hw, seed=hw[1]),
        Image.fromarray((images(1, *hw)[0] * 255).byte().permute(1, 2, 0).numpy()),
    ]
    ours = normalize(resize_shortest_and_center_crop(to_tensor_batch(pil), 224))
    ref = CLIPImageProcessor()(images=pil, return_tensors="pt")["pixel_values"]
    diff = (ours - ref) * torch.tensor(CLIP_STD).view(1, 3, 1, 1)  # back to [0, 1] pixel units
    assert diff.abs().max() <= 1.5 / 255
    assert diff.abs().mean() <= 0.5 / 255
