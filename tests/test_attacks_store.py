"""Attacks through the store's contents (issue 20, item 1, in part): paths from a manifest, a listing
or a run id that leave their folder are refused, and nothing is written outside."""

import json

import pytest
from pydantic import ValidationError

from artifacts.refs import Ref, inside
from artifacts.store import Store, StoreError
from flows.cli.main import main


def tampered_artifact(tmp_path) -> tuple[Store, str]:
    """A committed artifact whose manifest a writer of the store changed to name `../../../../payload/ESC`."""
    store = Store(f"file://{tmp_path / 'store'}")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "data.parquet").write_bytes(b"rows")
    ref = store.commit("p/data", "dataset", tmp_path / "files", producer={})
    manifest_path = tmp_path / "store" / "artifacts" / "p" / "data" / ref.version / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].append({"path": "../../../../payload/ESC", "sha256": "0" * 64, "size": 4})
    manifest_path.write_text(json.dumps(manifest))
    return store, str(ref)


def test_a_manifest_path_that_leaves_the_folder_is_refused_and_nothing_is_written(tmp_path):
    store, ref = tampered_artifact(tmp_path)
    target = tmp_path / "a" / "b" / "c" / "fetch"
    with pytest.raises(StoreError, match=r"manifest file path '../../../../payload/ESC' leaves the artifact's folder"):
        store.fetch(ref, target)
    assert not list(tmp_path.rglob("ESC"))
    assert "'../../../../payload/ESC': leaves the artifact's folder" in store.verify(ref)


def test_paths_read_from_the_store_must_stay_inside():
    for bad in ("../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\..\\b", "", "a/\0"):
        assert not inside(bad), bad
    for good in ("data.parquet", "model/adapter_config.json", "a.b/c..d"):
        assert inside(good), good


def test_a_run_id_that_is_a_path_is_refused(tmp_path, capsys):
    (tmp_path / "store" / "outside.json").parent.mkdir(parents=True)
    code = main(["status", "../outside", "--store", f"file://{tmp_path / 'store' / 'inner'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "error: run_id: '../outside' is not a run id (letters, digits, '.', '_', '-')"


def test_a_stage_request_with_a_path_for_a_run_id_is_refused():
    from test_events import REQUEST

    for field, value in (("run_id", "../../quarantine-elsewhere"), ("cache_key", "../scratch"),
                         ("pipeline", "../p")):
        with pytest.raises(ValidationError):
            type(REQUEST).model_validate({**REQUEST.model_dump(), field: value})


def test_verify_reports_an_extra_file_and_a_manifest_that_does_not_give_the_version(tmp_path):
    store = Store(f"file://{tmp_path / 'store'}")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "adapter_model.safetensors").write_bytes(b"weights")
    ref = store.commit("p/ckpt", "checkpoint", tmp_path / "files", producer={})
    assert store.verify(ref) == []
    folder = tmp_path / "store" / "artifacts" / "p" / "ckpt" / ref.version
    (folder / "adapter_config.json").write_text("{}")  # planted: it would change what loads
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    (folder / "adapter_model.safetensors").write_bytes(b"other weights")
    manifest["files"][0]["sha256"] = __import__("hashlib").sha256(b"other weights").hexdigest()
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))  # hashes made to match the swapped file
    problems = store.verify(ref)
    assert problems[0].startswith("the manifest's files hash to version ") and problems[0].endswith(f"not {ref.version}")
    assert "adapter_config.json: not in the manifest" in problems


def test_a_retried_commit_points_latest_at_its_version(tmp_path):
    store = Store(f"file://{tmp_path / 'store'}")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "data.parquet").write_bytes(b"rows")
    ref = store.commit("p/data", "dataset", tmp_path / "files", producer={})
    (tmp_path / "store" / "refs" / "p" / "data" / "latest").unlink()  # died between manifest and alias
    assert store.commit("p/data", "dataset", tmp_path / "files", producer={}) == ref
    assert store.latest("p/data") == ref
    assert not list((tmp_path / "store").rglob("*.tmp-*"))  # data files went in under temporary names


def test_secrets_in_storage_options_are_refused_by_default(tmp_path, capsys):
    from artifacts.store import credential_keys

    secrets = {"account_key": "k", "sas_token": "t", "client_secret": "s", "session_token": "t",
               "connection_string": "c", "headers": {"Authorization": "Bearer x"},
               "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "aws_session_token": "t"}}
    assert credential_keys(secrets) == ["account_key", "sas_token", "client_secret", "session_token",
                                        "connection_string", "headers", "client_kwargs.aws_session_token"]
    assert credential_keys({"endpoint_url": "http://x", "client_kwargs": {"region_name": "eu"},
                            "config_kwargs": {"s3": {"addressing_style": "path"}}}) == []
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nstore: s3://b/p\nstorage_options: {headers: {Authorization: Bearer x}}\n"
                    "envs: {arith: {kind: arith}}\nstages: [{id: w, kind: synthesize, env: arith, n: 2}]\n")
    assert main(["validate", str(spec)]) == 2
    assert capsys.readouterr().err.startswith("error: storage_options.headers: credentials must come from the "
                                              "environment or the AWS credential chain, not the spec")


def committed(store: Store, tmp_path) -> str:
    (tmp_path / "files").mkdir(exist_ok=True)
    (tmp_path / "files" / "weights.bin").write_bytes(b"0123456789")
    return str(store.commit("p/ckpt", "checkpoint", tmp_path / "files", producer={}))


def test_fetch_from_an_object_store_checks_every_file_against_the_manifest(s3_endpoint, tmp_path):
    """A file truncated by a racing writer, or changed under its manifest, is an error on fetch
    from S3 (moto), never a checkpoint that loads wrong."""
    store = Store("s3://posttrain-test/fetch-checks", {"endpoint_url": s3_endpoint})
    ref = committed(store, tmp_path)
    path = store.version_path(Ref.parse(ref), "weights.bin")
    store.write_bytes(path, b"01234")
    with pytest.raises(StoreError, match=r"^p/ckpt@\w+: weights.bin is 5 bytes, the manifest says 10$"):
        store.fetch(ref, tmp_path / "a")
    store.write_bytes(path, b"9876543210")  # same size: only the hash tells
    with pytest.raises(StoreError, match=r"^p/ckpt@\w+: weights.bin does not match its sha256 in the manifest$"):
        store.fetch(ref, tmp_path / "b")
    store.write_bytes(path, b"0123456789")
    assert (store.fetch(ref, tmp_path / "c") / "weights.bin").read_bytes() == b"0123456789"


def test_local_fetch_checks_sizes_and_hashes_when_asked(tmp_path):
    store = Store(f"file://{tmp_path / 'store'}")
    ref = committed(store, tmp_path)
    path = store.fetch(ref) / "weights.bin"
    path.write_bytes(b"012")
    with pytest.raises(StoreError, match="weights.bin is 3 bytes, the manifest says 10$"):
        store.fetch(ref)
    path.write_bytes(b"9876543210")
    assert store.fetch(ref) == path.parent  # the size holds: a local fetch does not re-hash by default
    with pytest.raises(StoreError, match="weights.bin does not match its sha256"):
        store.fetch(ref, hashes=True)
    path.unlink()
    path.symlink_to("/etc/passwd")
    with pytest.raises(StoreError, match="weights.bin is a symlink$"):
        store.fetch(ref)
