"""The prompt sets the field trains and evaluates on, each pinned to its public source.

A set is one or more files fetched at run time (``diffrl-data fetch NAME``), never shipped:
each file names where it comes from (a GitHub repository at a commit, a Hugging Face
dataset at a revision, or a URL), its format, and a content hash that the fetch checks:
its sha256, or, where only the repository's tree was at hand when the entry was written,
the git blob id of the file at that commit (the sha1 of ``blob <size>\\0<bytes>``, which
pins the content as well). A set whose source has no pinnable version (a spreadsheet, a
dataset read at ``main``) says so (``pinned = False``): the first fetch records what it
got, and later fetches must match it. docs/DATA.md lists every set with its licence.

Values here (paths, commits, hashes, counts) were read from the sources on 2026-11-27.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rewards.errors import UserError

FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")
GENEVAL = ("djghosh13/geneval", "af4902f24d3ca90ebbb446dd9891a59e0f82725f")
DANCEGRPO = ("XueZeyue/DanceGRPO", "15cc71d53cc2e6e18a68ee607d5fb6ba9a99e344")
HPDV2 = ("zhwang/HPDv2", "main")  # the dataset hpsv2.benchmark_prompts() reads
# Imagen's DrawBench sheet, as shunk031/huggingface-datasets_DrawBench@6324c60 (DrawBench.py) reads it
DRAWBENCH_CSV = (
    "https://docs.google.com/spreadsheets/d/1y7nAbmR4FREi6npB1u-Bo3GFdwdOPYJc617rBOxIRHY/gviz/tq?tqx=out:csv"
)


@dataclass(frozen=True)
class SourceFile:
    """One file of a set. ``host``: ``github`` (``repo`` at commit ``revision``), ``hf``
    (a Hugging Face dataset ``repo`` at ``revision``) or ``url`` (``path`` is the URL)."""

    host: str
    repo: str
    revision: str
    path: str
    local: str  # the file name under the set's folder; its suffix is its format
    sha256: str | None = None
    git_blob: str | None = None
    bytes: int | None = None

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None or self.git_blob is not None


@dataclass(frozen=True)
class PromptSet:
    name: str
    files: tuple[SourceFile, ...]
    format: str
    source: str
    licence: str
    # how many prompts: counted in the file at its pinned version, or the paper's count where
    # the file could not be read when the entry was written (drawbench, the HPDv2 benchmark);
    # None where neither was at hand
    prompts: int | None
    used_by: str = ""
    notes: str = ""
    aliases: tuple[str, ...] = field(default=())

    @property
    def pinned(self) -> bool:
        return all(f.pinned for f in self.files)


def _github(repo_commit, path, local, **hashes) -> SourceFile:
    return SourceFile("github", repo_commit[0], repo_commit[1], path, local, **hashes)


_FLOW_GRPO_LICENCE = "MIT (the flow_grpo repository)"
_GENEVAL_FORMAT = (
    'jsonl: one object per line, {"tag", "include": [{"class", "count", "color"?}], "exclude"?, "prompt"}'
)
_HPDV2_BENCH = ("anime", "concept-art", "paintings", "photo")


def _hpdv2_file(style: str) -> SourceFile:
    return SourceFile("hf", HPDV2[0], HPDV2[1], f"benchmark/{style}.json", f"{style}.json")


SETS: dict[str, PromptSet] = {
    s.name: s
    for s in [
        PromptSet(
            "geneval/train",
            (
                _github(
                    FLOW_GRPO,
                    "dataset/geneval/train_metadata.jsonl",
                    "train_metadata.jsonl",
                    git_blob="0b97e8a6802c08fc7537cd00c76ae79c851bddcb",
                ),
            ),
            _GENEVAL_FORMAT,
            "flow_grpo dataset/geneval/train_metadata.jsonl",
            _FLOW_GRPO_LICENCE + "; GenEval's task grammar (MIT)",
            None,
            "flow_grpo geneval_sd3",
        ),
        PromptSet(
            "geneval/test",
            (
                _github(
                    FLOW_GRPO,
                    "dataset/geneval/test_metadata.jsonl",
                    "test_metadata.jsonl",
                    sha256="cec4b24b9fee7bac21c8f787054ecc8dc9ff831674037713a4cd35e0f0a74a28",
                    bytes=340835,
                ),
            ),
            _GENEVAL_FORMAT,
            "flow_grpo dataset/geneval/test_metadata.jsonl",
            _FLOW_GRPO_LICENCE + "; GenEval's task grammar (MIT)",
            2212,
            "flow_grpo geneval_sd3 (evaluation during training)",
        ),
        PromptSet(
            "geneval/eval",
            (
                _github(
                    GENEVAL,
                    "prompts/evaluation_metadata.jsonl",
                    "evaluation_metadata.jsonl",
                    sha256="5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13",
                    bytes=85209,
                ),
            ),
            _GENEVAL_FORMAT,
            "GenEval prompts/evaluation_metadata.jsonl: the official benchmark (6 tasks)",
            "MIT (the GenEval repository)",
            553,
            "GenEval's benchmark (4 images per prompt); the geneval evaluation protocol",
        ),
        PromptSet(
            "ocr/train",
            (
                _github(
                    FLOW_GRPO,
                    "dataset/ocr/train.txt",
                    "train.txt",
                    git_blob="3ce0521b77b0a9031191d66ecc36ebaaf27a3922",
                ),
            ),
            "txt: one prompt per line, the text to render in double quotes",
            "flow_grpo dataset/ocr/train.txt",
            _FLOW_GRPO_LICENCE,
            None,
            "flow_grpo general_ocr_sd3",
        ),
        PromptSet(
            "ocr/test",
            (
                _github(
                    FLOW_GRPO,
                    "dataset/ocr/test.txt",
                    "test.txt",
                    sha256="4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc",
                    bytes=217565,
                ),
            ),
            "txt: one prompt per line, the text to render in double quotes",
            "flow_grpo dataset/ocr/test.txt",
            _FLOW_GRPO_LICENCE,
            1018,
            "flow_grpo general_ocr_sd3; the ocr evaluation protocol",
        ),
        PromptSet(
            "pickscore/train",
            (
                _github(
                    FLOW_GRPO,
                    "dataset/pickscore/train.txt",
                    "train.txt",
                    sha256="2f425adcbb9a6d0feee7c6c448e1cb83a1f71deca9434b803907e2578eca837f",
                    bytes=2906730,
                ),
            ),
            "txt: one prompt per line",
            "flow_grpo dataset/pickscore/train.txt (Pick-a-Pic prompts)",
            _FLOW_GRPO_LICENCE + "; the prompts come from Pick-a-Pic (see its dataset card)",
            25432,
            "flow_grpo pickscore_sd3 and compressibility; DiffusionNFT, AWM, DGPO, Flow-DPPO",
        ),
        PromptSet(
            "pickscore/test",
            (
                _github(
                    FLOW_GRPO,
                    "dataset/pickscore/test.txt",
                    "test.txt",
                    sha256="d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262",
                    bytes=239891,
                ),
            ),
            "txt: one prompt per line",
            "flow_grpo dataset/pickscore/test.txt (Pick-a-Pic prompts)",
            _FLOW_GRPO_LICENCE + "; the prompts come from Pick-a-Pic (see its dataset card)",
            2048,
            "flow_grpo pickscore_sd3 (evaluation during training)",
        ),
        PromptSet(
            "hpdv2/train",
            (
                _github(
                    DANCEGRPO,
                    "assets/prompts.txt",
                    "prompts.txt",
                    git_blob="b47234e475645222ca9a0bb7742ebf4d08123855",
                ),
            ),
            "txt: one prompt per line",
            "DanceGRPO assets/prompts.txt (HPDv2 training prompts)",
            "Apache-2.0 (the DanceGRPO repository); the prompts come from HPDv2 (see its dataset card)",
            None,
            "DanceGRPO and BranchGRPO FLUX HPS recipes",
        ),
        PromptSet(
            "dancegrpo/video",
            (
                _github(
                    DANCEGRPO,
                    "assets/video_prompts.txt",
                    "video_prompts.txt",
                    sha256="c96ceb6c93c16809f6fef53d6d488c34c78823e5edd20f6d907d90c9e5653db1",
                    bytes=3839720,
                ),
            ),
            "txt: one prompt per line",
            "DanceGRPO assets/video_prompts.txt",
            "Apache-2.0 (the DanceGRPO repository)",
            50000,
            "DanceGRPO Wan / HunyuanVideo recipes",
        ),
        PromptSet(
            "drawbench",
            (SourceFile("url", "", "", DRAWBENCH_CSV, "drawbench.csv"),),
            "csv: columns Prompts, Category (11 categories)",
            "Imagen's DrawBench sheet (the one shunk031/huggingface-datasets_DrawBench loads)",
            "no licence stated (the dataset card of shunk031/DrawBench says 'unknown')",
            200,
            "the drawbench evaluation protocol",
            notes="a spreadsheet has no version to pin: the first fetch records its sha256",
        ),
        PromptSet(
            "hpdv2/benchmark",
            tuple(_hpdv2_file(style) for style in _HPDV2_BENCH),
            "json: a list of prompt strings per style, the four styles in this order",
            "the HPDv2 benchmark prompts (zhwang/HPDv2 benchmark/*.json, what hpsv2.benchmark_prompts reads)",
            "see the zhwang/HPDv2 dataset card (the HPSv2 repository is Apache-2.0)",
            3200,
            "the hpdv2 evaluation protocol (HPSv2's benchmark: 800 prompts per style)",
            notes="read at the dataset's main revision: the first fetch records each file's sha256",
        ),
    ]
    + [
        PromptSet(
            f"hpdv2/benchmark-{style}",
            (_hpdv2_file(style),),
            "json: a list of prompt strings",
            f"the HPDv2 benchmark's {style} prompts (zhwang/HPDv2 benchmark/{style}.json)",
            "see the zhwang/HPDv2 dataset card (the HPSv2 repository is Apache-2.0)",
            800,
            "one style of the hpdv2 evaluation protocol",
            notes="read at the dataset's main revision: the first fetch records its sha256",
        )
        for style in _HPDV2_BENCH
    ]
}


class UnknownPromptSet(UserError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def get(name: str) -> PromptSet:
    if name not in SETS:
        raise UnknownPromptSet(f"unknown prompt set '{name}'; known: {', '.join(SETS)} (diffrl-data list)")
    return SETS[name]


def is_set_name(value: str) -> bool:
    return value in SETS


def nearest_set_names(value: str, count: int = 2) -> list[str]:
    """The known set names closest to ``value`` (a misspelt one), nearest first."""
    import difflib

    return difflib.get_close_matches(str(value), list(SETS), n=count, cutoff=0.6)
