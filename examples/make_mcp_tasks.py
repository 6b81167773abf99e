"""Writes examples/mcp_tasks.jsonl, the tasks of pipelines/mcp.yaml over examples/mcp_notes_server.py
(run from the repository root: python examples/make_mcp_tasks.py).

Two families over the server's seed notes: read a named note and answer its text (read_note), and
find which note mentions a word and answer its title (search_notes). Each row has the prompt, the
`answer` the env's check compares with the model's last reply, and the `oracle_calls` a teacher
makes (the SFT traces). The env holds out a fifth of the rows by a hash of their ids (eval_fraction)."""

import json
import random
from pathlib import Path

from mcp_notes_server import SEED_NOTES

HERE = Path(__file__).parent
READ = ["What does my note '{title}' say?", "Read me the note titled {title}.", "Show the {title} note.",
        "I need my {title} note: what is in it?"]
SEARCH = ["Which note mentions '{word}'? Answer with its title.", "Find the note about {word}: what is its title?"]
WORDS = {"wifi": ["password", "guest"], "dentist": ["Okafor", "appointment"], "alice": ["Alice"], "bob": ["Bob"],
         "parking": ["level 3", "car"], "gym": ["locker"], "recipe": ["flour", "Pancakes"], "books": ["Dune", "Emma"],
         "trip": ["Lyon", "platform"], "plants": ["fern", "cactus"], "birthday": ["Mum"], "bank": ["branch"]}


def tasks() -> list[dict]:
    rows = [{"prompt": question.format(title=title), "answer": text,
             "oracle_calls": [{"name": "read_note", "arguments": {"title": title}}]}
            for title, text in SEED_NOTES.items() for question in READ]
    rows += [{"prompt": question.format(word=word), "answer": title,
              "oracle_calls": [{"name": "search_notes", "arguments": {"query": word}}]}
             for title, words in WORDS.items() for word in words for question in SEARCH]
    random.Random(0).shuffle(rows)
    return rows


if __name__ == "__main__":
    with open(HERE / "mcp_tasks.jsonl", "w") as out:
        for row in tasks():
            out.write(json.dumps(row) + "\n")
