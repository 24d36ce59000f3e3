"""Readers for the offline text: WordNet's data files and the fortune collections.

Both are parsed from their plain Debian files; nothing is downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# WordNet 3.0 lexicographer files, by number (lexnames(5WN)); Debian's wordnet-base omits the lexnames file.
LEXNAMES = [
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
]

_DOMAIN_MARKER = re.compile(r"^\s*\([^)]*\)\s*")


@dataclass(frozen=True)
class Synset:
    offset: str
    pos: str
    lexname: str
    words: tuple[str, ...]
    definition: str  # the gloss without its quoted examples
    topic_domain: str | None  # offset of the ";c" (topic domain) target, if any


def read_synsets(wordnet_dir: Path, pos: str) -> list[Synset]:
    """All synsets of one part of speech ("noun", "verb", ...) in file order."""
    synsets = []
    with (wordnet_dir / f"data.{pos}").open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("  "):  # licence header
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            offset, lex_filenum, word_count = fields[0], int(fields[1]), int(fields[3], 16)
            words = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(word_count))
            cursor = 4 + 2 * word_count
            pointer_count = int(fields[cursor])
            topic = None
            for i in range(pointer_count):
                symbol, target = fields[cursor + 1 + 4 * i], fields[cursor + 2 + 4 * i]
                if symbol == ";c" and topic is None:
                    topic = target
            definition = gloss.split('; "')[0].strip().rstrip(";").strip()
            synsets.append(Synset(offset, pos, LEXNAMES[lex_filenum], words, definition, topic))
    return synsets


def strip_domain_marker(definition: str) -> str:
    """``"(law) a rule ..."`` -> ``"a rule ..."``: the marker would give the domain label away."""
    return _DOMAIN_MARKER.sub("", definition, count=1)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def read_fortunes(path: Path, *, min_chars: int = 20, max_chars: int = 300) -> list[str]:
    """The entries of one fortune file (``%``-separated), whitespace-normalised, of moderate length.

    The ``.u8`` twin is preferred where it exists because the plain file may be Latin-1."""
    twin = path.with_name(path.name + ".u8")
    text = _decode((twin if twin.exists() else path).read_bytes())
    entries = []
    for entry in re.split(r"^%\s*$", text, flags=re.MULTILINE):
        cleaned = " ".join(entry.split())
        if min_chars <= len(cleaned) <= max_chars:
            entries.append(cleaned)
    return entries


def fortune_files(folder: Path) -> list[Path]:
    """The fortune text files of a folder (no ``.dat`` indexes, no ``.u8`` twins, no sub-folders)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix not in (".dat", ".u8") and not p.name.endswith("-pre") and not p.is_symlink()
    )
