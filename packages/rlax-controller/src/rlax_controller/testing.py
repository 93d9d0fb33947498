"""Test helpers for supervised runs (not used at run time): the one check every chaos and
end-to-end test makes, that no component exited unless chaos or the test itself made it.

A supervisor restarts a crashed component and the run still finishes, often with the very
trajectory a test compares: a crash is then invisible unless the test asks. The local
supervisor marks every exit that was not a chaos kill nor the run's end `unplanned` (its
`exit` event in `events.jsonl` and `SupervisorReport.unplanned_restarts`), with the end of
that life's log. A test that SIGKILLs components itself names them in `caused`.
"""

from __future__ import annotations

import collections
import json
import pathlib
import signal
from collections.abc import Iterable

from rlax_controller.supervisor import SupervisorReport, UnplannedRestart

__all__ = ["check_no_unplanned_restarts", "unplanned_restarts"]


def _events_path(run: pathlib.Path) -> pathlib.Path:
    for candidate in (run / "logs" / "events.jsonl", run / "events.jsonl"):
        if candidate.exists():
            return candidate
    raise AssertionError(f"no supervisor events under {run} (looked for logs/events.jsonl, events.jsonl)")


def unplanned_restarts(run: SupervisorReport | pathlib.Path) -> list[UnplannedRestart]:
    """The unplanned exits of a run: from its report, or from the `events.jsonl` of a run
    folder (or of its logs folder) that `rlax launch` wrote in another process."""
    if isinstance(run, SupervisorReport):
        return list(run.unplanned_restarts)
    found = []
    for line in _events_path(pathlib.Path(run)).read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "exit" and event.get("unplanned"):
            found.append(UnplannedRestart(event["name"], event["role"], event["code"], event["log_tail"]))
    return found


def check_no_unplanned_restarts(run: SupervisorReport | pathlib.Path, *, caused: Iterable[str] = ()) -> None:
    """Fail (`AssertionError`) on any exit of a component that neither the supervisor's chaos
    mode nor the test caused; the message holds each such component's exit code and the end
    of its log (the crash's traceback). `caused`: the processes the test SIGKILLed itself,
    once per kill; each excuses one SIGKILL exit of that process."""
    excused = collections.Counter(caused)
    unexplained = []
    for exit_ in unplanned_restarts(run):
        if exit_.code == -signal.SIGKILL and excused[exit_.name] > 0:
            excused[exit_.name] -= 1
            continue
        unexplained.append(exit_)
    if unexplained:
        where = run.log_dir if isinstance(run, SupervisorReport) else run
        details = "\n".join(exit_.describe() for exit_ in unexplained)
        raise AssertionError(
            f"{len(unexplained)} exit(s) in {where} that no chaos kill and no kill of the test's "
            f"own ({sorted(set(caused)) or 'none'}) explains; each was restarted and the run went "
            f"on:\n{details}"
        )
