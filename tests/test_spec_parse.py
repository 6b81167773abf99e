"""A spec text is parsed (and its envs built) once per process: the CLI, the flow it starts and an
inline evaluation that reads the same text back from the store share one PipelineSpec."""

from flows.spec import load_spec, parse_spec_text, spec_folder
from tests.e2e.helpers import tiny_spec, write


def test_a_spec_text_is_parsed_once_per_process_and_again_when_its_variables_change(tmp_path, monkeypatch):
    spec = tiny_spec("${STORE_URI}")
    path = write(tmp_path, spec)
    monkeypatch.setenv("STORE_URI", f"file://{tmp_path / 'a'}")
    parsed, text = load_spec(path)
    assert parse_spec_text(text, spec_dir=spec_folder(path)) is parsed  # the flow's parse of the CLI's text
    # the evaluation flow's, read back from the store (its sources are not read again)
    assert parse_spec_text(text, "specs/0123.yaml", read_sources=False) is parsed
    monkeypatch.setenv("STORE_URI", f"file://{tmp_path / 'b'}")
    again = parse_spec_text(text)
    assert again is not parsed and again.store == f"file://{tmp_path / 'b'}"
