"""Generated terminal task families: many variants of each shell skill (count, find, sort,
rename, extract, fix a script, …) over generated files, so a held-out task tests the skill and
not the memory of a task.

A variant draws every file name, folder name and content word from its split's pool of made-up
words (envs/families.py), so no held-out variant shares a name or a content word with any train
variant. The `pipe` family chains a filter and a finishing step; its held-out
variants use the chains (`HELD_OUT_PIPES`) no train variant uses, each step of which the train
variants do use: held-out combinations of skills.

A variant is a Harbor task folder's content held in memory: the instruction, the setup files of
environment/, the hidden check (tests/test.sh) and the oracle's commands (solution/solve.sh).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import Field

from envs.families import EXTENSIONS, GeneratedTasks, Words, variant_words

TYPOS = ["ecoh", "ehco", "eho", "ecno"]  # what fix-script's broken line says for echo (never inside a word)


@dataclass(frozen=True)
class Variant:
    family: str
    instruction: str
    files: dict[str, str]  # environment/: path below /work -> text
    solution: tuple[str, ...]  # the oracle's commands, one action each
    test: str  # tests/test.sh; passes (exit 0) when the task is done


def holds(path: str, text: str) -> str:
    """A test line passing when the file at `path` holds exactly `text` (words, digits, newlines)."""
    return f"printf '{text.replace(chr(10), chr(92) + 'n')}' | cmp -s - {path}"


def holds_number(path: str, number: int) -> str:
    return f"[ \"$(tr -d ' \\n' < {path})\" = {number} ]"


def _test(*lines: str) -> str:
    return "#!/bin/bash\nset -e\ncd /work\n" + "\n".join(lines) + "\n"


def _lines(words: list[str]) -> str:
    return "".join(word + "\n" for word in words)


def count_files(d: random.Random, w: Words) -> Variant:
    folder, out, n = w(), w() + ".txt", d.randint(2, 9)
    files = {f"{folder}/{name}.{d.choice(EXTENSIONS)}": w() + "\n" for name in w.some(n)}
    return Variant("count-files", f"Write the number of files in {folder}/ to {out}.", files,
                   (f"ls {folder} | wc -l > {out}",), _test(holds_number(out, n)))


def count_lines(d: random.Random, w: Words) -> Variant:
    name, out, n = f"{w()}.txt", f"{w()}.txt", d.randint(2, 12)
    body = [w() for _ in range(n)]
    return Variant("count-lines", f"Write the number of lines in {name} to {out}.", {name: _lines(body)},
                   (f"wc -l < {name} > {out}",), _test(holds_number(out, n)))


def count_matches(d: random.Random, w: Words) -> Variant:
    name, out, target = f"{w()}.txt", f"{w()}.txt", w()
    others = w.some(4)
    body = [" ".join(d.sample(others + [target], d.randint(1, 3))) for _ in range(d.randint(4, 9))]
    count = sum(target in line.split() for line in body)
    return Variant("count-matches", f"Write how many lines of {name} contain {target} to {out}.",
                   {name: _lines(body)}, (f"grep -c {target} {name} > {out}",), _test(holds_number(out, count)))


def find_max(d: random.Random, w: Words) -> Variant:
    name, out = f"{w()}.txt", f"{w()}.txt"
    numbers = d.sample(range(1, 1000), d.randint(3, 9))
    return Variant("find-max", f"{name} holds one number per line. Write the largest to {out}.",
                   {name: _lines([str(n) for n in numbers])}, (f"sort -n {name} | tail -n 1 > {out}",),
                   _test(holds_number(out, max(numbers))))


def sort_lines(d: random.Random, w: Words) -> Variant:
    name, out = f"{w()}.txt", f"{w()}.txt"
    body = w.some(d.randint(3, 7))
    return Variant("sort-lines", f"Write the lines of {name} in alphabetical order to {out}.", {name: _lines(body)},
                   (f"sort {name} > {out}",), _test(holds(out, _lines(sorted(body)))))


def dedupe(d: random.Random, w: Words) -> Variant:
    name, out = f"{w()}.txt", f"{w()}.txt"
    distinct = w.some(d.randint(2, 5))
    body = distinct + d.choices(distinct, k=d.randint(2, 5))
    d.shuffle(body)
    return Variant("dedupe", f"Write the distinct lines of {name}, sorted, to {out}.", {name: _lines(body)},
                   (f"sort -u {name} > {out}",), _test(holds(out, _lines(sorted(distinct)))))


def rename_extension(d: random.Random, w: Words) -> Variant:
    folder, (old, new, other) = w(), d.sample(EXTENSIONS, 3)
    stems, kept = w.some(d.randint(2, 4)), w()
    files = {**{f"{folder}/{stem}.{old}": w() + "\n" for stem in stems}, f"{folder}/{kept}.{other}": w() + "\n"}
    expected = sorted([f"{stem}.{new}" for stem in stems] + [f"{kept}.{other}"])
    checks = [f"[ \"$(ls {folder} | sort | tr '\\n' ' ')\" = \"{' '.join(expected)} \" ]"]
    checks += [holds(f"{folder}/{stem}.{new}", files[f"{folder}/{stem}.{old}"]) for stem in stems]
    return Variant("rename-extension", f"Rename every .{old} file in {folder}/ to the same name ending in .{new}.",
                   files, (f'for f in {folder}/*.{old}; do mv "$f" "${{f%.{old}}}.{new}"; done',), _test(*checks))


def extract_column(d: random.Random, w: Words) -> Variant:
    name, out, header = f"{w()}.csv", f"{w()}.txt", w.some(3)
    rows = [[w() if c != 1 else str(d.randint(10, 99)) for c in range(3)] for _ in range(d.randint(2, 5))]
    k = d.randint(1, 3)
    body = _lines([",".join(header)] + [",".join(row) for row in rows])
    return Variant("extract-column", f"{name} has a header line. Write its column {k} ({header[k - 1]}), without the "
                   f"header, to {out}.", {name: body}, (f"tail -n +2 {name} | cut -d, -f{k} > {out}",),
                   _test(holds(out, _lines([row[k - 1] for row in rows]))))


def replace_word(d: random.Random, w: Words) -> Variant:
    name, old, new = f"{w()}.txt", w(), w()
    others = w.some(3)
    body = [" ".join(d.sample(others + [old], 3)) for _ in range(d.randint(2, 4))]
    body[0] = f"{old} {body[0]}" if old not in body[0] else body[0]
    return Variant("replace-word", f"In {name}, replace every '{old}' with '{new}' (edit the file in place).",
                   {name: _lines(body)}, (f"sed -i 's/{old}/{new}/g' {name}",),
                   _test(holds(name, _lines([line.replace(old, new) for line in body]))))


def head_lines(d: random.Random, w: Words) -> Variant:
    name, out = f"{w()}.txt", f"{w()}.txt"
    body, n = w.some(d.randint(4, 8)), d.randint(1, 3)
    return Variant("head-lines", f"Write the first {n} lines of {name} to {out}.", {name: _lines(body)},
                   (f"head -n {n} {name} > {out}",), _test(holds(out, _lines(body[:n]))))


def fix_script(d: random.Random, w: Words) -> Variant:
    script, out, said, typo = f"{w()}.sh", f"{w()}.txt", w.some(3), d.choice(TYPOS)
    broken = d.randrange(3)
    body = "".join(f"{typo if i == broken else 'echo'} {word}\n" for i, word in enumerate(said))
    return Variant("fix-script", f"{script} should print three words but one line has a typo. Fix {script}, then "
                   f"write its output to {out}.", {script: body},
                   (f"cat {script}", f"sed -i 's/{typo}/echo/' {script}", f"bash {script} > {out}"),
                   _test(holds(out, _lines(said)), f"bash {script} | cmp -s - {out}"))


def find_file(d: random.Random, w: Words) -> Variant:
    folder, target, out = w(), f"{w()}.{d.choice(EXTENSIONS)}", f"{w()}.txt"
    subfolders, content = w.some(3), w()
    where = f"{folder}/{'/'.join(d.sample(subfolders, d.randint(1, 3)))}/{target}"
    files = {where: content + "\n", **{f"{folder}/{sub}/{w()}.txt": w() + "\n" for sub in subfolders}}
    return Variant("find-file", f"Somewhere under {folder}/ is a file named {target}. Copy it to {out}.", files,
                   (f"cp \"$(find {folder} -name {target})\" {out}",), _test(holds(out, content + "\n")))


# pipe: FILTER then FINISH; the phrase, the command (with the variant's word) and what it does to the lines
FILTERS: dict[str, tuple[str, str, Callable[[list[str], str], list[str]]]] = {
    "sort": ("sort its lines", "sort {name}", lambda lines, word: sorted(lines)),
    "distinct": ("keep its distinct lines, sorted", "sort -u {name}", lambda lines, word: sorted(set(lines))),
    "grep": ("keep the lines containing {word}", "grep {word} {name}",
             lambda lines, word: [line for line in lines if word in line]),
}
FINISHES = {  # the phrase and the command of each finishing step
    "first": ("write the first {n} of them", "head -n {n}"),
    "count": ("write how many there are", "wc -l"),
    "last": ("write the last one", "tail -n 1"),
}
HELD_OUT_PIPES = {("sort", "count"), ("distinct", "last"), ("grep", "first")}


def pipe(d: random.Random, w: Words, split: str) -> Variant:
    chains = sorted((f, g) for f in FILTERS for g in FINISHES if ((f, g) in HELD_OUT_PIPES) == (split == "eval"))
    filter_name, finish_name = d.choice(chains)
    name, out, word, n = f"{w()}.txt", f"{w()}.txt", w(), d.randint(1, 3)
    others = w.some(4)
    body = [" ".join(d.sample(others + [word], 2)) for _ in range(d.randint(4, 8))]
    if not any(word in line for line in body):
        body[0] = f"{word} {others[0]}"
    f_phrase, f_command, f_apply = FILTERS[filter_name]
    g_phrase, g_command = FINISHES[finish_name]
    kept = f_apply(body, word)
    check = (holds_number(out, len(kept)) if finish_name == "count" else
             holds(out, _lines(kept[:n] if finish_name == "first" else kept[-1:])))
    instruction = (f"Take {name}, {f_phrase.format(word=word)}, then {g_phrase.format(n=n)} to {out}.")
    command = f"{f_command.format(name=name, word=word)} | {g_command.format(n=n)} > {out}"
    return Variant("pipe", instruction, {name: _lines(body)}, (command,), _test(check))


FAMILIES: dict[str, Callable[..., Variant]] = {
    "count-files": count_files, "count-lines": count_lines, "count-matches": count_matches, "find-max": find_max,
    "sort-lines": sort_lines, "dedupe": dedupe, "rename-extension": rename_extension,
    "extract-column": extract_column, "replace-word": replace_word, "head-lines": head_lines,
    "fix-script": fix_script, "find-file": find_file, "pipe": pipe,
}


def variant(family: str, split: str, index: int, seed: int) -> Variant:
    """Variant `index` of a family in a split: the same on every machine."""
    draw, words = variant_words(family, split, index, seed)
    return pipe(draw, words, split) if family == "pipe" else FAMILIES[family](draw, words)


class GeneratedTerminalTasks(GeneratedTasks):
    """`generated:` of a terminal env."""

    families: list[Literal[tuple(FAMILIES)]] = Field(default_factory=lambda: list(FAMILIES), min_length=1)
