"""`policy: rl@best:arith.accuracy`: the best evaluated checkpoint of a stage's run, read from the
store's evaluations when the stage starts, recorded in its inputs (and so in its manifests and
cache key); one line when nothing was evaluated or the selector is malformed."""

import pytest
import yaml

from artifacts.store import Store
from flows.spec import SpecError, parse_spec
from flows.stage_inputs import BestCheckpoint, NoBestCheckpoint, parse_input, resolve_inputs
from flows.stage_requests import stage_request

SPEC = {
    "name": "qs",
    "envs": {"arith": {"kind": "arith", "digits": 2}},
    "stages": [
        {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10},
        {"id": "rl", "kind": "sft", "data": "warmup", "max_steps": 30},
        {"id": "polish", "kind": "sft", "data": "warmup", "policy": "rl@best:arith.accuracy", "max_steps": 2},
    ],
}


class Evaluated:
    """A store holding the checkpoints of stage runs and evaluations of some of them, as the
    pipeline commits them (producer, step metrics, `<checkpoint>.eval`-style results)."""

    def __init__(self, tmp_path):
        self.tmp, self.store, self.count = tmp_path, Store(f"file://{tmp_path / 'store'}"), 0

    def commit(self, name, kind, producer, metrics, inputs=None) -> str:
        self.count += 1
        folder = self.tmp / f"f{self.count}"
        folder.mkdir()
        (folder / "w").write_text(str(self.count))
        return str(self.store.commit(f"qs/{name}", kind, folder, producer={"pipeline": "qs", "run_id": "r", **producer},
                                     inputs=inputs, metrics=metrics))

    def checkpoint(self, name, step, cache_key="k-rl", final=False) -> str:
        return self.commit(name, "checkpoint", {"stage_id": "rl", "stage_kind": "sft", "cache_key": cache_key},
                           {"steps": step} if final else {"promoted_at_step": step})

    def evaluate(self, checkpoint, env="arith", n=16, **metrics) -> str:
        scored = {"n": n, "format_rate": 1.0, "doom_loop_rate": 0.0, **metrics}
        return self.commit(f"eval-{self.count}", "dataset", {"stage_id": "eval", "stage_kind": "evaluate",
                                                             "cache_key": f"e{self.count}"},
                           {"checkpoint": {env: scored}}, {"checkpoint": checkpoint})


def test_best_checkpoint_picks_the_highest_evaluated_checkpoint_of_the_stage_run(tmp_path):
    store = Evaluated(tmp_path)
    step10, step20 = store.checkpoint("rl.step-10", 10), store.checkpoint("rl.step-20", 20)
    final = store.checkpoint("rl", 30, final=True)
    other_run = store.checkpoint("rl", 30, cache_key="k-other", final=True)  # another config of rl: not a candidate
    store.evaluate(step10, accuracy=0.50)
    store.evaluate(step20, accuracy=0.80, doom_loop_rate=0.3)
    store.evaluate(final, accuracy=0.70, doom_loop_rate=0.1)
    store.evaluate(other_run, accuracy=0.95)
    store.evaluate(step10, accuracy=0.99, n=2)  # a smaller evaluation of the same checkpoint: the larger one counts
    store.evaluate(final, env="calc", accuracy=1.0)  # another env
    notes = []
    chosen = resolve_inputs({"rl@best:arith.accuracy": "stages[2].policy", "warmup": "stages[2].data"},
                            {"rl": final, "warmup": "qs/warmup@" + "0" * 16}, store.store, notes.append)
    assert chosen == {"rl@best:arith.accuracy": step20, "warmup": "qs/warmup@" + "0" * 16}
    assert notes == [f"stages[2].policy: rl@best:arith.accuracy = {step20} (arith.accuracy 0.8)"]
    # a failure rate: the lowest is the best
    assert resolve_inputs({"rl@best:arith.doom_loop_rate": "p"}, {"rl": final}, store.store) == \
        {"rl@best:arith.doom_loop_rate": step10}


def test_best_checkpoint_ties_go_to_the_latest_step(tmp_path):
    store = Evaluated(tmp_path)
    step10, step20 = store.checkpoint("rl.step-10", 10), store.checkpoint("rl.step-20", 20)
    final = store.checkpoint("rl", 30, final=True)
    for checkpoint, accuracy in ((step10, 0.8), (step20, 0.8), (final, 0.6)):
        store.evaluate(checkpoint, accuracy=accuracy)
    assert resolve_inputs({"rl@best:arith.accuracy": "p"}, {"rl": final}, store.store) == \
        {"rl@best:arith.accuracy": step20}


def test_best_checkpoint_of_an_unevaluated_stage_is_one_line(tmp_path):
    store = Evaluated(tmp_path)
    final = store.checkpoint("rl", 30, final=True)
    store.evaluate(final, accuracy=0.7)
    with pytest.raises(NoBestCheckpoint) as raised:
        resolve_inputs({"rl@best:arith.sampled_accuracy": "stages[2].policy"}, {"rl": final}, store.store)
    assert str(raised.value) == "stages[2].policy: no evaluated checkpoint of rl has arith.sampled_accuracy"
    other = Evaluated(tmp_path / "other")
    (tmp_path / "other").mkdir()
    with pytest.raises(NoBestCheckpoint, match=r"^stages\[2\]\.policy: no evaluated checkpoint of rl has "
                                               r"arith\.accuracy$"):
        resolve_inputs({"rl@best:arith.accuracy": "stages[2].policy"}, {"rl": other.checkpoint("rl", 3, final=True)},
                       other.store)


def test_best_checkpoint_is_recorded_in_the_stage_inputs_and_its_cache_key(tmp_path):
    spec = parse_spec(yaml.safe_load(yaml.safe_dump({**SPEC, "store": f"file://{tmp_path / 'store'}"})),
                      read_sources=False)
    polish = spec.stage("polish")
    assert spec.written_inputs(polish) == {"warmup": "stages[2].data", "rl@best:arith.accuracy": "stages[2].policy"}
    assert [target for _, target, _ in spec.inputs_of(polish)] == ["warmup", "rl"]  # the graph reads the stage id
    store = Evaluated(tmp_path)
    step10, final = store.checkpoint("rl.step-10", 10), store.checkpoint("rl", 30, final=True)
    store.evaluate(step10, accuracy=0.9)
    store.evaluate(final, accuracy=0.1)
    warmup = "qs/warmup@" + "0" * 16
    inputs = resolve_inputs(spec.written_inputs(polish), {"rl": final, "warmup": warmup}, store.store)
    request = stage_request(spec, polish, inputs, store=store.store.location, run_id="r2", spec_hash=None)
    assert request.inputs == {"warmup": warmup, "rl@best:arith.accuracy": step10}  # what its manifests record
    store.evaluate(final, accuracy=0.95, n=32)  # a later evaluation changes the choice: another cache key
    again = resolve_inputs(spec.written_inputs(polish), {"rl": final, "warmup": warmup}, store.store)
    assert again["rl@best:arith.accuracy"] == final
    assert stage_request(spec, polish, again, store=store.store.location, run_id="r2",
                         spec_hash=None).cache_key != request.cache_key


def test_best_checkpoint_selector_parses_into_its_parts():
    assert parse_input("rl") == "rl"
    assert parse_input("rl@best:arith.accuracy") == BestCheckpoint("rl", "arith", "accuracy")
    assert str(parse_input("align@best:my.env.doom_loop_rate")) == "align@best:my.env.doom_loop_rate"


@pytest.mark.parametrize("stages, message", [
    ([{"policy": "rl@best:arith"}], "stages[2].policy: 'rl@best:arith': expected a stage id or "
                                    "STAGE@best:<env>.<metric> (e.g. rl@best:arith.accuracy)"),
    ([{"policy": "rl@latest"}], "stages[2].policy: 'rl@latest': expected a stage id or STAGE@best:<env>.<metric> "
                                "(e.g. rl@best:arith.accuracy)"),
    ([{"policy": "rl@best:arithm.accuracy"}], "stages[2].policy: 'rl@best:arithm.accuracy': unknown env 'arithm' "
                                              "(known: arith)"),
    ([{"policy": "rll@best:arith.accuracy"}], "stages[2].policy: unknown stage 'rll'"),
    ([{"data": "warmup@best:arith.accuracy"}], "stages[2].data: 'warmup@best:arith.accuracy': only a checkpoint "
                                               "input can name the best evaluated checkpoint"),
])
def test_best_checkpoint_selector_errors_are_one_spec_line(stages, message):
    spec = yaml.safe_load(yaml.safe_dump(SPEC))
    spec["stages"][2].update(stages[0])
    with pytest.raises(SpecError) as raised:
        parse_spec(spec, read_sources=False)
    assert str(raised.value) == message


def test_best_checkpoint_chosen_shows_in_the_lineage(tmp_path):
    from artifacts.lineage import lineage_lines

    store = Evaluated(tmp_path)
    step10 = store.checkpoint("rl.step-10", 10)
    polish = store.commit("polish", "checkpoint", {"stage_id": "polish", "stage_kind": "sft", "cache_key": "k-p"},
                          {"steps": 2}, {"rl@best:arith.accuracy": step10})
    lines = lineage_lines(store.store, store.store.resolve(polish))
    assert lines[1] == f"└── {step10}  checkpoint  stage rl (sft)  run r  (chosen as rl@best:arith.accuracy)"
