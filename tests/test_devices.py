"""How a stage uses its GPUs: the GPUs of a box locked per stage (real processes holding real
flocks, fake GPU indices), what the child is given and what it reports back, where serve-model
puts its model."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT

from tasks.runtime.devices import (INDICES_VARIABLE, LOCK_DIR_VARIABLE, VISIBLE_DEVICES, GpusUnavailable, box_gpus,
                                   lease_gpus, lock_path)

HOLDER = """
import sys
from tasks.runtime.devices import lease_gpus
lease = lease_gpus(int(sys.argv[1]), 30)
print(",".join(lease.gpus), flush=True)
sys.stdin.read()  # holds its GPUs until the test closes stdin, or kills it
"""


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A box with GPUs 0..3 and its own lock folder, for this process and the holders it starts."""
    monkeypatch.setenv(INDICES_VARIABLE, "0,1,2,3")
    monkeypatch.setenv(LOCK_DIR_VARIABLE, str(tmp_path / "locks"))
    return tmp_path / "locks"


class Holder:
    """Another stage's orchestrating process, holding `count` GPUs of the box until released or killed."""

    def __init__(self, count: int):
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(count)], cwd=ROOT, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.gpus = self.process.stdout.readline().strip().split(",")

    def release(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def test_two_stages_on_one_box_hold_disjoint_gpus(box):
    first, second = Holder(2), Holder(2)
    try:
        assert first.gpus == ["0", "1"] and second.gpus == ["2", "3"]
        with pytest.raises(GpusUnavailable):
            lease_gpus(1, 0)
    finally:
        first.release()
        second.release()


def test_two_stages_of_one_process_exclude_each_other(box):
    with lease_gpus(1, 0) as first, lease_gpus(2, 0) as second:
        assert first.child_env() == {VISIBLE_DEVICES: "0"} and second.child_env() == {VISIBLE_DEVICES: "1,2"}
    with lease_gpus(4, 0) as everything:  # released at the end of the `with`
        assert everything.gpus == ["0", "1", "2", "3"]


def test_a_stage_asking_for_more_than_is_free_waits_and_gets_the_released_gpus(box):
    first, second = Holder(2), Holder(1)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(lease=lease_gpus(2, 30)))
    try:
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not got  # one GPU free, two asked for: it holds none meanwhile
        first.release()
        waiter.join(timeout=30)
        assert got["lease"].gpus == first.gpus == ["0", "1"]
        got["lease"].release()
    finally:
        second.release()
        waiter.join(timeout=30)


def test_waiting_ends_at_the_timeout_with_a_one_line_error(box):
    holder = Holder(4)
    try:
        began = time.monotonic()
        with pytest.raises(GpusUnavailable) as error:
            lease_gpus(1, 0.5)
        assert 0.5 <= time.monotonic() - began < 5
        assert str(error.value) == f"1 of this box's GPUs (0,1,2,3) were not free within 0.5s (the stages holding " \
                                   f"them lock {box})"
    finally:
        holder.release()


def test_the_gpus_of_a_killed_holder_are_free_again(box):
    holder = Holder(4)
    with pytest.raises(GpusUnavailable):
        lease_gpus(1, 0)
    holder.kill()  # no release: the kernel drops a dead process's flocks
    with lease_gpus(4, 0) as lease:
        assert lease.gpus == ["0", "1", "2", "3"]


def test_without_gpus_nothing_is_locked_and_no_devices_are_named(box, monkeypatch):
    monkeypatch.setenv(INDICES_VARIABLE, "")
    with lease_gpus(2, 0) as lease:  # a `gpus: 2` stage on a CPU box runs as before
        assert lease.child_env() == {} and lease.gpus == []
    assert not box.exists()
    monkeypatch.setenv(INDICES_VARIABLE, "0,1")
    assert lease_gpus(0, 0).child_env() == {}  # a CPU stage on a GPU box holds none


def test_more_gpus_than_the_box_has_is_a_one_line_error_at_once(box, monkeypatch):
    monkeypatch.setenv(INDICES_VARIABLE, "0,1")
    with pytest.raises(GpusUnavailable, match=r"^asks for 3 GPUs, this box has 2 \(0,1\)$"):
        lease_gpus(3, 60)


def test_the_box_gpus_are_the_workers_own_visible_devices(monkeypatch):
    monkeypatch.delenv(INDICES_VARIABLE, raising=False)
    monkeypatch.setenv(VISIBLE_DEVICES, "2,5")  # a pod given two GPUs of its node: only those
    assert box_gpus() == ["2", "5"]
    monkeypatch.setenv(VISIBLE_DEVICES, "GPU-8f2e, 3,-1,4")  # CUDA stops at the first negative index
    assert box_gpus() == ["GPU-8f2e", "3"]
    monkeypatch.setenv(VISIBLE_DEVICES, "")
    assert box_gpus() == []
    assert lock_path(Path("/locks"), "MIG-GPU-8f2e/1/0") == Path("/locks/MIG-GPU-8f2e_1_0.lock")


def test_the_child_environment_names_the_stages_gpus(monkeypatch):
    from tasks.runtime.launch import _child_env

    monkeypatch.setenv(VISIBLE_DEVICES, "0,1,2,3")
    assert _child_env({VISIBLE_DEVICES: "2,3"})[VISIBLE_DEVICES] == "2,3"
    assert _child_env()[VISIBLE_DEVICES] == "0,1,2,3"


def test_a_stage_that_cannot_get_its_gpus_fails_naming_itself(box):
    from tasks.runtime.runner import StageFailed, stage_gpus

    request = dataset_request(box.parent)
    request = request.model_copy(update={"orchestration": request.orchestration.model_copy(update={"gpus": 8})})
    with pytest.raises(StageFailed, match=r"^stage 'chats': asks for 8 GPUs, this box has 4 \(0,1,2,3\)$"):
        stage_gpus(request)


def dataset_request(tmp_path: Path):
    """A dataset stage's request over a small JSONL file, as the pipeline flow builds it."""
    from flows.spec import load_spec
    from flows.stage_requests import stage_request

    rows = [{"prompt": f"what is {i}+1?", "completion": str(i + 1)} for i in range(4)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "spec.yaml").write_text(
        f"name: t\nstore: file://{tmp_path / 'store'}\nmodel: {{base: tiny-llama}}\nenvs: {{}}\n"
        "stages:\n  - {id: chats, kind: dataset, source: sums.jsonl}\n")
    spec, _ = load_spec(tmp_path / "spec.yaml")
    return stage_request(spec, spec.stage("chats"), {}, store=spec.store_location(), run_id="t-1", spec_hash=None)


def test_the_child_reports_its_device_and_peak_memory(tmp_path):
    from tasks.runtime.child import main

    request_path, result_path = tmp_path / "request.json", tmp_path / "result.json"
    request_path.write_text(dataset_request(tmp_path).model_dump_json())
    assert main([str(request_path), str(result_path)], os.getpid()) == 0
    result = json.loads(result_path.read_text())
    assert result["device"] == "cpu" and "peak_gpu_gb" not in result  # a `gpus: 0` stage
    assert 0.05 < result["peak_rss_gb"] < 64 and result["peak_rss_gb"] == round(result["peak_rss_gb"], 3)


PEAKS = """
import os, subprocess, sys
from tasks.runtime.peaks import peak_rss_gb
big = bytearray(600_000_000)
big[::4096] = b"x" * len(big[::4096])  # every page resident
del big
exec_child = subprocess.run([sys.executable, "-c", "from tasks.runtime.peaks import peak_rss_gb; print(peak_rss_gb())"],
                            capture_output=True, text=True, check=True).stdout.strip()
reader, writer = os.pipe()
if os.fork() == 0:  # as the warm fork server starts a stage
    os.write(writer, str(peak_rss_gb()).encode())
    os._exit(0)
os.wait()
print(peak_rss_gb(), exec_child, os.read(reader, 100).decode())
"""


def test_peak_rss_is_the_processs_own_not_its_launchers():
    """A stage's process, started by exec (accelerate launch) or forked, reports its own peak, not
    the peak its launcher reached before it started (ru_maxrss reports it for the exec'd one)."""
    launcher, exec_child, forked_child = map(float, subprocess.run(
        [sys.executable, "-c", PEAKS], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())
    assert launcher > 0.6 and exec_child < launcher - 0.3 and forked_child < launcher - 0.3


def test_serve_model_places_its_model_on_the_device_asked_for(tmp_path):
    import torch

    from flows.cli.serve_model import ServeModelInputError, serve_model
    from models.config import ModelConfig
    from models.presets import materialize
    from models.serving import ServedModel, serving_device

    served = ServedModel(materialize("tiny-llama"), "t", ModelConfig(base="tiny-llama", device="cpu"))
    assert served.device == "cpu" and next(served.model.parameters()).device == torch.device("cpu")
    assert serving_device(ModelConfig()) == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ServeModelInputError, match=r"^--device: auto or cpu, not 'gpu'$"):
        serve_model("t/sft@0123456789abcdef", f"file://{tmp_path}", "127.0.0.1", 0, None, device="gpu")


def test_a_stage_holding_gpus_where_there_are_none_stops_in_one_line(monkeypatch):
    """Not a silent fall back to the CPU: a `gpus: 1` stage on a machine without CUDA refuses to
    start, naming what it holds and what it sees; `model.device: cpu` says the CPU is meant."""
    from models.config import ModelConfig
    from tasks.runtime.child import GpusUnavailable, check_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(GpusUnavailable) as refused:
        check_gpus("sft", 1, ModelConfig())
    assert str(refused.value) == ("stage sft holds gpus: 1, but this worker sees 0 GPU(s) "
                                  "(torch.cuda.device_count(); CUDA_VISIBLE_DEVICES=): run it on a GPU worker, "
                                  "or set model.device: cpu to train on the CPU")
    check_gpus("sft", 2, ModelConfig(device="cpu"))
    check_gpus("sft", 0, ModelConfig())
