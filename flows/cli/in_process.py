"""`posttrain run SPEC --in-process STAGE`: one stage in this very process, for a debugger.

The stage's request is built as the flow builds it (flows/stage_requests.py: the same config, cache
key and inputs), its inputs read from the store (every stage upstream must be committed for this
spec and code: a `posttrain run` made them), and the child's own `execute` runs it here, with no
Prefect, no child process, no timeout: `python -m pdb -m flows.cli.main run SPEC --in-process sft`,
or a `breakpoint()` in the stage's code, steps through it. Its outputs are committed as a child
commits them (so they can be inspected), but no cache entry is written: the next `posttrain run`
runs the stage again as usual. An error in the stage is raised with its traceback (the point of
running it here); bad input is one line, exit 2.
"""

from __future__ import annotations

from flows.cli.common import UserError


def run_in_process(spec_path: str, spec, text: str, store, stage_id: str) -> int:
    from flows.post_train import save_spec, spec_hash_of
    from flows.spec import stage_graph
    from flows.stage_requests import new_run_id
    from tasks.runtime.child import execute

    stage = _stage(spec, stage_id)
    gpus = spec.resolved(stage).gpus
    if gpus > 1:
        raise UserError(f"--in-process: stage {stage_id!r} runs on {gpus} GPUs, one process each; this runs one "
                        "process (set its gpus: 1 to debug it here)")
    upstream = Upstream(spec, spec_path, store, new_run_id(spec.name), spec_hash_of(text), stage_graph(spec))
    request = upstream.request(stage_id)  # its inputs committed: only then is anything written
    save_spec(store, text)
    print(f"{stage_id}: running in this process (run {upstream.run_id}, store {store.uri})", flush=True)
    result = execute(request)
    for key, ref in result["outputs"].items():
        print(f"{stage_id}.{key}: {ref}", flush=True)
    return 0


class Upstream:
    """The requests of a spec's stages as the flow would make them, their inputs the committed outputs
    of the stages upstream, read from the store's stage cache."""

    def __init__(self, spec, spec_path: str, store, run_id: str, spec_hash: str, graph: dict[str, list[str]]):
        self.spec, self.spec_path, self.store, self.run_id, self.spec_hash = spec, spec_path, store, run_id, spec_hash
        self.graph = graph
        self.outputs: dict[str, str] = {}

    def request(self, stage_id: str):
        from flows.stage_requests import stage_request

        from flows.stage_inputs import NoBestCheckpoint, resolve_inputs

        stage = self.spec.stage(stage_id)
        try:
            inputs = resolve_inputs(self.spec.written_inputs(stage),
                                    {upstream: self.output(upstream) for upstream in self.graph[stage_id]}, self.store,
                                    print)
        except NoBestCheckpoint as exc:
            raise UserError(str(exc)) from None
        return stage_request(self.spec, stage, inputs, store=self.store.location,
                             run_id=self.run_id, spec_hash=self.spec_hash)

    def output(self, stage_id: str) -> str:
        """The ref of a stage's primary output, as the flow hands it to the stages downstream."""
        from tasks.runtime.cache import cached_result

        if stage_id not in self.outputs:
            cached = cached_result(self.store, self.request(stage_id).cache_key)
            if cached is None:
                raise UserError(f"--in-process: stage {stage_id!r} upstream has no committed output for this spec "
                                f"and code in {self.store.uri}; run `posttrain run {self.spec_path}` first")
            self.outputs[stage_id] = cached["outputs"][type(self.spec.stage(stage_id)).primary]
        return self.outputs[stage_id]


def _stage(spec, stage_id: str):
    ids = [stage.id for stage in spec.stages]
    if stage_id not in ids:
        raise UserError(f"--in-process: unknown stage {stage_id!r} (the spec's stages: {', '.join(ids)})")
    return spec.stage(stage_id)
