"""Writes the example datasets of this folder (run from the repository root: python examples/make_examples.py).

Small arithmetic data in TRL's formats, so pipelines/your-data.yaml shows every path on this CPU:
chats.jsonl (conversational SFT: a system turn, one or two user/assistant exchanges),
preferences.jsonl (prompt, chosen, rejected: a right and a wrong answer) and prompts.jsonl
(prompt-only with an `answer` column, for the reward functions of my_rewards.py). Every
conversation starts with the same system turn."""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SYSTEM = "You are a calculator. Answer with the sum."


# sums a tiny model can learn in the example's budget: a number up to 20 plus one digit
def operands(draw: random.Random) -> tuple[int, int]:
    return draw.randint(1, 20), draw.randint(1, 9)


HERE = Path(__file__).parent
SYSTEM = "You are a calculator. Answer with the sum."


def answer(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}. The answer is {a + b}."


def chats(draw: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        (a, b), c = operands(draw), draw.randint(1, 9)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": answer(a, b)}]
        if draw.random() < 0.3:  # a follow-up turn
            messages += [{"role": "user", "content": f"And plus {c}?"},
                         {"role": "assistant", "content": answer(a + b, c)}]
        rows.append({"messages": messages})
    return rows


def preferences(draw: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = operands(draw)
        wrong = a + b + draw.choice([-10, -1, 1, 10])
        rows.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}],
                     "chosen": [{"role": "assistant", "content": answer(a, b)}],
                     "rejected": [{"role": "assistant", "content": f"{a} + {b} = {wrong}. The answer is {wrong}."}]})
    return rows


def prompts(draw: random.Random, n: int) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}],
             "answer": str(a + b)}
            for a, b in (operands(draw) for _ in range(n))]


def write(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write("chats.jsonl", chats(random.Random(0), 600))
    write("preferences.jsonl", preferences(random.Random(1), 300))
    write("prompts.jsonl", prompts(random.Random(2), 300))
