"""docs/API.md runs: its Python snippets, executed in order as one program, hold their assertions."""

import re
from pathlib import Path

API = Path(__file__).parent.parent / "docs" / "API.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", API.read_text(), flags=re.S)


def test_the_api_page_runs_as_written(capsys):
    code = snippets()
    assert len(code) >= 7  # graph, cluster, optimize, plan, evaluate, simulate, export (and errors)
    namespace: dict = {}
    for n, snippet in enumerate(code):
        exec(compile(snippet, f"docs/API.md snippet {n + 1}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "ms per iteration" in printed  # the optimize snippet reported its plan


def test_the_top_level_package_exports_what_the_page_uses():
    import partopt

    used = set(re.findall(r"partopt\.([A-Za-z_]+)\(", API.read_text())) - {"models", "errors", "explain", "draw"}
    assert used <= set(partopt.__all__), used - set(partopt.__all__)
