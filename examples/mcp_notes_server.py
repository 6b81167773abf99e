"""A small MCP server to copy: notes kept in memory, a few tools over them (the `mcp` env's example,
pipelines/mcp.yaml, docs/MCP.md).

    python examples/mcp_notes_server.py              # over stdio (the env starts it)
    python examples/mcp_notes_server.py --http 8765  # streamable HTTP at http://127.0.0.1:8765/mcp
    python examples/mcp_notes_server.py --codes 100  # also 100 made-up code notes ("The vako code is 4821.")

It starts with the seed notes below; `reset` puts them back, so a server shared by many episodes
(`lifetime: shared`) starts each one from the same state. `notes_count` is a grader tool: what a
task's check can read at the end of an episode instead of the model's answer.
Needs only the `mcp` package (the env can run it in the sandbox with the project's venv bound read-only).
"""

from __future__ import annotations

import argparse
import random

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

SEED_NOTES = {
    "wifi": "The guest wifi password is maple-42.",
    "dentist": "Dentist appointment on Tuesday at 3pm with Dr. Okafor.",
    "alice": "Alice's phone number is 555-0134.",
    "bob": "Bob's phone number is 555-0178.",
    "parking": "The car is parked on level 3, spot C7.",
    "gym": "The gym locker code is 7719.",
    "recipe": "Pancakes need 2 eggs, 1 cup of flour and 1 cup of milk.",
    "books": "Books to read: Dune, Emma, Ulysses.",
    "trip": "The train to Lyon leaves at 08:15 from platform 9.",
    "plants": "Water the fern every 4 days and the cactus every 3 weeks.",
    "birthday": "Mum's birthday is on 12 March.",
    "bank": "The bank branch closes at 5pm on weekdays.",
}

server = MCPServer("notes", log_level="WARNING")  # a ToolError is the model's to read, not a log line
initial: dict[str, str] = dict(SEED_NOTES)  # what `reset` puts back: the seed notes, and --codes' notes
notes: dict[str, str] = dict(initial)


def code_notes(n: int) -> dict[str, str]:
    """`n` notes with made-up titles and codes, the same every time: many names a model cannot learn by
    heart, so it has to copy them from the prompt into its calls (pipelines/mcp.yaml)."""
    draw, made = random.Random(0), {}
    codes = draw.sample(range(1000, 10000), n)
    while len(made) < n:
        title = "".join(draw.choice("bdfgklmnprstvz") + draw.choice("aeiou") for _ in range(draw.choice((2, 3))))
        if title not in made and title not in SEED_NOTES:
            made[title] = f"The {title} code is {codes[len(made)]}."
    return made


@server.tool()
def list_notes() -> str:
    """The titles of all notes, one per line."""
    return "\n".join(sorted(notes)) or "(no notes)"


@server.tool()
def read_note(title: str) -> str:
    """The text of the note with this title."""
    if title not in notes:
        raise ToolError(f"no note titled {title!r}")
    return notes[title]


@server.tool()
def search_notes(query: str) -> str:
    """The titles of the notes whose title or text contains the query (case-insensitive), one per line."""
    found = [title for title, text in sorted(notes.items()) if query.lower() in f"{title} {text}".lower()]
    return "\n".join(found) or "(no match)"


@server.tool()
def add_note(title: str, text: str) -> str:
    """Save a note under a new title."""
    if title in notes:
        raise ToolError(f"a note titled {title!r} exists already")
    notes[title] = text
    return f"saved {title}"


@server.tool()
def delete_note(title: str) -> str:
    """Delete the note with this title."""
    if notes.pop(title, None) is None:
        raise ToolError(f"no note titled {title!r}")
    return f"deleted {title}"


@server.tool()
def notes_count() -> str:
    """How many notes there are (a grader reads it)."""
    return str(len(notes))


@server.tool()
def reset() -> str:
    """Back to the seed notes (between the episodes of a shared server)."""
    notes.clear()
    notes.update(initial)
    return "reset"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    parser.add_argument("--codes", type=int, default=0, metavar="N", help="also N made-up code notes (code_notes)")
    args = parser.parse_args()
    initial.update(code_notes(args.codes))
    notes.update(initial)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
