"""The `search` env's world: a seeded synthetic encyclopedia of fictional countries, cities,
people, companies and inventions, one fact per short passage, and the questions it answers.

Everything comes from one `random.Random(seed)` over fixed word lists (no `hash()` of str, no
files, no network), so every machine builds the same corpus. Names are made-up words, so a model
cannot know an answer before it has retrieved the passage that states it.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from functools import lru_cache

BASE_PASSAGES = 2000  # the entity counts below make exactly this many passages
BASE_COUNTS = {"countries": 30, "cities": 240, "rivers": 60, "people": 500, "companies": 150, "inventions": 160}
ONSETS = "b br c ch d dr f g gr h j k kl l m n p pr r s sh st t tr v w z".split()
VOWELS = "a e i o u a e i o u ea ou".split()
CODAS = ["", "", "", "n", "r", "l", "s", "th", "nd", "rk", "m", "v"]
COUNTRY_ENDINGS = ["ia", "land", "mark", "ora"]
CITY_ENDINGS = ["port", "ford", "holm", "ton", "by", "", ""]
COMPANY_KINDS = ["Labs", "Systems", "Works", "Motors", "Foods", "Textiles", "Shipping", "Mills"]
DEVICES = ["loom", "valve", "lens", "pump", "engine", "lamp", "compass", "kiln", "clock", "press"]
PROFESSIONS = ["chemist", "architect", "painter", "sailor", "surgeon", "poet", "engineer", "astronomer",
               "weaver", "composer", "botanist", "merchant"]
# corpus and question words a made-up name must never equal (it would blur retrieval)
RESERVED = {"born", "worked", "founded", "headquartered", "invented", "city", "river", "capital", "country",
            "independence", "gained", "whose", "which", "where", "what", "year", "lie", "lies", "founder",
            "inventor", "work", "was", "who", "the", "and", "an", "a", "in", "on", "of", "is", "by", "as"}


@dataclass(frozen=True)
class Passage:
    title: str
    text: str

    def __str__(self) -> str:
        return f"{self.title}: {self.text}"


@dataclass(frozen=True)
class Question:
    """A question, its answer, and per hop the oracle's query and the passage (index) it must find."""

    question: str
    answer: str
    queries: tuple[str, ...]
    gold: tuple[int, ...]
    relation: str


@dataclass(frozen=True)
class Corpus:
    passages: tuple[Passage, ...]
    questions: tuple[Question, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256("\n".join(map(str, self.passages)).encode()).hexdigest()


@dataclass
class _Builder:
    draw: random.Random
    used: set[str] = field(default_factory=lambda: set(RESERVED))
    passages: list[Passage] = field(default_factory=list)

    def word(self, syllables: int, ending: str = "") -> str:
        """A fresh made-up word, never used before in this world."""
        while True:
            stem = "".join(self.draw.choice(ONSETS) + self.draw.choice(VOWELS) for _ in range(syllables))
            word = (stem + self.draw.choice(CODAS) + ending).capitalize()
            if word.lower() not in self.used and len(word) <= 11:
                self.used.add(word.lower())
                return word

    def add(self, title: str, text: str) -> int:
        self.passages.append(Passage(title, text))
        return len(self.passages) - 1


def entity_counts(passages: int) -> dict[str, int]:
    """Entity counts scaled so the world has at least `passages` passages."""
    return {kind: math.ceil(count * passages / BASE_PASSAGES) for kind, count in BASE_COUNTS.items()}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _people(b: _Builder, count: int) -> list[str]:
    """Unique full names from small pools of first and last names (so names share words)."""
    firsts = [b.word(b.draw.choice((1, 2))) for _ in range(max(20, count // 8))]
    lasts = [b.word(2) for _ in range(max(40, count // 3))]
    names: dict[str, None] = {}  # insertion-ordered set
    while len(names) < count:
        names[f"{b.draw.choice(firsts)} {b.draw.choice(lasts)}"] = None
    return list(names)


def _single(question: str, answer: str, query: str, gold: int, relation: str) -> Question:
    return Question(question, answer, (query,), (gold,), relation)


def _hop(question: str, first: Question, second: Question, relation: str) -> Question:
    """A two-hop question: the first question's answer is what the second one asks about."""
    return Question(question, second.answer, first.queries + second.queries, first.gold + second.gold, relation)


def build_world(passages: int, seed: int) -> Corpus:
    b = _Builder(random.Random(seed))
    counts = entity_counts(passages)
    draw = b.draw
    countries = [b.word(2, draw.choice(COUNTRY_ENDINGS)) for _ in range(counts["countries"])]
    cities = [b.word(2, draw.choice(CITY_ENDINGS)) for _ in range(counts["cities"])]
    rivers = [b.word(2) for _ in range(counts["rivers"])]
    people = _people(b, counts["people"])
    companies = [f"{b.word(2)} {draw.choice(COMPANY_KINDS)}" for _ in range(counts["companies"])]
    inventions = [f"{b.word(draw.choice((1, 2)))} {draw.choice(DEVICES)}" for _ in range(counts["inventions"])]

    country_of = {city: countries[i % len(countries)] for i, city in enumerate(cities)}
    capital_of = {country: cities[i] for i, country in enumerate(countries)}  # each country's first city
    ask: dict[str, list[Question]] = {}  # per entity, the single-hop questions about it
    for country in countries:
        capital = b.add(country, f"{country} is a country whose capital is {capital_of[country]}.")
        year = draw.randint(1750, 1990)
        independence = b.add(country, f"{country} gained independence in {year}.")
        ask[country] = [
            _single(f"What is the capital of {country}?", capital_of[country], f"{country} capital", capital, "capital"),
            _single(f"In what year did {country} gain independence?", str(year), f"{country} independence",
                    independence, "independence_year")]
    for city in cities:
        river, year = draw.choice(rivers), draw.randint(800, 1750)
        place = b.add(city, f"{city} is a city in {country_of[city]}, on the {river} River.")
        founding = b.add(city, f"{city} was founded in {year}.")
        ask[city] = [
            _single(f"In which country is {city}?", country_of[city], f"{city} city", place, "city_country"),
            _single(f"On which river does {city} lie?", f"{river} River", f"{city} river", place, "city_river"),
            _single(f"In what year was {city} founded?", str(year), f"{city} founded", founding, "city_year")]
    for person in people:
        city, year, job = draw.choice(cities), draw.randint(1800, 1960), draw.choice(PROFESSIONS)
        birth = b.add(person, f"{person} was born in {city} in {year}.")
        work = b.add(person, f"{person} worked as {_article(job)} {job}.")
        ask[person] = [
            _single(f"Where was {person} born?", city, f"{person} born", birth, "birth_city"),
            _single(f"In what year was {person} born?", str(year), f"{person} born", birth, "birth_year"),
            _single(f"What did {person} work as?", job, f"{person} worked", work, "profession")]
    founder_of, headquarters_of, inventor_of = {}, {}, {}
    for company in companies:
        founder_of[company], headquarters_of[company] = draw.choice(people), draw.choice(cities)
        year = draw.randint(1850, 2010)
        founding = b.add(company, f"{company} was founded by {founder_of[company]} in {year}.")
        seat = b.add(company, f"{company} is headquartered in {headquarters_of[company]}.")
        ask[company] = [
            _single(f"Who founded {company}?", founder_of[company], f"{company} founded", founding, "founder"),
            _single(f"In what year was {company} founded?", str(year), f"{company} founded", founding, "company_year"),
            _single(f"Where is {company} headquartered?", headquarters_of[company], f"{company} headquartered",
                    seat, "headquarters")]
    for invention in inventions:
        inventor_of[invention], year = draw.choice(people), draw.randint(1820, 2000)
        made = b.add(invention, f"The {invention} was invented by {inventor_of[invention]} in {year}.")
        ask[invention] = [
            _single(f"Who invented the {invention}?", inventor_of[invention], f"{invention} invented", made, "inventor"),
            _single(f"In what year was the {invention} invented?", str(year), f"{invention} invented", made,
                    "invention_year")]

    hops: dict[str, list[Question]] = {entity: [] for entity in ask}  # per entity, its two-hop questions
    for company in companies:
        founded, founder, seat = ask[company][0], ask[founder_of[company]], ask[company][2]
        hops[company] = [
            _hop(f"In which city was the founder of {company} born?", founded, founder[0], "founder_birth_city"),
            _hop(f"In what year was the founder of {company} born?", founded, founder[1], "founder_birth_year"),
            _hop(f"In which country is {company} headquartered?", seat, ask[headquarters_of[company]][0],
                 "headquarters_country")]
    for invention in inventions:
        invented, inventor = ask[invention][0], ask[inventor_of[invention]]
        hops[invention] = [
            _hop(f"Where was the inventor of the {invention} born?", invented, inventor[0], "inventor_birth_city"),
            _hop(f"What did the inventor of the {invention} work as?", invented, inventor[2], "inventor_profession")]
    for city in cities:
        if capital_of[country_of[city]] != city:
            hops[city] = [_hop(f"What is the capital of the country where {city} lies?", ask[city][0],
                               ask[country_of[city]][0], "capital_of_country")]
    # one single-hop question per entity, and one two-hop question where the entity has any
    questions = [draw.choice(ask[entity]) for entity in ask]
    questions += [draw.choice(hops[entity]) for entity in ask if hops[entity]]
    return Corpus(tuple(b.passages), tuple(questions))


@lru_cache(maxsize=4)
def corpus(passages: int, seed: int) -> Corpus:
    """The world of a config, built once per process."""
    return build_world(passages, seed)
