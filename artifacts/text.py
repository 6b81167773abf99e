"""Error text as one line."""


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message ("" if it has none)."""
    text = str(error).strip().splitlines()
    return text[0] if text else ""
