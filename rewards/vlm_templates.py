"""Judge questions the papers asked, read from the reference code at run time.

``template: unifiedreward`` is the question DiffusionNFT's evaluation (and flow_grpo's
training reward) puts to UnifiedReward-7b-v1.5: ``flow_grpo/rewards.py:
unifiedreward_score_sglang.evaluate_image`` at NVlabs/DiffusionNFT@24af555, an f-string
with the image's caption in it, asked after the image, answered with "Final Score: x"
(1-5), which the reference divides by 5. The question is not shipped here: it is read
from that file (a local path or a URL, by default the pinned commit's raw file, checked
against its sha256 and kept in torch.hub's cache) and taken from its syntax tree, never
run; the caption's place becomes ``{prompt}``.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

DIFFUSIONNFT_COMMIT = "24af5554898d85e93efa492f42b5e9cdf4156e9b"
UNIFIEDREWARD_URL = (
    f"https://raw.githubusercontent.com/NVlabs/DiffusionNFT/{DIFFUSIONNFT_COMMIT}/flow_grpo/rewards.py"
)
UNIFIEDREWARD_SHA256 = "3dbeeac46583cdb1ae46e1d4e558cf152f5793d7bd12d5d5179dcf18319e653a"
# preset -> (default source, its sha256, the function that asks, the variable holding the question)
PRESETS = {"unifiedreward": (UNIFIEDREWARD_URL, UNIFIEDREWARD_SHA256, "evaluate_image", "question")}


class TemplateSourceError(ValueError):
    """A reference file cannot give the preset's question; names the file and the fix."""


def preset_template(name: str, source: str | None = None) -> str:
    """The question of preset ``name`` from ``source`` (default: the pinned reference file,
    whose sha256 is checked; a file given by hand is taken as it is)."""
    default, sha256, function, variable = PRESETS[name]
    data = _read(source or default, name)
    if source is None and hashlib.sha256(data).hexdigest() != sha256:
        raise TemplateSourceError(f"vlm_judge: {default} is not the pinned file for template '{name}'")
    return question_in(data.decode(), function, variable, source or default)


def question_in(code: str, function: str, variable: str, where: str = "the file") -> str:
    """The f-string assigned to ``variable`` in ``function`` (sync or async), its one
    formatted value (the caption) replaced by ``{prompt}``."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            for stmt in ast.walk(node):
                if (
                    isinstance(stmt, ast.Assign)
                    and any(getattr(t, "id", None) == variable for t in stmt.targets)
                    and isinstance(stmt.value, ast.JoinedStr)
                ):
                    return _template(stmt.value, where)
    raise TemplateSourceError(f"vlm_judge: {where} has no f-string '{variable}' in a function '{function}'")


def _template(fstring: ast.JoinedStr, where: str) -> str:
    parts, fields = [], 0
    for value in fstring.values:
        if isinstance(value, ast.Constant):
            parts.append(value.value)  # filled by replacing {prompt}, not str.format: braces stay
        elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name):
            parts.append("{prompt}")
            fields += 1
        else:
            raise TemplateSourceError(
                f"vlm_judge: the question in {where} formats something other than a name"
            )
    if fields != 1:
        raise TemplateSourceError(
            f"vlm_judge: the question in {where} has {fields} fields; one (the caption)"
        )
    return "".join(parts)


def _read(source: str, name: str) -> bytes:
    if re.match(r"https?://", source):
        from rewards.clip_common import MissingRewardWeightsError, url_file

        cached = f"vlm-template-{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
        try:
            return Path(url_file("vlm_judge", source, cached)).read_bytes()
        except MissingRewardWeightsError:
            raise TemplateSourceError(
                f"vlm_judge: could not fetch the '{name}' question from {source}; offline, pass "
                "template_source: PATH to that file of a clone"
            ) from None
    path = Path(source).expanduser()
    if not path.is_file():
        raise TemplateSourceError(f"vlm_judge: template_source '{source}' is not a file")
    return path.read_bytes()
