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


def _serve_parser():
    from tinyoss.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["serve"]


def test_every_serve_flag_is_in_docs_serve_md():
    """A flag `tinyoss serve --help` lists is in docs/serve.md (`--[no-]x` covers both)."""
    doc = (ROOT / "docs/serve.md").read_text()
    flags = [o for a in _serve_parser()._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"]
    base = lambda f: f.removeprefix("--").removeprefix("no-")  # noqa: E731
    missing = [f for f in flags if f not in doc and f"--[no-]{base(f)}" not in doc
               and not (f.startswith("--no-") and f"--{base(f)}" in doc)]
    assert not missing, f"serve flags docs/serve.md does not name: {missing}"


def test_serve_limits_table_defaults_are_the_flags():
    """docs/serve.md's limits table: each default is the flag's (a changed default must change
    the table)."""
    doc = (ROOT / "docs/serve.md").read_text()
    table = doc[doc.index("| flag | default | beyond it |"):]
    table = table[:table.index("\n\n")]
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 1, "s": 1}  # --max-logprob-memory is in GiB
    defaults = {a.dest: a.default for a in _serve_parser()._actions}
    rows = re.findall(r"^\| `--([\w-]+)` \| ([\d,.]+)(?: (\w+))? \|", table, flags=re.M)
    assert len(rows) >= 10, rows
    for flag, number, unit in rows:
        documented = float(number.replace(",", "")) * units.get(unit, 1)
        assert documented == defaults[flag.replace("-", "_")], (flag, number, unit)


def test_serve_md_names_the_server_extra_and_what_it_installs():
    """docs/serve.md's install line is the README's (`-e '.[server]'`, from the clone), and it
    names each package of the extra the server needs (httptools and uvloop: uvicorn takes them
    when there); it had named starlette and uvicorn alone."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["server"]
    intro = (ROOT / "docs/serve.md").read_text().split("```")[0]
    assert "pip install -e '.[server]'" in intro
    for spec in extra:
        name = re.match(r"[\w-]+", spec).group(0)
        if name not in ("httptools", "uvloop"):
            assert name in intro, f"docs/serve.md does not say the server extra installs {name}"


def test_metrics_table_names_metrics_the_server_exports():
    """Each metric docs/serve.md's Metrics table gives as the one served (its second column) is
    in the server's registry (counters without prometheus_client's `_total`)."""
    from tinyoss.server.metrics import Metrics

    doc = (ROOT / "docs/serve.md").read_text()
    table = doc[doc.index("| tinyoss metric | vLLM's name |"):]
    table = table[:table.index("\n\n")]
    names = [n for row in table.splitlines()[2:]
             for n in re.findall(r"`((?:vllm:|tinyoss_)[a-z_:]+)`", row.split(" | ")[1])]
    assert len(names) >= 25, names
    served = {m.name for m in Metrics("m", lambda: None, lambda: (0, 1)).registry.collect()}
    missing = [n for n in names if n not in served and n.removesuffix("_total") not in served]
    assert not missing, f"docs/serve.md names metrics the server does not export: {missing}"


def test_endpoints_table_has_every_route_and_method():
    """docs/serve.md's Endpoints table names every path of the server's OpenAPI document (the
    app's routes, as tests/test_server_schemas.py checks) with each of its methods."""
    import json

    from tinyoss.server.schemas import openapi_json

    doc = (ROOT / "docs/serve.md").read_text()
    table = doc[doc.index("### Endpoints"):doc.index("### Metrics")]
    paths = json.loads(openapi_json(False))["paths"]
    assert len(paths) >= 15, sorted(paths)
    for path, ops in paths.items():
        path = re.sub(r"\{[^}]+\}", "{id}", path)
        rows = [line for line in table.splitlines() if f"{path}`" in line]
        assert rows, f"docs/serve.md's Endpoints table does not name {path}"
        for method in set(ops) & {"get", "post", "delete", "put", "patch"}:
            assert any(f"`{method.upper()}" in row for row in rows), (path, method)


def test_readme_names_every_sampling_flag_of_generate_and_chat():
    """The README's list of `tinyoss generate` / `chat` sampling flags is the parser's (the
    'sampling options' group; --reasoning-effort is chat's own)."""
    from tinyoss.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for command in ("generate", "chat"):
        groups = sub.choices[command]._action_groups
        sampling = next(g for g in groups if g.title == "sampling options")
        flags = [o for a in sampling._group_actions for o in a.option_strings]
        assert len(flags) >= 9, flags
        missing = [f for f in flags if f"`{f}`" not in readme and f"{f} " not in readme]
        assert not missing, f"README does not name {command}'s sampling flags {missing}"


def test_reliability_suite_has_the_classes_docs_serve_md_says():
    """docs/serve.md's count of the reliability suite's malformed-request classes holds (it
    had said 190 when there were 206: now a floor, "over N")."""
    doc = " ".join((ROOT / "docs/serve.md").read_text().split())
    floor = int(re.search(r"over (\d+) malformed-request classes", doc).group(1))
    from tests.reliability.test_malformed import CASES

    count = len(CASES)
    assert count > floor, f"docs/serve.md says over {floor} classes; there are {count}"


def test_every_repository_path_the_docs_name_exists():
    """A file or folder README.md or docs/serve.md names (a measurement in bench/results/, a
    module, a test) is in the tree; results cited by file name alone are in bench/results/."""
    missing = []
    for name in ("README.md", "docs/serve.md"):
        text = (ROOT / name).read_text()
        for path in re.findall(r"\b(?:tinyoss|tests|bench|docs)/[\w./*-]+", text):
            path = path.rstrip(".,;:")
            if "NAME" not in path and not list(ROOT.glob(path)):
                missing.append(path)
        for result in re.findall(r"`(20\d\d-\d\d-\d\d_[\w.-]+\.(?:md|txt|jsonl?))`", text):
            if not (ROOT / "bench/results" / result).exists():
                missing.append(result)
    assert not missing, f"the docs name paths that are not in the tree: {sorted(set(missing))}"
