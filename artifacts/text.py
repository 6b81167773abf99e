"""Error text as one line."""

from artifacts.urls import scrub_urls


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message ("" if it has none), with no URL's credentials in it
    (artifacts/urls.py): it goes into errors that reach Prefect states, logs and summaries."""
    text = scrub_urls(str(error)).strip().splitlines()
    return text[0] if text else ""
