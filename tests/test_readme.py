"""The README's troubleshooting table quotes messages the code prints: each quoted message must be an
instance of a string in the code, its `...` standing for elided text and the code's {placeholders}
for the example values the README shows."""

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
    best = [-1] * (len(piece) + 1)  # best[i]: piece[:i] consumed, ending at the current pattern position
    result = -1
    for token in pattern + [WILD]:
        best[0] = max(best[0], 0)  # a match may start at any position of the pattern
        if token is WILD:
            for i in range(1, len(piece) + 1):
                best[i] = max(best[i], best[i - 1])  # the placeholder takes piece[i - 1]
        result = max(result, best[len(piece)])
        if token is not WILD:
            best = [-1] + [best[i - 1] + 1 if best[i - 1] >= 0 and piece[i - 1] == token else -1
                           for i in range(1, len(piece) + 1)]
        result = max(result, best[len(piece)])
    return result


def quoted_messages() -> list[str]:
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Troubleshooting"):readme.index("## Tests and benchmarks")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| message")]
    return [quote for row in rows for quote in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def found_in_code(piece: str, patterns: list[list]) -> bool:
    """Wholly literal, or a quarter of it literal with the rest taken by placeholders (an example
    value, or a helper's clause such as " (did you mean ...?)"); a stale message scores far below."""
    n = min(4, len(piece))  # candidates share a few characters with the piece: the search stays quick
    grams = {piece[i:i + n] for i in range(len(piece) - n + 1)}
    texts = ["".join(c or "\0" for c in p) for p in patterns]
    best = max([literal_match(piece, p) for p, text in zip(patterns, texts) if any(g in text for g in grams)] + [-1])
    return best == len(piece) or (best >= 8 and best >= 0.25 * len(piece))


def test_troubleshooting_quotes_what_the_code_prints():
    patterns = code_patterns()
    pieces = [(m, p) for m in quoted_messages() for p in m.split("...") if p.strip(" .,:;()")]
    assert len(pieces) > 20
    assert [(message, piece) for message, piece in pieces if not found_in_code(piece, patterns)] == []


def test_what_the_code_cites_lives_in_the_repository():
    """The documents the code and tests point readers to are in the repository (a clone has nothing
    beside it)."""
    sources = {path: path.read_text() for pattern in ("*.py", "families/*.py", "tools/*.py", "bench/*.py", "tests/*.py")
               for path in REPO.glob(pattern)}
    assert [path.name for path, text in sources.items() if re.search(r"\.\./shared/", text)] == []
    cited = {doc for text in sources.values() for doc in re.findall(r"docs/models/[\w.-]+\.md", text)}
    assert cited and [doc for doc in sorted(cited) if not (REPO / doc).is_file()] == []
