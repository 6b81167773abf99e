"""Reading a user's dataset: every file type, a save_to_disk folder and an s3:// URL; `auto` picks the
format from the columns; rows become the stored rows of their format; each format's contract."""

import json

import pandas as pd
import pytest

from artifacts.store import Store
from data_contracts import formats
from data_contracts.config import ContractParams
from data_contracts.snapshots import keep, kept_files
from data_contracts.sources import Source, SourceError, columns_of, locate, rows_of, source_files
from data_contracts.validate import validate

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}]
ROWS = {
    "text": [{"text": "The sum of 2 and 2 is 4."}, {"text": "Three plus one is four."}],
    "prompt_completion": [{"prompt": "What is 2+2?", "completion": "4"}, {"prompt": "What is 3+1?", "completion": "4"}],
    "messages": [{"messages": CHAT}, {"messages": CHAT[1:]}],
    "preference": [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},
                   {"prompt": "What is 3+1?", "chosen": "4", "rejected": "3"}],
    "prompts": [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "What is 3+1?", "answer": "4"}],
}
FLAT = ("text", "prompt_completion", "preference", "prompts")  # csv holds flat columns only


def write_source(folder, kind: str, name: str, rows: list[dict]):
    path = folder / f"{name}.{kind}" if kind != "save_to_disk" else folder / name
    if kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif kind == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        from datasets import Dataset

        Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "save_to_disk"])
def test_every_file_type_reads_and_auto_picks_each_format(tmp_path, kind):
    for name, rows in ROWS.items():
        if kind == "csv" and name not in FLAT:
            continue
        source = locate(str(write_source(tmp_path, kind, name, rows)), tmp_path)
        files = source_files(source)
        assert formats.detect(columns_of(files, None, name)) == name, (kind, name)
        read = [formats.plain(row) for row in rows_of(files, None, name)]
        assert read == rows, (kind, name)


def test_a_folder_of_files_and_a_saved_dataset_dict(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    write_source(folder, "jsonl", "a", ROWS["prompts"][:1])
    write_source(folder, "jsonl", "b", ROWS["prompts"][1:])
    (folder / "README.md").write_text("not data")
    files = source_files(locate("parts", tmp_path))
    assert rows_of(files, None, "parts") == ROWS["prompts"]

    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS["text"]), "test": Dataset.from_list(ROWS["text"][:1])}) \
        .save_to_disk(str(tmp_path / "saved"))
    files = source_files(locate("saved", tmp_path))
    assert rows_of(files, "test", "saved") == ROWS["text"][:1]
    assert rows_of(files, None, "saved") == ROWS["text"]  # train by default
    with pytest.raises(SourceError, match="no split 'validation' \\(splits: train, test\\)"):
        rows_of(files, "validation", "saved")


def test_an_s3_url_on_moto(tmp_path, s3_endpoint):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for name, rows in ROWS.items():
        body = "".join(json.dumps(row) + "\n" for row in rows).encode()
        client.put_object(Bucket="posttrain-test", Key=f"user/{name}.jsonl", Body=body)
        source = locate(f"s3://posttrain-test/user/{name}.jsonl", tmp_path)
        assert source.kind == "url"
        files = source_files(source, {"client_kwargs": {"endpoint_url": s3_endpoint}})
        assert formats.detect(columns_of(files, None, source.written)) == name
        assert [formats.plain(r) for r in rows_of(files, None, source.written)] == rows


def test_sources_are_kept_in_the_store_by_content_and_checked_on_read(tmp_path):
    store = Store(f"file://{tmp_path / 'store'}")
    files = {"chats.jsonl": b'{"text": "hi"}\n'}
    kept = keep(store, files)
    assert kept_files(store, kept["digest"]) == files
    assert keep(store, files) == kept  # same content, same copy
    (tmp_path / "store" / "sources" / kept["digest"] / "chats.jsonl").write_bytes(b'{"text": "changed"}\n')
    with pytest.raises(SourceError, match="content does not match its hash"):
        kept_files(store, kept["digest"])


def test_symlinks_in_a_source_are_refused(tmp_path):
    (tmp_path / "secret.txt").write_text("host only")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "rows.jsonl").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(SourceError, match="rows.jsonl is a symlink"):
        source_files(locate("data", tmp_path))


def test_locate_tells_paths_urls_and_hub_ids_apart(tmp_path):
    assert locate("data/chats.jsonl", tmp_path) == Source("local", str(tmp_path / "data/chats.jsonl"),
                                                          "data/chats.jsonl")
    assert locate("trl-lib/tldr", tmp_path).kind == "hub"
    assert locate("s3://bucket/x.parquet", tmp_path).kind == "url"


def test_columns_map_and_an_implicit_prompt_is_split_off():
    assert formats.renamed(["question", "response"], {"prompt": "question", "completion": "response"}) == \
        ["prompt", "completion"]
    user = {"role": "user", "content": "What is 2+2?"}
    row = formats.normalize("preference", {"chosen": [user, {"role": "assistant", "content": "4"}],
                                           "rejected": [user, {"role": "assistant", "content": "5"}]}, 7)
    assert row["id"] == "row-7" and row["conversational"]
    assert json.loads(row["prompt"]) == [user]
    assert json.loads(row["chosen"]) == [{"role": "assistant", "content": "4"}]
    assert "fit no format (text needs text; prompt_completion needs prompt and completion" in \
        formats.no_format(["question"])


def messages_frame(conversations) -> pd.DataFrame:
    rows = [formats.normalize("messages", {"messages": turns}, i) for i, turns in enumerate(conversations)]
    return pd.DataFrame([{**row, "malformed": None} for row in rows])


def test_the_messages_contract_names_each_bad_row():
    good = CHAT
    bad = {
        "unknown_roles": [{"role": "wizard", "content": "hi"}, *CHAT[1:]],
        "empty_turns": [CHAT[1], {"role": "assistant", "content": "  "}],
        "turns_out_of_order": [CHAT[1], CHAT[1], CHAT[2]],
        "not_ending_on_assistant": CHAT[:2],
    }
    result = validate(messages_frame([good, *bad.values()]), ContractParams(kind="messages"))
    assert not result.success
    lines = {failure.column: failure.line() for failure in result.failures}
    for i, column in enumerate(bad, start=1):
        assert lines[column] == f"expect_column_values_to_be_in_set({column}): 1 rows, e.g. row-{i}", lines
    assert validate(messages_frame([good, good]), ContractParams(kind="messages")).success


def test_an_empty_dataset_fails_every_contract():
    for kind, columns in (("sft", ["id", "prompt", "completion"]), ("messages", ["id", "messages"]),
                          ("prompts", ["id", "prompt"]), ("preference", ["id", "prompt", "chosen", "rejected"])):
        result = validate(pd.DataFrame({column: [] for column in columns}), ContractParams(kind=kind))
        assert not result.success and "expect_table_row_count_to_be_between" in result.message(), kind


def test_chosen_equal_to_rejected_fails_the_preference_contract():
    frame = pd.DataFrame([formats.normalize("preference", row, i) for i, row in
                          enumerate([ROWS["preference"][0], {"prompt": "q", "chosen": "same", "rejected": "same"}])])
    result = validate(frame, ContractParams(kind="preference"))
    assert [f.line() for f in result.failures] == [
        "expect_column_values_to_be_in_set(chosen_equals_rejected): 1 rows, e.g. row-1"]
