"""`posttrain serve`: the evaluate-on-checkpoint trigger (and optionally the pipeline on a cron
schedule) served from this process against the Prefect server of PREFECT_API_URL, no work pool.

deployments/prefect.yaml declares the same trigger for `prefect deploy` onto a work pool.
"""

from __future__ import annotations

from tasks.runtime.events import CHECKPOINT_CREATED, RESOURCE_PREFIX

EVALUATE_DEPLOYMENT = "evaluate-on-checkpoint"
# The event's payload becomes the evaluation flow's parameters (storage options as JSON text:
# a template renders to a string), and the event's id: Prefect delivers an event at least once, and
# a second delivery's run steps aside for the first (flows/evaluate.py: `first_run_of_event`).
TRIGGER_PARAMETERS = {"checkpoint_ref": "{{ event.payload.ref }}", "store": "{{ event.payload.store }}",
                      "storage_options": "{{ event.payload.storage_options | tojson }}",
                      "event_id": "{{ event.id | string }}"}
TRIGGER_MATCH = {"prefect.resource.id": f"{RESOURCE_PREFIX}*", "posttrain.evaluate": "true"}


def checkpoint_trigger():
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

    return DeploymentEventTrigger(name="evaluate new checkpoints", expect={CHECKPOINT_CREATED},
                                  match=TRIGGER_MATCH, parameters=TRIGGER_PARAMETERS)


def deployments(spec_path: str | None, cron: str | None, store: str | None) -> list:
    """The evaluate-on-checkpoint deployment, plus the pipeline of `spec_path` (on `cron` if given)."""
    from flows.evaluate import evaluate
    from flows.post_train import post_train

    served = [evaluate.to_deployment(name=EVALUATE_DEPLOYMENT, triggers=[checkpoint_trigger()])]
    if spec_path is not None:
        parameters = {"spec": spec_path, **({"store": store} if store else {})}
        served.append(post_train.to_deployment(name="served", parameters=parameters, cron=cron))
    return served


def serve(spec_path: str | None, cron: str | None, store: str | None) -> None:
    from prefect import serve as prefect_serve

    served = deployments(spec_path, cron, store)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in served)
    print(f"serving {names}; every {CHECKPOINT_CREATED} event with posttrain.evaluate=true starts an evaluation",
          flush=True)
    prefect_serve(*served, print_starting_message=False)
