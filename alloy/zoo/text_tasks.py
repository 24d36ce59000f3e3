"""The five text classification tasks of the ``encoder-5task`` preset, derived from WordNet and fortunes.

Every task has balanced classes and seeded per-class train/dev/test splits. WordNet glosses and English
fortunes are kept disjoint between tasks, so no example is shared by two tasks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from alloy.zoo.text_corpora import Synset, fortune_files, read_fortunes, read_synsets, strip_domain_marker

Example = tuple[str, int]  # (text, label index)


@dataclass
class TextTask:
    name: str
    description: str
    labels: list[str]
    label_texts: list[str]  # what the zero-shot head embeds for each class
    max_length: int
    splits: dict[str, list[Example]] = field(default_factory=dict)


@dataclass(frozen=True)
class SplitSizes:
    train: int
    dev: int
    test: int

    @property
    def total(self) -> int:
        return self.train + self.dev + self.test


NOUN_CLASSES = [
    "noun.animal",
    "noun.artifact",
    "noun.body",
    "noun.food",
    "noun.location",
    "noun.person",
    "noun.plant",
    "noun.substance",
]
VERB_CLASSES = [
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.contact",
    "verb.creation",
    "verb.motion",
    "verb.social",
]
FORTUNE_TOPICS = {
    "computers": "computers",
    "politics": "politics",
    "science": "science",
    "songs-poems": "songs and poems",
    "startrek": "star trek",
    "work": "work",
}
LANGUAGES = {"en": "English", "de": "German", "es": "Spanish", "it": "Italian"}

SIZES = {
    "wn_noun": SplitSizes(400, 25, 50),
    "wn_verb": SplitSizes(300, 25, 50),
    "wn_domain": SplitSizes(96, 20, 40),  # the 8th-largest topic domain has ~158 glosses
    "fortune_topic": SplitSizes(150, 25, 40),
    "lang_id": SplitSizes(300, 50, 100),
}


def _split_balanced(per_class: list[list[str]], sizes: SplitSizes, rng: random.Random) -> dict[str, list[Example]]:
    splits: dict[str, list[Example]] = {"train": [], "dev": [], "test": []}
    for label, texts in enumerate(per_class):
        unique = sorted(set(texts))
        if len(unique) < sizes.total:
            raise ValueError(f"class {label} has {len(unique)} texts, needs {sizes.total}")
        rng.shuffle(unique)
        splits["train"] += [(t, label) for t in unique[: sizes.train]]
        splits["dev"] += [(t, label) for t in unique[sizes.train : sizes.train + sizes.dev]]
        splits["test"] += [(t, label) for t in unique[sizes.train + sizes.dev : sizes.total]]
    for examples in splits.values():
        rng.shuffle(examples)
    return splits


def _lexname_task(name: str, synsets: list[Synset], classes: list[str], rng: random.Random) -> TextTask:
    per_class = [[s.definition for s in synsets if s.lexname == c] for c in classes]
    readable = [c.split(".", 1)[1] for c in classes]
    return TextTask(
        name=name,
        description=f"WordNet {classes[0].split('.')[0]} gloss -> lexicographer category",
        labels=readable,
        label_texts=readable,
        max_length=32,
        splits=_split_balanced(per_class, SIZES[name], rng),
    )


def _domain_task(nouns: list[Synset], others: list[Synset], rng: random.Random, classes: int = 8) -> TextTask:
    by_offset = {s.offset: s for s in nouns}  # topic domains are noun synsets; offsets are per part of speech
    grouped: dict[str, list[str]] = {}
    for s in nouns + others:
        target = by_offset.get(s.topic_domain or "")
        if target is not None:
            grouped.setdefault(target.words[0], []).append(strip_domain_marker(s.definition))
    needed = SIZES["wn_domain"].total
    ranked = sorted(
        (d for d, texts in grouped.items() if len(set(texts)) >= needed), key=lambda d: (-len(grouped[d]), d)
    )[:classes]
    ranked.sort()
    return TextTask(
        name="wn_domain",
        description="WordNet gloss (domain marker removed) -> topic domain",
        labels=ranked,
        label_texts=ranked,
        max_length=32,
        splits=_split_balanced([grouped[d] for d in ranked], SIZES["wn_domain"], rng),
    )


def build_text_tasks(wordnet_dir: Path, fortunes_dir: Path, seed: int = 0) -> dict[str, TextTask]:
    """The five tasks: wn_noun, wn_verb, wn_domain, fortune_topic, lang_id."""
    rng = random.Random(seed)
    nouns = read_synsets(wordnet_dir, "noun")
    verbs = read_synsets(wordnet_dir, "verb")
    modifiers = read_synsets(wordnet_dir, "adj") + read_synsets(wordnet_dir, "adv")
    # Glosses with a topic-domain link belong to wn_domain only.
    domain_task = _domain_task(nouns, verbs + modifiers, rng)
    plain_nouns = [s for s in nouns if s.topic_domain is None]
    plain_verbs = [s for s in verbs if s.topic_domain is None]
    tasks = {
        "wn_noun": _lexname_task("wn_noun", plain_nouns, NOUN_CLASSES, rng),
        "wn_verb": _lexname_task("wn_verb", plain_verbs, VERB_CLASSES, rng),
        "wn_domain": domain_task,
    }

    topic_texts = {topic: read_fortunes(fortunes_dir / topic) for topic in FORTUNE_TOPICS}
    tasks["fortune_topic"] = TextTask(
        name="fortune_topic",
        description="English fortune -> collection topic",
        labels=list(FORTUNE_TOPICS),
        label_texts=list(FORTUNE_TOPICS.values()),
        max_length=48,
        splits=_split_balanced(list(topic_texts.values()), SIZES["fortune_topic"], rng),
    )

    # English for language identification comes from collections fortune_topic does not use.
    used = set(FORTUNE_TOPICS)
    english = [t for p in fortune_files(fortunes_dir) if p.name not in used for t in read_fortunes(p)]
    per_language = {"en": english}
    for code in ("de", "es", "it"):
        per_language[code] = [t for p in fortune_files(fortunes_dir / code) for t in read_fortunes(p)]
    tasks["lang_id"] = TextTask(
        name="lang_id",
        description="fortune -> language (en/de/es/it)",
        labels=list(LANGUAGES),
        label_texts=list(LANGUAGES.values()),
        max_length=32,
        splits=_split_balanced(list(per_language.values()), SIZES["lang_id"], rng),
    )
    return tasks
