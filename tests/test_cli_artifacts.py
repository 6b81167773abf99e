"""`posttrain --version | ls | lineage | verify`, and `name@latest` wherever a ref is taken."""

import re
import subprocess

import pytest
import yaml
from conftest import POSTTRAIN, ROOT

from artifacts.lineage import lineage_lines
from artifacts.store import Store, StoreError
from tasks.runtime.cache import code_version


def posttrain(*args) -> subprocess.CompletedProcess:
    return subprocess.run([POSTTRAIN, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=120)


def folder(path, **files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def diamond(tmp_path) -> tuple[Store, dict]:
    """data -> sft -> (align <- data) with a report beside align: sft reaches align twice."""
    store = Store(f"file://{tmp_path / 'store'}")

    def commit(name, kind, inputs=None, siblings=None, **files):
        stage = name.split("/")[1].split(".")[0]
        producer = {"stage_id": stage, "stage_kind": stage, "run_id": "r1", "pipeline": "p", "spec": "abc",
                    "cache_key": stage}
        return str(store.commit(name, kind, folder(tmp_path / name.replace("/", "_"), **files), producer=producer,
                                inputs=inputs, siblings=siblings))

    refs = {"data": commit("p/data", "dataset", x="1")}
    refs["sft"] = commit("p/sft", "checkpoint", {"data": refs["data"]}, w="2")
    refs["report"] = commit("p/align.report", "report", {"sft": refs["sft"], "data": refs["data"]}, r="3")
    refs["align"] = commit("p/align", "checkpoint", {"sft": refs["sft"], "data": refs["data"]},
                           {"align.report": refs["report"]}, w="4")
    return store, refs


def test_version_names_the_release_and_the_code_version():
    shown = posttrain("--version")
    assert shown.returncode == 0
    assert shown.stdout == f"posttrain 0.1.0 (code {code_version()})\n"


def test_lineage_prints_each_artifact_once_and_its_siblings(tmp_path):
    store, refs = diamond(tmp_path)
    lines = lineage_lines(store, store.resolve("p/align@latest"))
    assert lines[0].startswith(f"{refs['align']}  checkpoint  stage align")
    described = [line for line in lines if "  stage " in line]
    assert len(described) == 3 and sum(refs["data"] in line for line in described) == 1  # data: reached twice
    assert any(line.endswith(f"{refs['data']}  (shown above)") for line in lines)
    assert any(line.endswith(f"made with {refs['report']}") for line in lines)
    assert store.manifest(refs["align"])["siblings"] == {"align.report": refs["report"]}


def test_latest_resolves_to_the_pinned_ref_and_a_bad_pointer_is_refused(tmp_path):
    store, refs = diamond(tmp_path)
    assert str(store.resolve("p/sft@latest")) == refs["sft"]
    assert str(store.resolve(refs["sft"])) == refs["sft"]
    shown = posttrain("lineage", "p/align@latest", "--store", store.uri)
    assert shown.returncode == 0 and shown.stderr == f"p/align@latest = {refs['align']}\n"
    assert shown.stdout.splitlines()[0].startswith(refs["align"])
    verified = posttrain("verify", "p/data@latest", "--store", store.uri)
    assert verified.returncode == 0 and verified.stdout == f"{refs['data']}: ok (1 files match their manifest)\n"

    pointer = tmp_path / "store" / "refs" / "p" / "sft" / "latest"
    cases = [("../../etc/passwd@latest", None, "ref: not an artifact name: '../../etc/passwd'"),
             ("p/none@latest", None, f"ref: no alias p/none@latest in {store.uri}"),
             ("p/sft@latest", "../../x\n", "ref: refs/p/sft/latest does not hold a version (16 hex digits): '../../x'"),
             ("p/sft@latest", "0123456789abcdef", f"ref: refs/p/sft/latest points at p/sft@0123456789abcdef, "
                                                  f"which is not committed in {store.uri}")]
    for text, pointed, message in cases:
        if pointed is not None:
            pointer.write_text(pointed)
        with pytest.raises((StoreError, ValueError)):
            store.resolve(text)
        shown = posttrain("lineage", text, "--store", store.uri)
        assert shown.returncode == 2 and shown.stderr == f"error: {message}\n", shown.stderr


def test_ls_lists_artifacts_with_kind_version_created_size_and_stage(tmp_path):
    store, refs = diamond(tmp_path)
    listed = posttrain("ls", "--store", store.uri)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["artifact", "kind", "created", "size", "stage", "run"]
    assert [row.split()[0] for row in rows] == [refs[key] for key in ("align", "report", "data", "sft")]  # by name
    data = rows[2].split()
    assert data[1] == "dataset" and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:]+\+00:00", data[2])
    assert data[3:] == ["1", "B", "data", "(data)", "r1"]
    assert posttrain("ls", "p", "--store", store.uri).stdout == listed.stdout
    assert posttrain("ls", "other", "--store", store.uri).stdout == f"no artifacts of pipeline other in {store.uri}\n"
    bad = posttrain("ls", "../p", "--store", store.uri)
    assert bad.returncode == 2 and bad.stderr == "error: pipeline: not a pipeline name: '../p'\n"


def test_ls_and_status_take_the_store_from_a_spec(tmp_path):
    store, refs = diamond(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "p", "store": store.uri, "envs": {"arith": {"kind": "arith"}},
                                    "stages": [{"id": "data", "kind": "synthesize", "env": "arith", "n": 4}]}))
    listed = posttrain("ls", "--spec", spec)
    assert listed.returncode == 0 and listed.stdout == posttrain("ls", "--store", store.uri).stdout
    assert refs["align"] in listed.stdout
    assert posttrain("ls", "other", "--spec", spec).stdout == f"no artifacts of pipeline other in {store.uri}\n"
    elsewhere = f"file://{tmp_path / 'elsewhere'}"
    assert posttrain("ls", "--spec", spec, "--store", elsewhere).stdout == f"no artifacts in {elsewhere}\n"
    assert posttrain("status", "--spec", spec).stdout == f"no runs in {store.uri}\n"
    missing = posttrain("status", "r9", "--spec", spec)
    assert missing.returncode == 2 and missing.stderr == f"error: run_id: no run 'r9' in {store.uri}\n"
