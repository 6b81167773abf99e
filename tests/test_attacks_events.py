"""Events (issue 20, item 5): an evaluation started by an event opens only a store that
POSTTRAIN_ALLOWED_STORES allows where it runs; the event names the store, and whoever can post
events to the Prefect API is not trusted. tests/e2e/test_triggers.py posts such an event to a
real server."""

import pytest

from artifacts.allow_list import StoreNotAllowed, allowed_entries, check_allowed
from artifacts.store import StoreLocation

ENTRIES = ["s3://team/posttrain?endpoint_url=http://minio:9000", "file:///data/stores/a"]


@pytest.mark.parametrize("uri, options", [
    ("s3://team/posttrain", {"endpoint_url": "http://minio:9000"}),
    ("s3://team/posttrain/run-2", {"endpoint_url": "http://minio:9000"}),
    ("file:///data/stores/a", {}),
    ("file:///data/stores/a/b", {}),
])
def test_a_store_under_an_entry_with_its_endpoint_is_allowed(uri, options):
    check_allowed(StoreLocation(uri=uri, options=options), ENTRIES)


@pytest.mark.parametrize("uri, options, message", [
    ("s3://team/posttrain", {"endpoint_url": "http://attacker:9000"},
     "store: s3://team/posttrain with endpoint_url=http://attacker:9000 is not in POSTTRAIN_ALLOWED_STORES"),
    ("s3://team/posttrain", {"client_kwargs": {"endpoint_url": "http://minio:9000"}},
     "store: s3://team/posttrain with client_kwargs.endpoint_url=http://minio:9000 is not in POSTTRAIN_ALLOWED_STORES"),
    ("s3://team/posttrain", {}, "store: s3://team/posttrain is not in POSTTRAIN_ALLOWED_STORES"),
    # options an entry does not pin change which server answers, or whether it is checked
    ("s3://team/posttrain", {"endpoint_url": "http://minio:9000", "client_kwargs": {"verify": False}},
     "store: s3://team/posttrain with endpoint_url=http://minio:9000 with client_kwargs.verify=False is not in "
     "POSTTRAIN_ALLOWED_STORES"),
    ("s3://team/posttrain", {"endpoint_url": "http://minio:9000", "config_kwargs": {"s3": {"addressing_style": "virtual"}}},
     "store: s3://team/posttrain with endpoint_url=http://minio:9000 with config_kwargs.s3.addressing_style=virtual "
     "is not in POSTTRAIN_ALLOWED_STORES"),
    ("s3://team/posttrain-evil", {"endpoint_url": "http://minio:9000"},
     "store: s3://team/posttrain-evil with endpoint_url=http://minio:9000 is not in POSTTRAIN_ALLOWED_STORES"),
    ("s3://team/posttrain/../other", {"endpoint_url": "http://minio:9000"},
     "store: s3://team/posttrain/../other with endpoint_url=http://minio:9000 is not in POSTTRAIN_ALLOWED_STORES"),
    ("file:///data/stores/ab", {}, "store: file:///data/stores/ab is not in POSTTRAIN_ALLOWED_STORES"),
    ("file:///tmp/evil", {}, "store: file:///tmp/evil is not in POSTTRAIN_ALLOWED_STORES"),
])
def test_another_store_or_endpoint_is_refused(uri, options, message):
    with pytest.raises(StoreNotAllowed) as refused:
        check_allowed(StoreLocation(uri=uri, options=options), ENTRIES)
    assert str(refused.value) == message


def test_nothing_is_allowed_until_the_variable_is_set():
    assert allowed_entries({}) == []
    assert allowed_entries({"POSTTRAIN_ALLOWED_STORES": "s3://a/b, file:///c  s3://d"}) == ["s3://a/b", "file:///c",
                                                                                            "s3://d"]
    with pytest.raises(StoreNotAllowed, match="^store: s3://a is not allowed here: POSTTRAIN_ALLOWED_STORES is not set"):
        check_allowed(StoreLocation(uri="s3://a"), [])


def test_posttrain_serve_allows_its_own_pipelines_store(tmp_path, monkeypatch, capsys):
    from flows.cli.serving import allow_served_stores

    monkeypatch.setenv("POSTTRAIN_ALLOWED_STORES", "s3://team/other")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nstore: s3://team/posttrain\nstorage_options: {endpoint_url: 'http://minio:9000'}\n"
                    "envs: {arith: {kind: arith}}\nstages: [{id: w, kind: synthesize, env: arith, n: 2}]\n")
    allow_served_stores(str(spec), None)
    import os

    entries = allowed_entries(os.environ)
    assert entries == ["s3://team/other", "s3://team/posttrain?endpoint_url=http%3A%2F%2Fminio%3A9000"]
    check_allowed(StoreLocation(uri="s3://team/posttrain", options={"endpoint_url": "http://minio:9000"}), entries)
    allow_served_stores(None, str(tmp_path / "local"))
    assert allowed_entries(os.environ)[-1] == f"file://{tmp_path / 'local'}"
    assert "evaluations open only these stores (POSTTRAIN_ALLOWED_STORES): " in capsys.readouterr().out
