"""The preflight: everything a run reads, found before any GPU starts, or all that is
missing listed at once with the command that fetches exactly what the run reads.

``diffrl-train --config X --preflight`` prints the whole list and exits 2 if anything is
missing. Every launch runs the same check on its main process before a model is built:
what cannot come by itself (a local path, a prompt set, a reward server, a Python
package, and with ``HF_HUB_OFFLINE=1`` any hub file) stops the start with the list; hub
files that are missing while the hub is reachable are listed as what is about to be
downloaded, and the run goes on.

Models: a diffusers pipeline is its ``model_index.json`` and one folder per component
(the pipeline class's own list), so the download command names those folders with
``--include``: for FLUX.1-dev that leaves out the repository's single-file checkpoints
(``flux1-dev.safetensors``, ``ae.safetensors``), about 57 GB against 34. With the hub
reachable, each missing repository's size (of the included files) and licence gate are
asked of it.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rewards.errors import UserError

TRANSFORMERS_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]  # config, weights, tokenizer


class PreflightError(UserError, RuntimeError):
    """What a run reads is missing and cannot come by itself; the message lists all of it."""


@dataclass
class Need:
    what: str
    repo: str | None = None
    revision: str | None = None
    files: list[str] = field(default_factory=list)  # exact files of a hub repo
    includes: list[str] = field(default_factory=list)  # folders (patterns) of a hub repo
    components: list[str] = field(default_factory=list)  # a diffusers pipeline's folders
    path: str | None = None
    url: str | None = None  # a server that must answer
    python: str | None = None  # a package that must import
    prompt_set: str | None = None
    download_url: str | None = None  # fetched once by the run itself into ``path``
    fix: str | None = None
    found: bool = False
    size_gb: float | None = None
    gated: str | None = None

    @property
    def automatic(self) -> bool:
        """Fetched by the run itself where the network is reachable (a hub file, a URL)."""
        return self.repo is not None or self.download_url is not None


# -- what the config reads ------------------------------------------------------------------
def pipeline_components(family: str) -> list[str]:
    """The component folders a family's diffusers pipeline loads."""
    from diffrl.models import adapter_class

    adapter = adapter_class(family)
    cls = adapter.pipeline_class
    optional = set(getattr(cls, "_optional_components", []))
    names = []
    for name, param in inspect.signature(cls.__init__).parameters.items():
        config_value = param.default is not inspect.Parameter.empty and param.default is not None
        if (
            name != "self"
            and name not in optional
            and not config_value
            and not _is_plain_value(param.annotation)
        ):
            names.append(name)
    return names + [c for c in getattr(adapter, "weight_components", ()) if c not in names]


# the annotations of a pipeline argument that is a value (Wan2.2's ``boundary_ratio:
# Optional[float]``), not a component folder
_VALUE_WORDS = {"bool", "int", "float", "str", "None", "NoneType", "Optional", "Union", "typing"}


def _is_plain_value(annotation) -> bool:
    """Whether every type an annotation names is a number, a string, a flag or None; a
    string annotation is read by its words."""
    import re
    import typing

    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        return set(re.findall(r"[A-Za-z_]\w*", annotation)) <= _VALUE_WORDS
    args = typing.get_args(annotation)
    if args:
        return all(_is_plain_value(a) for a in args)
    return annotation in (bool, int, float, str, type(None))


def model_needs(cfg) -> list[Need]:
    from diffrl.data.checks import is_real_model

    m = cfg.model
    if not is_real_model(m.pretrained):
        return []
    components = pipeline_components(m.family)
    what = f"model {m.pretrained} ({m.family})"
    includes = ["model_index.json", *[f"{c}/*" for c in components]]
    if Path(m.pretrained).expanduser().exists() or os.path.isabs(m.pretrained):
        path = str(Path(m.pretrained).expanduser())
        fix = local_model_command(m.family, path, includes, components)
        return [Need(what, path=path, includes=includes, components=components, fix=fix)]
    return [Need(what, repo=m.pretrained, revision=m.revision, includes=includes, components=components)]


def prompt_needs(cfg) -> list[Need]:
    from diffrl.data import is_set_name
    from diffrl.data.prompts import resolve_prompt_path

    needs = []
    # an evaluation on prompts held out of the training file reads no evaluation file
    for key in ("train_prompts",) if cfg.data.eval_holdout else ("train_prompts", "eval_prompts"):
        value = getattr(cfg.data, key)
        if is_set_name(value):
            needs.append(
                Need(f"prompt set {value} (data.{key})", prompt_set=value, fix=f"diffrl-data fetch {value}")
            )
        else:
            needs.append(Need(f"prompt file {value} (data.{key})", path=str(resolve_prompt_path(value))))
    return needs


def reward_needs(cfg) -> list[Need]:
    from rewards.needs import reward_needs as needs_of

    out = []
    for spec in cfg.rewards:
        for need in needs_of(spec.name, dict(spec.args)):
            files = list(need.get("files") or [])
            includes = TRANSFORMERS_FILES if need.get("model") else []
            out.append(Need(need["what"], repo=need.get("repo"), files=files, includes=includes,
                            path=need.get("path"), url=need.get("url"), python=need.get("python"),
                            download_url=need.get("download_url"), fix=need.get("fix")))  # fmt: skip
    return out


def lora_needs(cfg) -> list[Need]:
    """``model.init_lora``: a local LoRA, or a hub repository's LoRA files."""
    from diffrl.models.lora_files import looks_local

    spec = cfg.model.init_lora
    if not spec:
        return []
    what = f"LoRA {spec} (model.init_lora)"
    if looks_local(spec):
        return [
            Need(
                what,
                path=str(Path(spec).expanduser()),
                fix="point model.init_lora at the LoRA's folder or file",
            )
        ]
    return [Need(what, repo=spec, includes=["*.json", "*.safetensors"])]


def refiner_needs(cfg) -> list[Need]:
    """``refiner.model``: PromptRL's prompt-refining LM, a hub repository or a local folder
    (the shipped ShapeWorld refiner and the tiny twin need nothing)."""
    name = cfg.refiner.model
    if name in (None, "tiny", "shapeworld"):
        return []
    what = f"refiner LM {name} (refiner.model)"
    if Path(name).expanduser().exists() or os.path.isabs(name):
        fix = f"hf download <the LM's hub id> --include {' '.join(TRANSFORMERS_FILES)} --local-dir {name}"
        return [Need(what, path=str(Path(name).expanduser()), fix=fix)]
    return [Need(what, repo=name, revision=cfg.refiner.revision, includes=TRANSFORMERS_FILES + ["*.jinja"])]


def gather(cfg) -> list[Need]:
    needs = [*prompt_needs(cfg), *model_needs(cfg), *lora_needs(cfg), *refiner_needs(cfg), *reward_needs(cfg)]
    return merged(needs)


def _identity(need: Need) -> tuple:
    return (
        need.repo,
        need.revision,
        tuple(need.files),
        tuple(need.includes),
        need.path,
        need.url,
        need.python,
        need.prompt_set,
        need.download_url,
    )


def merged(needs: list[Need]) -> list[Need]:
    """One line per thing to fetch: needs of the same files (a prompt set that is both the
    training and the evaluation set, a tokenizer two rewards read) are one need, named by
    everything that reads it (issue 62, item 4: the list repeated them)."""
    out: dict[tuple, Need] = {}
    for need in needs:
        key = _identity(need)
        if need.repo is not None and need.files and not need.includes:  # files of one repo: one line
            key = (need.repo, need.revision, "files")
        if key not in out:
            out[key] = need
            continue
        first = out[key]
        if need.what not in first.what:
            first.what = f"{first.what}; {need.what}"
        first.files = [*first.files, *(f for f in need.files if f not in first.files)]
    return list(out.values())


# -- is it here? ------------------------------------------------------------------------------
def check(need: Need) -> bool:
    if need.python:
        import importlib.util

        return importlib.util.find_spec(need.python) is not None
    if need.prompt_set is not None:
        from diffrl.data import PromptSetError, local_files

        try:
            local_files(need.prompt_set)
        except PromptSetError:
            return False
        return True
    if need.path is not None:
        return _local_complete(Path(need.path), need.components)
    if need.url is not None:
        return _answers(need.url)
    return _cached(need)


def _cached(need: Need) -> bool:
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> str | None:
        hit = try_to_load_from_cache(need.repo, filename, revision=need.revision)
        return hit if isinstance(hit, str) else None

    if need.files:
        return all(cached(f) for f in need.files)
    anchor = cached("model_index.json" if need.components else "config.json")
    return anchor is not None and _local_complete(Path(anchor).parent, need.components)


def _local_complete(folder: Path, components: list[str]) -> bool:
    """A folder holds a model: a file (a checkpoint), a transformers model (config and
    weights), or a diffusers pipeline (its index and each component's files)."""
    if folder.is_file():
        return True
    if not folder.is_dir():
        return False
    if not components:
        return (folder / "config.json").is_file() and _weights_complete(folder)
    if not (folder / "model_index.json").is_file():
        return False
    return all(
        (folder / c).is_dir() and any((folder / c).iterdir()) and _weights_complete(folder / c)
        for c in components
    )


def _weights_complete(folder: Path) -> bool:
    """Every shard an index names is there; a folder without an index needs no more."""
    for index in folder.glob("*.index.json"):
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if not all((folder / s).is_file() for s in shards):
            return False
    return True


def _answers(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
            return True
    except urllib.error.HTTPError as err:
        return err.code < 500  # it answered (a 404 on a root is still a live server)
    except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError):
        return False


# -- saying what is missing -----------------------------------------------------------------
def command(need: Need) -> str:
    """The command that fetches exactly what the run reads of ``need``."""
    if need.fix:
        return need.fix
    if need.repo is not None:
        revision = f" --revision {need.revision}" if need.revision else ""
        if need.files:
            return f"hf download {need.repo} {' '.join(need.files)}{revision}"
        patterns = " ".join(f'"{p}"' for p in need.includes)
        return f"hf download {need.repo} --include {patterns}{revision}"
    if need.url is not None:
        return f"start the server that answers {need.url}, or fix its address in the config"
    return "put the file there, or point the config at it"


def local_model_command(family: str, path: str, includes: list[str], components: list[str]) -> str:
    """A missing local diffusers folder: the download of the family's published checkpoint
    into exactly that folder (the others of the family named), or, for a family no shipped
    architecture lists, what the folder must hold."""
    from diffrl.models.arch import family_hub_ids

    hub_ids = family_hub_ids(family)
    if not hub_ids:
        return (
            f"a diffusers folder with model_index.json and {', '.join(components)}: "
            f"`hf download REPO --include ... --local-dir {path}`"
        )
    patterns = " ".join(f'"{p}"' for p in includes)
    others = f" (or {', '.join(hub_ids[1:])})" if len(hub_ids) > 1 else ""
    return f"hf download {hub_ids[0]} --include {patterns} --local-dir {path}{others}"


def hub_details(need: Need) -> None:
    """Fill in the size of what ``command`` would fetch and the repository's licence gate,
    asked of the hub (nothing is filled in where it does not answer)."""
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(need.repo, revision=need.revision, files_metadata=True)
    except Exception:  # offline, no such repository, no access: the command still stands
        return
    wanted = need.files or need.includes
    sizes = [s.size or 0 for s in info.siblings or [] if any(fnmatch.fnmatch(s.rfilename, p) for p in wanted)]
    need.size_gb = sum(sizes) / 1e9 if sizes else None
    if info.gated:
        need.gated = (
            f"gated ({info.gated}): accept the licence at https://huggingface.co/{need.repo} and log in "
            "(`hf auth login`) first"
        )


def report(needs: list[Need]) -> str:
    lines = []
    for need in needs:
        if need.found:
            lines.append(f"  ok       {need.what}")
            continue
        size = f" (about {need.size_gb:.1f} GB)" if need.size_gb is not None else ""
        lines.append(f"  MISSING  {need.what}{size}")
        lines.append(f"           {command(need)}")
        if need.gated:
            lines.append(f"           {need.gated}")
    missing = sum(not n.found for n in needs)
    head = f"preflight: {len(needs) - missing} of {len(needs)} found" + (
        f", {missing} missing:" if missing else ""
    )
    return "\n".join([head, *lines])


def preflight(cfg, ask_hub: bool = True) -> list[Need]:
    """Every need of ``cfg``, each checked (and, missing from the hub, sized if it answers)."""
    import huggingface_hub.constants as hub

    needs = gather(cfg)
    for need in needs:
        need.found = check(need)
        if not need.found and need.repo is not None and ask_hub and not hub.HF_HUB_OFFLINE:
            hub_details(need)
    return needs


def stop_if_missing(cfg, again: str, reward_arg_style: bool = False) -> None:
    """What a start (a training run, a protocol) cannot fetch itself stops it, listed all at
    once with ``again`` (how to check without starting); hub files it is about to download
    are said (main process). ``reward_arg_style``: fixes are phrased as the ``--reward-arg
    NAME.KEY=VALUE`` a protocol takes instead of a config's ``rewards.N.args.KEY: VALUE``."""
    needs = preflight(cfg)
    missing = [n for n in needs if not n.found]
    if reward_arg_style:
        for need in missing:
            need.fix = as_reward_arg(need.fix, need.what)
    if blocking(needs):
        raise PreflightError(report(missing) + f"\n({again})")
    if missing and int(os.environ.get("RANK", "0")) == 0:
        print(report(missing).replace("preflight:", "preflight: downloading now;", 1))


def as_reward_arg(fix: str | None, what: str) -> str | None:
    """``rewards.N.args.KEY: VALUE`` as ``--reward-arg NAME.KEY=VALUE`` (NAME: the reward the
    need is of, the first word of ``what``)."""
    if fix is None:
        return None
    import re

    name = what.split()[0]
    return re.sub(r"rewards\.N\.args\.(\w+): (\S+)", rf"--reward-arg {name}.\1=\2", fix)


def blocking(needs: list[Need]) -> list[Need]:
    """The missing needs the run cannot fetch itself (all of them offline)."""
    import huggingface_hub.constants as hub

    return [n for n in needs if not n.found and (hub.HF_HUB_OFFLINE or not n.automatic)]
