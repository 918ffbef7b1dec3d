"""mkdocs hooks (``hooks:`` in mkdocs.yml), run by ``mkdocs build``.

- ``bench/results/`` is published as ``results/`` (pages not in the navigation), so the docs link
  the benchmarks' own output files instead of copies of them.
- A line ``<!-- rafl-output: ARGS -->`` in a page is replaced by a code block holding the output of
  ``python -m rafl ARGS`` run from the repository root: reference text that the code prints
  (``federate --show-config``, ``federate --list-algorithms``) cannot drift from it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
OUTPUT = re.compile(r"^<!-- rafl-output: (.+?) -->$", flags=re.M)
_outputs: dict[str, str] = {}


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file():
            files.append(File.generated(config, f"results/{path.relative_to(RESULTS).as_posix()}",
                                        abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def _run(args: str) -> str:
    if args not in _outputs:
        done = subprocess.run([sys.executable, "-m", "rafl", *shlex.split(args)], cwd=REPO, capture_output=True,
                              text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise PluginError(f"`rafl {args}` exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        _outputs[args] = done.stdout.rstrip("\n")
    return _outputs[args]


def on_page_markdown(markdown, page, config, files):
    def block(match: re.Match) -> str:
        args = match.group(1)
        lang = "yaml" if "--show-config" in args else "text"
        return f"```{lang}\n$ rafl {args}\n{_run(args)}\n```" if lang == "text" else f"```yaml\n{_run(args)}\n```"

    return OUTPUT.sub(block, markdown)
