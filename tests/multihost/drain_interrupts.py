"""A drain (or a rejoin) whose controller is stopped partway. tests/multihost/test_deployment.py's shared
deployment calls it right before a drain.yml run it makes anyway: that run is then the run again, and its
own checks (the route, route.json, the old slot stopped, every request under load equal to the undisturbed
tokens) are what "it ends in the intended state with nothing lost" means. No deployment of its own.

    stop_partway(home, ["drain.yml", *extra, "-e", "layerline_drain=h2"], ["h2"], BEFORE_SWITCH, signal.SIGKILL)
    r = playbook("drain.yml", *extra, "-e", "layerline_drain=h2")      # the run again, checked as before
    run_again_resumed(r.stdout)

Where: the drain of h2 under load is first SIGKILLed as its new slot's workers start (BEFORE_SWITCH);
the drain of h3 (the standby promoted in place) first gets a Ctrl-C as the server's switch starts
(AT_SWITCH: it may or may not have switched, so the run again says "through h1, h2, h4" or
"route unchanged"). tests/unit/test_route_transactions.py stops a drain after each of its steps.

Points (each the start of a task, as ansible-playbook prints it): BEFORE_SWITCH (the new slot's workers
start), AT_SWITCH (the server's POST /admin/route), AFTER_SWITCH (the server routes through the new stages,
nothing kept yet). Signals: SIGKILL (the controller's process group: nothing runs a handler) or SIGINT (to
ansible-playbook alone, as a Ctrl-C: it ends the run its own way). The run sends them itself as the task
starts (callback_plugins/interrupt_at.py): a test that read the output and signalled from outside landed
late on a loaded machine, once after the run had already kept the route.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from helpers import BIN, PHASE_LOG, ROOT, ansible_env

CALLBACKS = Path(__file__).resolve().parent / "callback_plugins"
BEFORE_SWITCH = "Start this host's worker in the new slot"
AT_SWITCH = "Switch the server to the plan's stages"
AFTER_SWITCH = "Keep the new route state, nothing pending"
# deploy.yml -e layerline_rejoin=HOST: the server's switch and the commit after it (playbooks/serve.yml)
REJOIN_AFTER_SWITCH = "Keep the route state, nothing pending"
# how long a stopped run may take to end once the task starts (a SIGINT's run ends its own way in seconds;
# beside a busy loop, in runs 34 and 41 of ten and in each of runs 62-64 (three test files at a time),
# never: a fork killed holding the final queue's lock left ansible-playbook's cleanup waiting for it.
# interrupt_at now waits for the forks before its Ctrl-C; should a run still not end, its threads'
# stacks go to the phase log, and a second Ctrl-C ends it)
ENDS_WITHIN = 15.0


def _task_started(line: str, at: str) -> bool:
    """A task header naming `at` (with or without its role's prefix: `TASK [role : name]`)."""
    return line.startswith("TASK [") and (f"[{at}]" in line or f": {at}]" in line)


def stop_partway(home: Path, args: list[str], drained: list[str], at: str, sig: int = signal.SIGKILL,
                 timeout: float = 600) -> str:
    """Run `ansible-playbook ARGS` until the task `at` starts, stop it with sig, and check what it left:
    route.json still holds the state from before, with the change `pending` (drained: the hosts drained
    once it is done), so a run again resumes it and never says "drained already". Returns the run's
    output until then."""
    before = json.loads((home / "route.json").read_text())
    stacks = home / f"interrupt-stacks-{time.time():.0f}.txt"
    env = ansible_env(ANSIBLE_CALLBACK_PLUGINS=str(CALLBACKS), ANSIBLE_CALLBACKS_ENABLED="interrupt_at",
                      LAYERLINE_TEST_INTERRUPT_AT=at, LAYERLINE_TEST_STACKS=str(stacks),
                      LAYERLINE_TEST_INTERRUPT_SIGNAL="KILL" if sig == signal.SIGKILL else "INT")
    # its own process group (start_new_session): what a SIGKILL of the controller's group takes
    p = subprocess.Popen([str(BIN / "ansible-playbook"), *args], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    at_started = threading.Event()

    def read() -> None:
        for line in p.stdout:
            lines.append(line)
            if _task_started(line, at):
                at_started.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while p.poll() is None and not at_started.wait(0.5) and time.monotonic() < deadline:
        pass
    # once the task starts, the run ends its own way in seconds; after a Ctrl-C ansible-playbook once sat
    # in its cleanup until the timeout (CI run 34, 626 s). As a user does then: a second Ctrl-C (the
    # first made SIGINT's default action its exit), and at last SIGKILL
    for then in (None, signal.SIGINT, signal.SIGKILL):
        if then is not None and p.poll() is None:
            note = f"[interrupt] the run went on after {at!r}: {signal.Signals(then).name}"
            if then == signal.SIGINT:   # where it waits, for whoever reads the log
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)
                note += "; its threads' stacks:\n" + (stacks.read_text() if stacks.exists() else "(none written)")
            print(note)
            with open(PHASE_LOG, "a") as f:   # .ci/run prints it: a passing test's output is not shown
                f.write(f"{time.strftime('%H:%M:%S')} {note}\n")
            (os.killpg if then == signal.SIGKILL else os.kill)(p.pid, then)
        try:
            p.wait(ENDS_WITHIN if then is None else 30)
            break
        except subprocess.TimeoutExpired:
            pass
    reader.join(30)
    out = "".join(lines)
    reached = any(_task_started(line, at) for line in out.splitlines())
    assert reached, f"the run never reached {at!r}:\n{out[-3000:]}"
    assert p.returncode != 0, f"the run was not stopped at {at!r}:\n{out[-3000:]}"
    route = json.loads((home / "route.json").read_text())
    pending = route.pop("pending", None)
    assert route == {k: v for k, v in before.items() if k != "pending"}, \
        f"route.json changed before the switch was kept: {route} (was {before})"
    assert pending and sorted(pending["state"]["drained"]) == sorted(drained), pending
    return out


def run_again_resumed(output: str) -> None:
    """The run again's output: it resumed the change (it switched and kept it), it did not say there was
    nothing to do."""
    flat = " ".join(output.split())
    assert "is drained already" not in flat and ("route epoch" in flat or "route unchanged" in flat), flat[-3000:]
