"""Every reference in the repository's documentation resolves inside the repository (issue 36): each relative link of
its Markdown files points to a file or folder that exists, and a link to a heading (`page.md#anchor`) to a heading of
that page; the README links every docs/ page; and every citation of the design page in the code
("docs/design.md section 2") names a section it has."""

import re
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = [
    REPO_ROOT / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    *sorted((REPO_ROOT / ".ci").glob("*.md")),
    *sorted((REPO_ROOT / "bench").rglob("*.md")),
    *sorted((REPO_ROOT / "examples").rglob("*.md")),
    *sorted((REPO_ROOT / "research").rglob("*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
CODE_FOLDERS = ("modeling_dint", "configuration", "conversion", "bench", "examples", "research", "tests", ".ci")
DESIGN_CITATION = re.compile(r"docs/design\.md,? sections? (?P<numbers>[\d, -]+\d)")


def prose(path: Path) -> str:
    """The text of a Markdown file outside its fenced code blocks (a link in code is code)."""
    return re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered (-1, -2, ...)."""
    seen, result = {}, set()
    for heading in re.findall(r"^#+ (.+?)\s*$", prose(path), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in (match["target"] for match in LINK.finditer(prose(path))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(REPO_ROOT)})")
    assert not broken, f"{path.relative_to(REPO_ROOT)}: links that do not resolve: {broken}"


def test_the_readme_links_every_docs_page():
    targets = (match["target"].partition("#")[0] for match in LINK.finditer(prose(REPO_ROOT / "README.md")))
    linked = {(REPO_ROOT / target).resolve() for target in targets}
    pages = sorted((REPO_ROOT / "docs").glob("*.md"))
    assert pages and not [page.name for page in pages if page.resolve() not in linked]


def test_every_design_citation_names_a_section_of_the_design():
    design = (REPO_ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    sections = {int(number) for number in re.findall(r"^## (\d+)\. ", design, flags=re.MULTILINE)}
    citations = []
    for folder in CODE_FOLDERS:
        for source in (REPO_ROOT / folder).rglob("*.py"):
            for match in DESIGN_CITATION.finditer(source.read_text(encoding="utf-8")):
                cited = set()
                for part in match["numbers"].replace(" ", "").split(","):
                    first, _, last = part.partition("-")
                    cited |= set(range(int(first), int(last or first) + 1))
                citations.append((source.relative_to(REPO_ROOT), cited))
    assert citations, "the code cites the design page"
    assert not [(source, cited - sections) for source, cited in citations if cited - sections]
