"""README's file map matches the tree: every file it names exists, and every module of the
package is named (so a reader finds the scheduler, the KV cache or a kernel by file name)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mapped_paths() -> list[Path]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Where things are") :]
    paths = []
    for row in re.findall(r"^\| (`[^|]*`) \|", table, flags=re.M):
        names = re.findall(r"`([^`]+)`", row)
        folder = Path(names[0]).parent
        for name in names:  # later names in a row are relative to the first one's folder
            path = Path(name) if "/" in name else folder / name
            paths += list(ROOT.glob(str(path))) or [ROOT / path]
    return paths


def test_every_mapped_file_exists():
    missing = [str(p.relative_to(ROOT)) for p in mapped_paths() if not p.exists()]
    assert not missing, f"README names files that do not exist: {missing}"


def test_every_module_is_mapped():
    mapped = {p.resolve() for p in mapped_paths()}
    covered = lambda f: f in mapped or any(d.is_dir() and d in f.parents for d in mapped)  # noqa: E731
    modules = [
        f for f in (ROOT / "tinyoss").rglob("*.py")
        if f.name != "__init__.py" and "data" not in f.parts
    ]
    unmapped = [str(f.relative_to(ROOT)) for f in modules if not covered(f.resolve())]
    assert not unmapped, f"modules missing from README's file map: {unmapped}"


def test_vllm_arguments_of_generate_and_chat_are_documented():
    """The README's Python API names each vLLM argument `generate` and `chat` take at values
    that ask for nothing, and the values other than None they take (it had said None for
    chat_template_content_format, whose None is refused)."""
    from tinyoss.llm import VLLM_ARGS, VLLM_INERT

    text = (ROOT / "README.md").read_text()
    api = " ".join(text[text.index("## Python API"):text.index("## Serve")].split())
    for method, names in VLLM_ARGS.items():
        for name in names:
            assert f"`{name}`" in api, f"README's Python API does not name {method}'s {name}"
    for name, (values, _) in VLLM_INERT.items():
        if None not in values:
            for v in values:
                assert f"`{v}`" in api, f"README does not say {name} takes {v!r}"
