"""Writes examples/mcp_tasks.jsonl, the tasks of pipelines/mcp.yaml over examples/mcp_notes_server.py
(run from the repository root: python examples/make_mcp_tasks.py).

Two families over the server's seed notes: read a named note and answer its text (read_note), and
find which note mentions a word and answer its title (search_notes). Each row has the prompt, the
`answer` the env's check compares with the model's last reply, the `oracle_calls` a teacher makes
(the SFT traces) and a `shortcut`: the reply of a teacher that answers without looking (the env's
`teacher_shortcut_rate` decides on which tasks it does). The env holds out a fifth of the rows by a
hash of their ids (eval_fraction).

A name is quoted at the very end of the prompt, as the call spells it ("gym", not gym): a small model
then copies the same tokens, found at the same place in every prompt, into the call's arguments (a
bare word tokenizes differently after a space)."""

import json
import random
from pathlib import Path

from mcp_notes_server import SEED_NOTES, code_notes

HERE = Path(__file__).parent
READ = ['Read me the note titled "{title}"', 'Show me the text of the note "{title}"', 'Open the note "{title}"',
        'Tell me what is written in the note "{title}"', 'What does it say, my note "{title}"',
        'I need the text of my note "{title}"']
SEARCH = ['Give the title of the note that mentions "{word}"', 'Name the note that contains "{word}"',
          'Which note is it that mentions "{word}"', 'Find the title of the note about "{word}"']
WORDS = {"wifi": ["password", "guest"], "dentist": ["Okafor", "appointment"], "alice": ["Alice"], "bob": ["Bob"],
         "parking": ["level 3", "car"], "gym": ["locker"], "recipe": ["flour", "Pancakes"], "books": ["Dune", "Emma"],
         "trip": ["Lyon", "platform"], "plants": ["fern", "cactus"], "birthday": ["Mum"], "bank": ["branch"]}


CODES = 100  # pipelines/mcp.yaml starts the server with --codes 100


def read_rows(notes: dict[str, str]) -> list[dict]:
    return [{"prompt": question.format(title=title), "answer": text,
             "oracle_calls": [{"name": "read_note", "arguments": {"title": title}}],
             "shortcut": f'You have no note titled "{title}".'}
            for title, text in notes.items() for question in READ]


def search_rows(words: dict[str, list[str]]) -> list[dict]:
    return [{"prompt": question.format(word=word), "answer": title,
             "oracle_calls": [{"name": "search_notes", "arguments": {"query": word}}],
             "shortcut": f'None of your notes mentions "{word}".'}
            for title, found in words.items() for word in found for question in SEARCH]


def tasks() -> list[dict]:
    codes = code_notes(CODES)
    rows = read_rows(SEED_NOTES) + search_rows(WORDS)
    rows += read_rows(codes) + search_rows({title: [text.split()[-1].rstrip(".")] for title, text in codes.items()})
    random.Random(0).shuffle(rows)
    return rows


if __name__ == "__main__":
    with open(HERE / "mcp_tasks.jsonl", "w") as out:
        for row in tasks():
            out.write(json.dumps(row) + "\n")
