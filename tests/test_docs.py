"""Every file the docs name exists: README.md and docs/**/*.md, checked against the tree.

What counts as a reference, and how each one resolves:

* a markdown link or image, ``[text](target#anchor)``: the target relative to the doc (an
  external URL is left alone); an anchor must be a heading's slug in the target doc (in the
  doc itself for ``(#anchor)``), as GitHub makes them;
* a path in a code span: one that starts at a top-level folder or file of the repository
  (``apps/launch_pd.py``) must exist from the root; one that starts at an import package
  (``tspd_core/sched/pool.py``) must exist in that package; any other source file or folder
  with a folder in its path (``loop/core.py``, ``data/04_fidelity/``) must end some path of
  the tree; a bare source or doc file name (``nodes.py``, ``pd.md``) must be some file's
  name. A ``:LINE`` suffix is dropped, and a ``*`` must match something;
* a dotted name in a code span that starts at an import package
  (``tspd_core.pd.proc.forkserver``): each name but the last must be a package or a module
  (after a module, and for the last name, an attribute is fine);
* a module tree, a fenced block without a language whose first line is a folder
  (``packages/tspd-engine/``, ``pd/``) or a file at the root (``pyproject.toml``): each entry,
  under the folders its indentation nests it in.

A path that starts elsewhere (``DIR/prefill.csv``, ``/tmp/x``) is an example, not a
reference; other bare names (``config.json``) are artifacts a user or a run makes. Paths a run
creates are in :data:`ALLOWED`, each with its reason. A failure names the doc, the line and
what is missing.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Paths the docs may name although the tree does not hold them, each with its reason. A
#: reference matches an entry when it equals it or lies under it.
ALLOWED: dict[str, str] = {
    "bench-results": "the benchmarks write their JSON here as they run (git-ignored)",
    "sim-results": "`nox -s sim` and `tspd-sim run --out` write here (git-ignored)",
    "experiments/executed": "the notebook runner writes executed copies here (git-ignored)",
    ".venv": "the virtualenv ./nox builds (git-ignored)",
    ".gpu-pack": "scripts/gpu-pack writes its archive here (git-ignored)",
    "../shared": "TokenSpeed's runtime beside the repository: a test fixture, not in it",
}

#: File kinds a bare or relative name must be before it is looked up: sources and docs.
SOURCE_SUFFIXES = (".py", ".pyx", ".pxd", ".pyi", ".c", ".md", ".ipynb")
#: Folders whose contents are not part of the tree (caches, build outputs, environments).
SKIP_DIRS = {
    ".git",
    ".venv",
    ".nox",
    "__pycache__",
    ".gpu-pack",
    "build",
    "dist",
    ".hypothesis",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
}

FENCE = re.compile(r"^\s*(```|~~~)\s*(\S*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
PATH_TOKEN = re.compile(r"(?:\.\.?/)*[\w*.-]+(?:/[\w*.-]+)*/?")
TREE_NAME = re.compile(r"[\w*.-]+(?:/[\w*.-]+)*/?")
DOTTED = re.compile(r"[a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
LINE_SUFFIX = re.compile(r":\d+(?:-\d+)?$")
HAS_SUFFIX = re.compile(r"\.[A-Za-z]\w*$")


@dataclass(frozen=True, slots=True)
class Missing:
    doc: str
    line: int
    ref: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.ref} — {self.why}"


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@cache
def tree() -> tuple[frozenset[str], frozenset[str]]:
    """Every file's and folder's path relative to the root, and every file's name. A folder
    counts only when it holds a file (a package moved away may leave its caches behind)."""
    paths: set[str] = set()
    names: set[str] = set()
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.name in SKIP_DIRS or entry.name.endswith(".egg-info"):
                continue
            if entry.is_dir():
                stack.append(entry)
                continue
            rel = entry.relative_to(ROOT)
            names.add(entry.name)
            paths.add(rel.as_posix())
            paths.update(p.as_posix() for p in rel.parents if p.parts)
    return frozenset(paths), frozenset(names)


@cache
def top_level() -> frozenset[str]:
    """Names a repository path may start with: the root's files and folders."""
    return frozenset(p.split("/", 1)[0] for p in tree()[0])


@cache
def import_roots() -> dict[str, str]:
    """Import package name -> its folder relative to the root: every workspace package's
    ``src/`` and ``apps/``."""
    roots: dict[str, str] = {}
    for base in [*sorted(ROOT.glob("packages/*/src")), ROOT / "apps"]:
        for init in sorted(base.glob("*/__init__.py")):
            roots[init.parent.name] = init.parent.relative_to(ROOT).as_posix()
    return roots


def allowed(ref: str) -> bool:
    ref = ref.rstrip("/")
    return any(ref == a or ref.startswith(a + "/") for a in ALLOWED)


def glob_pattern(rel: str) -> re.Pattern[str]:
    return re.compile(re.escape(rel).replace(r"\*", "[^/]*"))


def present(rel: str) -> bool:
    """``rel`` (relative to the root; ``*`` allowed) is a file or folder of the tree."""
    paths, _ = tree()
    rel = rel.rstrip("/")
    if "*" in rel:
        pattern = glob_pattern(rel)
        return any(pattern.fullmatch(p) for p in paths)
    return rel in paths


def ends_some_path(rel: str) -> bool:
    """``rel`` is the end of some file's or folder's path in the tree."""
    paths, _ = tree()
    rel = rel.rstrip("/")
    pattern = re.compile("(?:.*/)?" + glob_pattern(rel).pattern)
    return any(pattern.fullmatch(p) for p in paths)


def resolve(path: str, *, strict_relative: bool) -> str | None:
    """Why ``path`` names nothing in the tree; None when it does, or when it is not a
    reference to the tree at all."""
    if allowed(path):
        return None
    first = path.split("/", 1)[0]
    rest = path.split("/", 1)[1] if "/" in path else ""
    roots = import_roots()
    if first in roots and rest:
        return None if present(f"{roots[first]}/{rest}") else f"no such path in {first}"
    if first in top_level() and (rest or "." in first):
        return None if present(path) else "no such path from the repository's root"
    if "/" in path.rstrip("/"):
        if first in (".", ".."):
            return None  # relative to a working directory the text names
        if not strict_relative and not path.endswith(("/", *SOURCE_SUFFIXES)):
            return None  # `DIR/prefill.csv`, `K/V`, `tp/pp`: examples and words
        return None if ends_some_path(path) else "no file or folder in the tree ends so"
    if path.endswith(SOURCE_SUFFIXES) and not path.startswith("."):  # `.pyx`: a kind
        _, names = tree()
        pattern = glob_pattern(path)
        return None if any(pattern.fullmatch(n) for n in names) else "no file of that name"
    return None


def check_dotted(ref: str) -> str | None:
    """Why a dotted name that starts at an import package names nothing."""
    parts = ref.split(".")
    folder = import_roots()[parts[0]]
    for i, name in enumerate(parts[1:], start=1):
        if present(f"{folder}/{name}/__init__.py"):
            folder = f"{folder}/{name}"
            continue
        if any(present(f"{folder}/{name}{s}") for s in (".py", ".pyx", ".pyi")):
            return None  # a module: what follows is an attribute
        if i == len(parts) - 1:
            return None  # the last name may be an attribute the package exports
        return f"{'.'.join(parts[: i + 1])} is neither a package nor a module"
    return None


def heading_anchors(text: str) -> frozenset[str]:
    """GitHub's slugs of the headings of ``text``: lower case, punctuation dropped, spaces to
    "-", a repeated slug numbered."""
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)).replace("`", "")
        slug = "".join(
            c for c in title.lower() if c in "-_ " or unicodedata.category(c)[0] in "LN"
        ).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return frozenset(seen)


@cache
def anchors_of(path: Path) -> frozenset[str]:
    return heading_anchors(path.read_text(encoding="utf-8"))


def check_link(folder: Path, own: frozenset[str], target: str) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
        return None  # http:, https:, mailto:
    file, _, anchor = target.partition("#")
    if not file:
        return None if anchor in own else f"no heading with anchor #{anchor} here"
    path = (folder / file).resolve()
    if path.is_relative_to(ROOT) and allowed(path.relative_to(ROOT).as_posix()):
        return None
    if not path.exists():
        return "no such file"
    if anchor and path.suffix == ".md" and anchor not in anchors_of(path):
        return f"no heading with anchor #{anchor} in {path.name}"
    return None


def tree_entries(block: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(line, path) of each entry of a module tree; nothing when the block is not one."""
    lines = [(n, t) for n, t in block if t.strip()]
    if not lines:
        return
    head = lines[0][1].split()[0]
    if not TREE_NAME.fullmatch(head):
        return
    if head.endswith("/"):
        if not ends_some_path(head):
            return  # not a folder of this tree: a diagram or an example
    elif not (head in top_level() and present(head)):
        return
    stack: list[tuple[int, str]] = [(-1, "")]
    for number, text in lines:
        names: list[str] = []
        # Names are the first column: the first token, then tokens at most two spaces (or a
        # comma) apart that are source files or folders; the description comes after.
        for gap, token in re.findall(r"(\s*)(\S+)", text):
            token = token.rstrip(",")
            if not names:
                if not (TREE_NAME.fullmatch(token) and ("/" in token or HAS_SUFFIX.search(token))):
                    break
            elif len(gap) > 2 or not (
                TREE_NAME.fullmatch(token) and token.endswith(("/", *SOURCE_SUFFIXES))
            ):
                break
            names.append(token)
        if not names:
            continue  # a description's continuation line
        indent = len(text) - len(text.lstrip(" "))
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        for name in names:
            yield number, parent + name
        if len(names) == 1 and names[0].endswith("/"):
            stack.append((indent, parent + names[0]))


def scan(text: str, name: str, folder: Path) -> Iterator[Missing]:
    """What ``text`` (the doc ``name``, in ``folder``) names that does not exist."""
    own = heading_anchors(text)
    roots = import_roots()
    block: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if m := FENCE.match(line):
            if fence is None:
                fence, block = m.group(2), []
            else:
                if fence in ("", "text"):
                    for at, path in tree_entries(block):
                        if why := resolve(path, strict_relative=True):
                            yield Missing(name, at, path, why)
                fence = None
            continue
        if fence is not None:
            block.append((number, line))
            continue
        for m in LINK.finditer(line):
            if why := check_link(folder, own, m.group(1)):
                yield Missing(name, number, m.group(1), why)
        for span in CODE_SPAN.finditer(LINK.sub("", line)):
            for token in span.group(2).split():
                token = LINE_SUFFIX.sub("", token.strip("()[]{},;'\"").rstrip(".:"))
                if DOTTED.fullmatch(token) and token.split(".", 1)[0] in roots:
                    why = check_dotted(token)
                elif PATH_TOKEN.fullmatch(token) and token not in (".", ".."):
                    why = resolve(token, strict_relative=False)
                else:
                    why = None
                if why:
                    yield Missing(name, number, token, why)


def test_every_path_the_docs_name_exists() -> None:
    missing = [
        str(p)
        for doc in docs()
        for p in scan(doc.read_text(encoding="utf-8"), doc.relative_to(ROOT).as_posix(), doc.parent)
    ]
    assert not missing, "the docs name what does not exist:\n" + "\n".join(missing)


PROBE = """\
# Probe
[ok](ARCHITECTURE.md#module-map) [gone](nope.md) [here](#probe) [x](#nope) [y](pd.md#nope)
`noxfile.py` `benchmarks/no_such.py` `tspd_core/sched/pool.py` `README.md`
`tspd_core/sched/no_such.py` `sched/keys.py` `sched/no_such.py` `keys.py:90` `sched/_*.pyx`
`no_such_policies.py` `tspd_core.pd.proc.forkserver` `tspd_core.pd.no_such.x` `tspd_core.pd.X`
`bench-results/x.json` `DIR/prefill.csv` `P/D` `config.json` `../shared/a/b.py` `/tmp/x.py`
```
tspd_core/sched/
  pool.py keys.py   fine
  no_such.py        gone
  no_such_dir/      gone too
    x.py            under it
                    a description, then/a/path.py
```
"""


def test_the_checker_finds_what_is_missing() -> None:
    """The checker on each kind of reference, present and missing."""
    found = [(p.line, p.ref) for p in scan(PROBE, "probe.md", ROOT / "docs")]
    assert found == [
        (2, "nope.md"),
        (2, "#nope"),
        (2, "pd.md#nope"),
        (3, "benchmarks/no_such.py"),
        (4, "tspd_core/sched/no_such.py"),
        (4, "sched/no_such.py"),
        (5, "no_such_policies.py"),
        (5, "tspd_core.pd.no_such.x"),
        (10, "tspd_core/sched/no_such.py"),
        (11, "tspd_core/sched/no_such_dir/"),
        (12, "tspd_core/sched/no_such_dir/x.py"),
    ]
