"""The documents hold what the code does, and cite nothing outside the repository.

The documents hold what the code does: docs/troubleshooting.md quotes messages the code prints (each
quoted message an instance of a string in the code, its `...` standing for elided text and the
code's {placeholders} for the example values the page shows), every link and cited file resolves
inside the repository, and nothing points outside it."""

import ast
import re

from conftest import REPO

WILD = None  # a placeholder of an f-string: any text


def code_patterns() -> list[list]:
    """Every string literal in our modules as a list of characters and WILDs."""
    patterns = []
    for path in [*REPO.glob("*.py"), *REPO.glob("families/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                patterns.append(list(node.value))
            elif isinstance(node, ast.JoinedStr):
                pattern = []
                for part in node.values:
                    pattern += list(part.value) if isinstance(part, ast.Constant) else [WILD]
                patterns.append(pattern)
    return [p for p in patterns if sum(c is not WILD for c in p) >= 8]


def literal_match(piece: str, pattern: list) -> int:
    """The most characters of `piece` matched by literal characters of one stretch of `pattern`, the
    rest taken by its WILDs; -1 when no stretch of it fits."""
    # best[i]: piece[:i] consumed, ending at the current pattern position
    best = [-1] * (len(piece) + 1)
    result = -1
    for token in pattern + [WILD]:
        best[0] = max(best[0], 0)  # a match may start at any position of the pattern
        if token is WILD:
            for i in range(1, len(piece) + 1):
                best[i] = max(best[i], best[i - 1])  # the placeholder takes piece[i - 1]
        result = max(result, best[len(piece)])
        if token is not WILD:
            best = [-1] + [
                best[i - 1] + 1 if best[i - 1] >= 0 and piece[i - 1] == token else -1
                for i in range(1, len(piece) + 1)
            ]
        result = max(result, best[len(piece)])
    return result


DOCUMENTS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted(REPO.glob("docs/**/*.md"))]


def troubleshooting_rows() -> list[str]:
    """The rows of every table on the troubleshooting page (its header and rule rows left out)."""
    page = (REPO / "docs/troubleshooting.md").read_text()
    return [
        line
        for line in page.splitlines()
        if line.startswith("| ") and not line.startswith(("| message", "| ---"))
    ]


def quoted_messages() -> list[str]:
    messages = [row.split(" | ")[0] for row in troubleshooting_rows()]
    return [quote for message in messages for quote in re.findall(r"`([^`]+)`", message)]


def found_in_code(piece: str, patterns: list[list], texts: list[str]) -> bool:
    """Wholly literal, or a quarter of it literal with the rest taken by placeholders (an example
    value, or a helper's clause such as " (did you mean ...?)"); a stale message scores far below.

    `texts` are the patterns as strings, a placeholder as NUL."""
    if any(piece in text for text in texts):  # wholly literal in one stretch: literal_match's best
        return True
    # candidates share a few characters with the piece: the search stays quick
    n = min(4, len(piece))
    grams = {piece[i : i + n] for i in range(len(piece) - n + 1)}
    shared = [(sum(g in text for g in grams), p) for p, text in zip(patterns, texts)]
    # the likeliest first, and the first that fits ends the search
    candidates = (p for count, p in sorted(shared, key=lambda c: -c[0]) if count)
    fits = lambda best: best == len(piece) or (best >= 8 and best >= 0.25 * len(piece))
    return any(fits(literal_match(piece, p)) for p in candidates)


def test_troubleshooting_quotes_what_the_code_prints():
    patterns = code_patterns()
    texts = ["".join(c or "\0" for c in p) for p in patterns]
    pieces = [(m, p) for m in quoted_messages() for p in m.split("...") if p.strip(" .,:;()")]
    assert len(pieces) > 20
    unfound = [(message, piece) for message, piece in pieces if not found_in_code(piece, patterns, texts)]
    assert unfound == []


def test_out_of_memory_comes_first():
    """Out of memory is the first group of the troubleshooting page.

    The first thing a user who hit a wall looks for is the first group of the troubleshooting page.
    """
    page = (REPO / "docs/troubleshooting.md").read_text()
    assert re.findall(r"^### (.+)$", page, flags=re.M)[0] == "Out of memory"
    assert "out of memory" in troubleshooting_rows()[0].lower()


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_the_documents_resolves():
    """Every link in the documents resolves to a file and heading of the repository.

    README.md, BENCHMARKS.md and every page under docs/: each relative link (inline or a reference
    definition) names a file of the repository, and each #anchor a heading of its page."""
    broken = []
    for doc in DOCUMENTS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]: (\S+)$", text, flags=re.M)
        for target in targets:
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or not file.resolve().is_relative_to(REPO.resolve()):
                broken.append((doc.name, target))
            elif anchor and anchor not in map(slug, re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)):
                broken.append((doc.name, target))
    assert len(DOCUMENTS) > 10 and broken == []


def test_what_the_code_and_documents_cite_lives_in_the_repository():
    """Every document the code, tests, configs or documents cite lives in the repository.

    A clone has nothing beside it: no file points at the project's shared folder, and every document
    named in the code, the tests, the configs or the documents (a path ending in .md) is a file of
    the repository, named from the repository's root (or, in a document, from its own folder)."""
    patterns = (
        "*.py",
        "families/*.py",
        "tools/*.py",
        "bench/*.py",
        "bench/*.sh",
        "tests/*.py",
        "configs/*.toml",
        "*.sh",
        "requirements*.txt",
    )
    code = [path for pattern in patterns for path in REPO.glob(pattern)]
    assert [path.name for path in code + DOCUMENTS if re.search(r"\.\./shared", path.read_text())] == []
    missing = []
    for path in code + DOCUMENTS:
        text = path.read_text()
        # A markdown link's text and target are checked by the link test (config.py writes one
        # page's).
        text = re.sub(r"\[[^\]]*\](\([^)]*\)|\[[^\]]*\])", "", text)
        text = re.sub(r"^\[[^\]]+\]: \S+$", "", text, flags=re.M)
        bases = [REPO] + ([path.parent] if path.suffix == ".md" else [])
        for cited in re.findall(r"(?<![\w/.<>-])\w[\w./-]*\.md\b", text):
            if not any((base / cited).is_file() for base in bases):
                missing.append((path.name, cited))
    assert missing == []
