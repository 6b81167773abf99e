"""An S3 store behind a flaky endpoint (tests/flaky_s3.py: a proxy in front of moto's server that
answers chosen PUTs with 503s or holds them past the client's read timeout): commits are retried,
a create-only write tells its own landed write from someone else's, no reader ever sees a manifest
whose files are missing or different, and a store down for longer than the retry budget is one
StoreError that leaves no manifest."""

import threading
import time

import pytest

from artifacts.refs import Ref, content_version
from artifacts.store import AlreadyExists, Store, StoreError, folder_hashes
from flaky_s3 import HOLD, HOLD_AFTER_FORWARD, SLOW_DOWN, Fault, FlakyS3Proxy

READ_TIMEOUT_S = 1
# botocore retries nothing itself here, so every fault reaches s3fs and the store (s3fs still
# retries SlowDown and timeouts a few times on its own, as it does in production)
CLIENT = {"read_timeout": READ_TIMEOUT_S, "connect_timeout": READ_TIMEOUT_S, "retries": {"max_attempts": 0}}


@pytest.fixture(scope="module")
def flaky(s3_endpoint):
    with FlakyS3Proxy(s3_endpoint) as proxy:
        yield proxy


@pytest.fixture(autouse=True)
def _no_faults_left(flaky):
    yield
    flaky.clear()


def flaky_store(proxy: FlakyS3Proxy, prefix: str) -> Store:
    # its own s3fs instance, as another process would have (no listing cache shared with the writer)
    return Store(f"s3://posttrain-test/{prefix}", {"endpoint_url": proxy.endpoint, "skip_instance_cache": True,
                                                    "config_kwargs": CLIENT})


def artifact_files(folder):
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (folder / "config.json").write_text('{"layers": 2}')
    return folder


def producer(run_id="r1"):
    return {"pipeline": "p", "run_id": run_id, "stage_id": "sft", "stage_kind": "sft", "spec": "abc"}


class Reader(threading.Thread):
    """Polls a version the way a stage reading its input does (is_committed, manifest, fetch) until
    stopped, recording every problem: a committed version must fetch whole, and equal to `expected`."""

    def __init__(self, store: Store, ref: Ref, expected: dict[str, bytes], scratch):
        super().__init__(daemon=True)
        self.store, self.ref, self.expected, self.scratch = store, ref, expected, scratch
        self.stopped, self.problems, self.seen_committed, self.polls = threading.Event(), [], 0, 0

    def run(self) -> None:
        while not self.stopped.is_set():
            self.polls += 1
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 (every surprise is a finding)
                self.problems.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)

    def poll(self) -> None:
        if not self.store.is_committed(self.ref):
            return
        manifest = self.store.manifest(self.ref)
        assert {entry["path"] for entry in manifest["files"]} == set(self.expected), manifest["files"]
        folder = self.store.fetch(self.ref, self.scratch / f"poll-{self.polls}")
        got = {path: (folder / path).read_bytes() for path in self.expected}
        assert got == self.expected, "fetched files differ from the committed ones"
        self.seen_committed += 1

    def stop(self) -> list[str]:
        time.sleep(0.5)  # a few polls after the commit
        self.stopped.set()
        self.join(timeout=30)
        return self.problems


def test_flaky_store_commit_survives_503_bursts_and_lost_answers_with_a_reader_watching(flaky, tmp_path):
    store = flaky_store(flaky, "bursts")
    files = artifact_files(tmp_path / "out")
    ref = Ref("p/sft", content_version(folder_hashes(files)))
    flaky.inject(
        Fault(SLOW_DOWN, path=r"/MANIFEST\.json$", times=7),  # more than s3fs's 5 tries on SlowDown
        Fault(SLOW_DOWN, path=r"/weights\.bin$", times=3, code="ServiceUnavailable"),
        Fault(HOLD_AFTER_FORWARD, path=r"/config\.json$", times=1, hold_s=READ_TIMEOUT_S + 1),
    )
    reader = Reader(flaky_store(flaky, "bursts"), ref, {p.name: p.read_bytes() for p in files.iterdir()}, tmp_path)
    reader.start()

    assert store.commit("p/sft", "checkpoint", files, producer=producer()) == ref

    assert reader.stop() == [] and reader.seen_committed > 0
    assert len(flaky.done(SLOW_DOWN, "MANIFEST")) == 7 and len(flaky.done(SLOW_DOWN, "weights")) == 3
    assert flaky.done(HOLD_AFTER_FORWARD, "config") and flaky.done("forwarded", "MANIFEST")
    assert list(store.manifests("p")) == [str(ref)]  # committed once
    assert store.manifest(ref)["producer"] == producer() and store.verify(ref) == []
    assert store.latest("p/sft") == ref


def test_flaky_store_commit_outlasts_a_window_of_slow_downs_on_every_put(flaky, tmp_path):
    store = flaky_store(flaky, "window")
    files = artifact_files(tmp_path / "out")
    flaky.inject(Fault(SLOW_DOWN, path=r"^/posttrain-test/window/", seconds=4))  # longer than s3fs's tries

    started = time.monotonic()
    ref = store.commit("p/data", "dataset", files, producer=producer())

    assert time.monotonic() - started >= 4 and len(flaky.done(SLOW_DOWN)) > 5
    assert store.verify(ref) == [] and list(store.manifests("p")) == [str(ref)]


def test_flaky_store_manifest_written_before_its_answer_was_lost_is_taken_as_our_own(flaky, tmp_path):
    store = flaky_store(flaky, "lost-answer")
    flaky.inject(Fault(HOLD_AFTER_FORWARD, path=r"/MANIFEST\.json$|/claims/", times=1, hold_s=READ_TIMEOUT_S + 1))

    ref = store.commit("p/data", "dataset", artifact_files(tmp_path / "out"), producer=producer())
    claim = store.path("claims", "key", "1.json")
    store.create_only(claim, b'{"run_id": "r1"}')  # the retry finds the claim: ours, same bytes

    assert flaky.done(HOLD_AFTER_FORWARD, "MANIFEST") and flaky.done(HOLD_AFTER_FORWARD, "claims")
    assert store.manifest(ref)["producer"] == producer() and store.verify(ref) == []
    assert store.read_bytes(claim) == b'{"run_id": "r1"}'
    with pytest.raises(AlreadyExists):  # someone else's (different bytes) is never overwritten
        store.create_only(claim, b'{"run_id": "r2"}')
    with pytest.raises(AlreadyExists):  # and an object there before this call wrote anything is not ours
        store.create_only(claim, b'{"run_id": "r1"}')
    assert store.read_bytes(claim) == b'{"run_id": "r1"}'


def test_flaky_store_a_retried_create_that_finds_another_writers_object_is_already_exists(flaky, s3_endpoint):
    store = flaky_store(flaky, "rival")
    rival = Store("s3://posttrain-test/rival", {"endpoint_url": s3_endpoint, "skip_instance_cache": True})
    path = store.path("claims", "key", "1.json")
    flaky.inject(Fault(HOLD, path=r"/claims/", times=1, hold_s=READ_TIMEOUT_S + 1))  # ours: not stored

    def rival_writes_while_ours_is_held():
        while not flaky.done(HOLD, "claims"):
            time.sleep(0.01)
        rival.create_only(path, b"rival")

    racing = threading.Thread(target=rival_writes_while_ours_is_held)
    racing.start()
    with pytest.raises(AlreadyExists):  # the retry finds an object: not our bytes, so not ours
        store.create_only(path, b"mine")
    racing.join()
    assert store.read_bytes(path) == b"rival"


def test_flaky_store_down_past_the_budget_is_one_store_error_and_no_manifest(flaky, tmp_path):
    store = flaky_store(flaky, "outage")
    store.retry_budget_s = 3
    files = artifact_files(tmp_path / "out")
    flaky.inject(Fault(SLOW_DOWN, path=r"/MANIFEST\.json$", code="ServiceUnavailable"))  # every one

    started = time.monotonic()
    with pytest.raises(StoreError) as failure:
        store.commit("p/data", "dataset", files, producer=producer())

    message = str(failure.value)
    assert "\n" not in message and time.monotonic() - started < 15
    ref = Ref("p/data", content_version(folder_hashes(files)))
    assert message.startswith(f"cannot create s3://posttrain-test/outage/artifacts/p/data/{ref.version}/MANIFEST.json: "
                              "ServiceUnavailable (HTTP 503), ")
    assert len(flaky.done(SLOW_DOWN, "MANIFEST")) >= 2  # tried again before giving up
    flaky.clear()
    assert not store.is_committed(ref) and store.manifests("p") == {}
    assert store.commit("p/data", "dataset", files, producer=producer()) == ref  # a retried stage commits it


def test_flaky_store_refusals_are_not_retried(flaky):
    store = Store("s3://no-such-bucket-here/x", {"endpoint_url": flaky.endpoint, "config_kwargs": CLIENT})
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):  # NoSuchBucket (404): final at once, not after the budget
        store.write_bytes(store.path("a"), b"x")
    assert time.monotonic() - started < 5


def test_flaky_store_sees_what_other_processes_wrote_since_it_listed(flaky):
    ours, theirs = flaky_store(flaky, "listing"), flaky_store(flaky, "listing")
    folder = ours.path("claims", "key")
    ours.create_only(ours.path("claims", "key", "1.json"), b"ours")
    assert ours.listdir(folder) == ["1.json"]
    theirs.create_only(theirs.path("claims", "key", "2.json"), b"theirs")
    # no cached listing: a claim another run won (or a version committed since) is seen at once
    assert ours.listdir(folder) == ["1.json", "2.json"] and ours.exists(ours.path("claims", "key", "2.json"))


def test_flaky_store_claim_whose_answer_was_lost_is_held_not_chased(flaky):
    from tasks.runtime.claims import claim_stage

    store = flaky_store(flaky, "claim")
    flaky.inject(Fault(HOLD_AFTER_FORWARD, path=r"/claims/", times=1, hold_s=READ_TIMEOUT_S + 1))
    claimed = []
    claiming = threading.Thread(target=lambda: claimed.append(claim_stage(store, "key", "r1", 60, lambda: None)),
                                daemon=True)
    claiming.start()
    claiming.join(timeout=30)  # before the fix: claims/key/2.json created and "lost" over and over, forever
    assert claimed, f"claim_stage still running; PUTs: {flaky.done('forwarded', '/claims/')[-3:]}"
    claimed[0].release()
    assert flaky.done(HOLD_AFTER_FORWARD, "/claims/") == ["/posttrain-test/claim/claims/key/1.json"]
    assert store.listdir(store.path("claims", "key")) == []
