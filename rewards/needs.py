"""What each reward reads from disk or the network, without loading it: the preflight's
list (``diffrl-train --preflight``). A need is one of

* ``{"what", "repo", "files"}``: files of a hub repository (fetched into the hub cache);
* ``{"what", "repo", "model": True}``: a transformers model folder on the hub (its
  ``config.json`` and weights);
* ``{"what", "path"}``: a local file or folder the config names;
* ``{"what", "url"}``: a server that must answer (a reward server, a VLM endpoint);
* ``{"what", "path", "download_url"}``: a file the reward downloads from a URL into a
  cache once (the aesthetic head, GenEval's mmdetection detector);
* ``{"what", "python", "fix"}``: a Python package (an optional engine).

The defaults are the rewards' own (their ``default_pretrained`` and hub files).
"""

from __future__ import annotations

import os

from rewards.clip_common import looks_like_hub_id

CLIP_L = "openai/clip-vit-large-patch14"


def _legacy_hub_id(spec: str) -> bool:
    """A hub id from before owners (``bert-base-uncased``), which transformers still
    resolves: no "/", not a local path, not a file name."""
    return (
        "/" not in spec
        and not os.path.exists(os.path.expanduser(spec))
        and not spec.startswith((".", "~"))
        and "." not in spec
    )


def _hub_or_path(what: str, spec: str, filename: str | None = None) -> dict:
    """A hub model (or file of one) or a local path, as the reward itself resolves ``spec``."""
    if looks_like_hub_id(spec) or _legacy_hub_id(spec):
        need = {"what": what, "repo": spec}
        return {**need, "files": [filename]} if filename else {**need, "model": True}
    path = os.path.expanduser(spec)
    if filename and os.path.isdir(path):
        path = os.path.join(path, filename)
    return {"what": what, "path": path}


def _hps(name: str, args: dict) -> list[dict]:
    from rewards.hps import HUB_REPO, RANDOM, HPSv2, HPSv21

    filename = (HPSv21 if name == "hpsv21" else HPSv2).filename
    checkpoint = args.get("checkpoint")
    if checkpoint == RANDOM:
        return []
    return [_hub_or_path(f"{name} checkpoint", checkpoint or HUB_REPO, filename)]


def _imagereward(args: dict) -> list[dict]:
    from rewards.imagereward import HUB_REPO

    checkpoint = str(args.get("checkpoint", HUB_REPO))
    needs = [
        _hub_or_path("imagereward checkpoint", checkpoint, "ImageReward.pt"),
        _hub_or_path("imagereward med_config", checkpoint, "med_config.json"),
    ]
    tokenizer = str(args.get("tokenizer", "bert-base-uncased"))
    needs.append(_hub_or_path("imagereward tokenizer", tokenizer, "vocab.txt"))
    return needs


def _clip_model(name: str, args: dict, default: str) -> list[dict]:
    return [_hub_or_path(f"{name} model", str(args.get("pretrained") or default))]


def _pickscore(args: dict) -> list[dict]:
    from rewards.pickscore import PickScore

    pretrained = str(args.get("pretrained") or PickScore.default_pretrained)
    needs = [_hub_or_path("pickscore model", pretrained)]
    if looks_like_hub_id(pretrained) or args.get("tokenizer"):  # a local folder may hold its own
        tokenizer = str(args.get("tokenizer") or PickScore.default_tokenizer)
        files = ["tokenizer_config.json", "vocab.json", "merges.txt"]
        needs += [_hub_or_path("pickscore tokenizer", tokenizer, f) for f in files]
    return needs


def _aesthetic(args: dict) -> list[dict]:
    from rewards.aesthetic import HEAD_URL

    head = str(args.get("head", HEAD_URL))
    needs = _clip_model("aesthetic", args, CLIP_L)
    if head.startswith(("http://", "https://")):
        needs.append(_download("aesthetic head", head))
    elif head.startswith("hf://"):
        repo, _, filename = head[len("hf://") :].rpartition("/")
        needs.append({"what": "aesthetic head", "repo": repo, "files": [filename]})
    else:
        needs.append({"what": "aesthetic head", "path": os.path.expanduser(head)})
    return needs


def _geneval(args: dict) -> list[dict]:
    from rewards.geneval_mmdet import URL

    detector = str(args.get("detector") or URL)
    if detector == "shapeworld":
        return _clip_model("geneval colours", args, CLIP_L) if args.get("clip") else []
    colours = _clip_model("geneval colours", {"pretrained": args.get("clip")}, CLIP_L)
    if detector.startswith(("http://", "https://")):
        return [_download("geneval detector", detector), *colours]
    return [_hub_or_path("geneval detector", detector), *colours]


def _download(what: str, url: str) -> dict:
    """A file the reward downloads from ``url`` into torch.hub's cache once."""
    from rewards.clip_common import url_file_path

    cached = url_file_path(url)
    return {"what": what, "path": cached, "download_url": url, "fix": f"wget '{url}' -O '{cached}'"}


def _ocr(args: dict) -> list[dict]:
    if args.get("engine") == "paddleocr":
        fix = "pip install 'diffrl[paddleocr]' and a paddlepaddle build"
        return [{"what": "ocr engine", "python": "paddleocr", "fix": fix}]
    needs = _clip_model("ocr", args, "microsoft/trocr-base-printed")
    if args.get("engine") == "trocr_lines":
        needs.append(
            {"what": "ocr line detector", "python": "paddleocr", "fix": "pip install 'diffrl[paddleocr]'"}
        )
    return needs


def _vlm(args: dict) -> list[dict]:
    if args.get("backend") == "openai":
        base = str(args.get("base_url", "http://127.0.0.1:8000/v1")).rstrip("/")
        return [{"what": "vlm_judge server", "url": f"{base}/models"}]
    return _clip_model("vlm_judge", args, "Qwen/Qwen2.5-VL-7B-Instruct")


def _videoalign(args: dict) -> list[dict]:
    """The release (its weights, model_config.json and tokenizer), the Qwen2-VL base whose
    config and processor it is built from (the release's model_config.json names
    Qwen/Qwen2-VL-2B-Instruct; ``base`` overrides it), and the pinned prompt template,
    downloaded once (issue 62, item 4: the last two were not listed)."""
    import hashlib

    from rewards.videoalign import TEMPLATE_URL

    spec = str(args.get("checkpoint") or "KwaiVGI/VideoReward")
    need = _hub_or_path("videoalign checkpoint", spec, "model_config.json")
    if "repo" in need:  # the whole release is read (model_config.json, checkpoint-N/model.pth, tokenizer)
        need["fix"] = f"hf download {spec}   (or --local-dir DIR, then rewards.N.args.checkpoint: DIR)"
    needs = [need]
    base = str(args.get("base") or VIDEOALIGN_BASE)
    if looks_like_hub_id(base):  # its config and processor only: the release carries the weights
        needs.append(
            {"what": "videoalign base config and processor", "repo": base, "files": VIDEOALIGN_BASE_FILES}
        )
    else:
        needs.append(_hub_or_path("videoalign base config and processor", base, "preprocessor_config.json"))
    template = str(args.get("template") or TEMPLATE_URL)
    if template.startswith(("http://", "https://")):
        from rewards.clip_common import url_file_path

        name = f"videoalign-{hashlib.sha256(template.encode()).hexdigest()[:16]}.py"  # as the reward names it
        cached = url_file_path(template, name)
        needs.append({"what": "videoalign prompt template", "path": cached, "download_url": template,
                      "fix": f"wget '{template}' -O '{cached}'"})  # fmt: skip
    else:
        needs.append({"what": "videoalign prompt template", "path": os.path.expanduser(template)})
    return needs


# the base VideoReward's model_config.json names, and what AutoConfig and AutoProcessor read of it
VIDEOALIGN_BASE = "Qwen/Qwen2-VL-2B-Instruct"
VIDEOALIGN_BASE_FILES = [
    "config.json",
    "preprocessor_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
]


def _servers(args: dict) -> list[dict]:
    urls = list(args.get("urls") or []) or [args.get("url")]
    return [{"what": "reward server", "url": str(u)} for u in urls if u]


def reward_needs(name: str, args: dict) -> list[dict]:
    """What reward ``name`` with ``args`` (a config's reward entry) needs to start."""
    args = dict(args or {})
    if name in ("hpsv2", "hpsv21"):
        return _hps(name, args)
    if name == "video_frames":
        return reward_needs(str(args.get("reward", "jpeg_compressibility")), args.get("args") or {})
    table = {
        "imagereward": lambda: _imagereward(args),
        "pickscore": lambda: _pickscore(args),
        "clipscore": lambda: _clip_model("clipscore", args, CLIP_L),
        "temporal_consistency": lambda: _clip_model("temporal_consistency", args, CLIP_L),
        "aesthetic": lambda: _aesthetic(args),
        "geneval": lambda: _geneval(args),
        "ocr": lambda: _ocr(args),
        "vlm_judge": lambda: _vlm(args),
        "videoalign": lambda: _videoalign(args),
        "remote": lambda: _servers(args),
        "reward_server": lambda: _servers(args),
    }
    return table[name]() if name in table else []  # weight-free rewards need nothing
