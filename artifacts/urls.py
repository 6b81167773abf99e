"""Credentials in URLs: which URLs hold them (a spec, a store URI or its options that name one is
refused) and their text hidden wherever an error message may carry a URL (endpoint and store errors
reach Prefect states, logs and run summaries).

The rule. A URL holds credentials when
- it has user-info: anything before an `@` in its host part (`https://user:password@host`,
  `https://TOKEN@host`, `abfs://container@account` too: give the account as `account_name`);
- or a query or fragment parameter whose name looks secret. The name (percent-decoded) is split into
  words at `-`, `_`, `.` and where lower case turns upper (`api_key`, `apiKey`: api, key); it looks
  secret when a word ends in key, token, secret or password (`key`, `apikey`, `access_token`,
  `client_secret`), or is sig, signature, auth, authorization, credential(s), passwd, pwd, pass,
  jwt or bearer (Azure SAS's `sig`), or when the name starts with `X-Amz-` or `X-Goog-` (a presigned
  URL's parts).
Scrubbing replaces the user-info and those parameters' values with `***`; a URL holds credentials
exactly when scrubbing changes it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

HIDDEN = "***"
SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
# the user-info runs to the host part's last `@` (a password may hold a raw `@`), never past its end
USER_INFO = re.compile(rf"({SCHEME})[^/?#\\\s'\"<>]*@")
# a value ends where the URL's parameter does, or where the message around the URL goes on (a
# bracket, a comma, a colon or full stop before a space: `{url}: cannot reach`)
PARAMETER = re.compile(r"([?&;#])([^=&;#\s'\"<>]+)=((?:[^&;#\s'\"<>()\[\]{},\\:.]|[:.](?!\s|$))*)")
WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")  # apiKey, APIKey, API_KEY: api, key
SECRET_ENDINGS = ("key", "token", "secret", "password")
SECRET_WORDS = {"sig", "signature", "auth", "authorization", "credential", "credentials", "passwd", "pwd", "pass",
                "jwt", "bearer"}
SIGNED_URL_PREFIXES = ("x-amz-", "x-goog-")
CREDENTIALS = "the URL holds credentials (user:password@ or a secret-looking query parameter such as api_key)"


def scrub_urls(text: str) -> str:
    """`text` with every URL's user-info and secret-looking parameter values replaced by `***`."""
    text = USER_INFO.sub(rf"\g<1>{HIDDEN}@", text)
    return PARAMETER.sub(_hide_secret_value, text)


def holds_credentials(value: str) -> bool:
    """Whether `value` is a URL (`scheme://...`) that holds credentials (the rule above)."""
    return re.match(SCHEME, value) is not None and scrub_urls(value) != value


def credential_url_fields(tree, path: str = "") -> list[str]:
    """The paths (`stages[2].rollout.endpoint`, `storage_options.endpoint_url`) of the strings of a
    parsed YAML or JSON tree that are URLs holding credentials."""
    if isinstance(tree, str):
        return [path] if holds_credentials(tree) else []
    if isinstance(tree, dict):
        return [found for key, value in tree.items()
                for found in credential_url_fields(value, f"{path}.{key}" if path else str(key))]
    if isinstance(tree, list):
        return [found for i, value in enumerate(tree) for found in credential_url_fields(value, f"{path}[{i}]")]
    return []


def secret_looking(name: str) -> bool:
    """Whether a URL parameter's name looks like it holds a secret (the rule above)."""
    name = unquote(name)
    if name.lower().startswith(SIGNED_URL_PREFIXES):
        return True
    words = [word.lower() for word in WORD.findall(name)]
    return any(word.endswith(SECRET_ENDINGS) or word in SECRET_WORDS for word in words)


def _hide_secret_value(match: re.Match) -> str:
    lead, name, value = match.groups()
    return f"{lead}{name}={HIDDEN}" if value and secret_looking(name) else match.group(0)


class ScrubbedError(Exception):
    """An error whose text shows no URL's credentials, whoever formats it (a base for the error
    classes whose messages name an endpoint or a store)."""

    def __init__(self, *args):
        super().__init__(*(scrub_urls(arg) if isinstance(arg, str) else arg for arg in args))
