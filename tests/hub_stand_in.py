"""A local stand-in of the Hugging Face Hub's upload endpoints, for `posttrain export --push-to-hub`.

It answers the requests huggingface_hub 2.x's `create_repo` + `upload_folder` make (read
from its source: hf_api.py `create_repo`, _commit_api.py `_fetch_upload_modes` and `_send_commit`,
_upload_pipeline.py), as the Hub does, and checks the token on each (`Authorization: Bearer`):

- `POST /api/repos/create` {name, organization, type}: 200 {url}, 409 when the repo exists;
- `POST /api/validate-yaml` {content, repoType} (a README.md's metadata, before any upload): 200
  {warnings} for a mapping, 400 {errors} otherwise;
- `POST /api/models/<repo>/preupload/<revision>` {files: [{path, sample, size}]}: each file's
  uploadMode. The Hub answers `lfs` for large or binary files, which the client then uploads to
  the Xet storage service; this stand-in answers `regular` for every file, so their content comes
  base64 in the commit (the Xet protocol is not stood in for);
- `POST /api/models/<repo>/commit/<revision>`, ndjson: a `header` line {summary, description},
  then a `file` line {path, content, encoding: base64} per file: stored; 200 {commitUrl, commitOid}.

`GET /api/agent-harnesses` (a public registry the client reads once a day for its user agent)
answers an empty one. Anything else is a 404, logged in `requests` with the rest, so a test sees every call made.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading

import yaml
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


class HubStandIn:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> {path: content}
        self.commits: list[dict] = []  # each commit's header
        self.cards: list[dict] = []  # the metadata of each README.md validated
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        if (method, path) == ("GET", "/api/agent-harnesses"):  # public: the client's user-agent registry
            return 200, {"standardEnvVars": [], "harnesses": {}}
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {"error": "Invalid credentials in Authorization header"}
        if method == "POST" and path == "/api/repos/create":
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            if repo in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}
            self.repos[repo] = {}
            return 200, {"url": f"{self.url}/{repo}", "name": repo}
        if method == "POST" and path == "/api/validate-yaml":
            return self.validate_yaml(json.loads(body)["content"])
        match = re.fullmatch(rf"/api/models/{REPO}/(?P<what>preupload|commit)/(?P<revision>[^/]+)", path)
        if method != "POST" or match is None:
            return 404, {"error": f"no route {method} {path}"}
        if match["repo"] not in self.repos:
            return 404, {"error": "Repository not found"}
        if match["what"] == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                                   for f in files]}
        return self.commit(match["repo"], body)

    def validate_yaml(self, content: str) -> tuple[int, dict]:
        """A README.md's front matter must be a YAML mapping (the Hub checks its fields, too)."""
        if not content.startswith("---\n"):
            return 200, {"warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
        try:
            metadata = yaml.safe_load(content[4:content.index("\n---\n", 3)])
        except (ValueError, yaml.YAMLError) as exc:
            return 400, {"errors": [{"message": str(exc)}]}
        if not isinstance(metadata, dict):
            return 400, {"errors": [{"message": "the metadata must be a mapping"}]}
        self.cards.append(metadata)
        return 200, {"warnings": []}

    def commit(self, repo: str, body: bytes) -> tuple[int, dict]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            return 400, {"error": "the commit's first line must be its header"}
        for line in lines[1:]:
            if line["key"] != "file" or line["value"].get("encoding") != "base64":
                return 400, {"error": f"unexpected commit line {line['key']}"}
            self.repos[repo][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        self.commits.append(lines[0]["value"])
        oid = hashlib.sha1(body).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid}

    def _handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = stand_in.answer(self.command, self.path.split("?")[0], self.headers, body)
                stand_in.requests.append((self.command, self.path, status))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_DELETE = do_HEAD = do_POST

            def log_message(self, *args):
                pass

        return Handler
