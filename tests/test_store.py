import json

import pytest

from artifacts.lineage import lineage_lines
from artifacts.refs import BadRef, Ref
from artifacts.store import AlreadyExists, Store, StoreError


def make_files(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def producer(stage="s"):
    return {"pipeline": "p", "run_id": "r1", "stage_id": stage, "stage_kind": "synthesize", "spec": "abc"}


def test_commit_is_content_addressed_and_idempotent(tmp_path):
    store = Store(str(tmp_path / "store"))
    ref = store.commit("p/data", "dataset", make_files(tmp_path / "a", x="1", y="2"), producer=producer())
    again = store.commit("p/data", "dataset", make_files(tmp_path / "b", x="1", y="2"), producer=producer())
    other = store.commit("p/data", "dataset", make_files(tmp_path / "c", x="1", y="3"), producer=producer())
    assert ref == again and ref != other
    manifest = store.manifest(ref)
    assert manifest["kind"] == "dataset" and {f["path"] for f in manifest["files"]} == {"x", "y"}
    assert all(len(f["sha256"]) == 64 and f["size"] == 1 for f in manifest["files"])
    assert store.latest("p/data") == other


def test_manifest_is_create_only(tmp_path):
    store = Store(str(tmp_path / "store"))
    ref = store.commit("p/data", "dataset", make_files(tmp_path / "a", x="1"), producer=producer())
    with pytest.raises(AlreadyExists):
        store.create_only(store.version_path(ref, "MANIFEST.json"), b"{}")
    assert store.manifest(ref)["ref"] == str(ref)


def test_uncommitted_version_is_not_readable(tmp_path):
    store = Store(str(tmp_path / "store"))
    ref = Ref("p/data", "0" * 16)
    store.put_dir(make_files(tmp_path / "a", x="1"), store.version_path(ref))  # files but no manifest
    assert not store.is_committed(ref)
    with pytest.raises(StoreError, match="no committed artifact"):
        store.manifest(ref)


def test_verify_reports_tampered_and_missing_files(tmp_path):
    store = Store(str(tmp_path / "store"))
    ref = store.commit("p/data", "dataset", make_files(tmp_path / "a", x="1", y="2"), producer=producer())
    assert store.verify(ref) == []
    (tmp_path / "store" / "artifacts" / "p" / "data" / ref.version / "x").write_text("evil")
    (tmp_path / "store" / "artifacts" / "p" / "data" / ref.version / "y").unlink()
    problems = store.verify(ref)
    assert problems[0].startswith("x: sha256") and problems[1] == "y: missing"


def test_lineage_walks_inputs_back_to_the_spec(tmp_path):
    store = Store(str(tmp_path / "store"))
    data = store.commit("p/warmup", "dataset", make_files(tmp_path / "a", x="1"), producer=producer("warmup"))
    ckpt = store.commit("p/sft", "checkpoint", make_files(tmp_path / "b", w="2"),
                        producer={**producer("sft"), "stage_kind": "sft", "base_model": "preset:tiny-llama@1"},
                        inputs={"warmup": str(data)})
    lines = lineage_lines(store, ckpt)
    assert lines[0].startswith(f"{ckpt}  checkpoint  stage sft")
    assert any(str(data) in line for line in lines[1:])
    assert any("base model preset:tiny-llama@1" in line for line in lines)
    assert lines[-1].strip().endswith("spec p (specs/abc.yaml)")


def test_refs_parse_and_reject():
    assert str(Ref.parse("quickstart/sft@0123456789abcdef")) == "quickstart/sft@0123456789abcdef"
    for bad in ("quickstart/sft", "sft@latest", "@0123456789abcdef"):
        with pytest.raises(BadRef):
            Ref.parse(bad)


def test_credentials_are_refused_in_options_and_uri(tmp_path):
    with pytest.raises(StoreError, match="credentials"):
        Store("s3://bucket/x", {"key": "AKIA", "secret": "s"})
    with pytest.raises(StoreError, match="credentials"):
        Store("s3://AKIA:secret@bucket/x")


def test_s3_store_against_moto_server(s3_endpoint, tmp_path):
    store = Store("s3://posttrain-test/unit", {"endpoint_url": s3_endpoint})
    store.check_reachable()
    ref = store.commit("p/data", "dataset", make_files(tmp_path / "a", x="1", y="2"), producer=producer())
    assert store.commit("p/data", "dataset", make_files(tmp_path / "b", x="1", y="2"), producer=producer()) == ref
    with pytest.raises(AlreadyExists):
        store.create_only(store.version_path(ref, "MANIFEST.json"), b"{}")
    fetched = store.fetch(ref, tmp_path / "out")
    assert (fetched / "x").read_text() == "1" and store.verify(ref) == []
    store.write_bytes(store.version_path(ref, "x"), b"tampered")
    assert store.verify(ref)[0].startswith("x: sha256")
    manifest_text = json.dumps(store.manifest(ref))
    assert "testing-secret" not in manifest_text and "AWS" not in manifest_text


def test_s3_store_that_cannot_be_reached_is_a_store_error(s3_endpoint):
    with pytest.raises(StoreError, match="does not exist"):
        Store("s3://no-such-bucket/x", {"endpoint_url": s3_endpoint}).check_reachable()


def test_unwritable_local_store_is_a_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match="is not a writable folder"):
        Store(str(blocker / "store")).check_reachable()
    Store(str(tmp_path / "new" / "store")).check_reachable()
    assert not (tmp_path / "new").exists()  # checking writes nothing
