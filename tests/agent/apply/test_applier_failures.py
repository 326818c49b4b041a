"""What a failed apply says about why: the task's message, or a loop task's failed items' own."""

from __future__ import annotations

from meridian_node_agent.apply.applier import _Counter


def failed(task: str, res: dict[str, object]) -> dict[str, object]:
    return {"event": "runner_on_failed", "event_data": {"task": task, "res": res}}


def test_a_task_says_its_message() -> None:
    counter = _Counter()
    counter(failed("Converge the engines", {"failed": True, "msg": "engine 'chat' (check readiness): exited"}))
    assert (counter.failed, counter.failures) == (1, ["Converge the engines: engine 'chat' (check readiness): exited"])


def test_a_loop_task_says_each_failed_items_reason_not_ansibles_summary() -> None:
    counter = _Counter()
    items = [
        {"failed": False, "msg": "", "_ansible_item_label": "tokenizer 1"},
        {"failed": True, "msg": "'model.gguf' does not match the signed manifest", "_ansible_item_label": "tiny 1"},
    ]
    counter(failed("Make the signed artifacts present", {"msg": "One or more items failed", "results": items}))
    assert counter.failures == [
        "Make the signed artifacts present: tiny 1: 'model.gguf' does not match the signed manifest"
    ]
