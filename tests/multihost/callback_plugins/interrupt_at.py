"""An Ansible callback for drain_interrupts.stop_partway: it stops the run as the task it names starts.

With LAYERLINE_TEST_INTERRUPT_AT=NAME (a task's name, with or without its role's prefix) and
LAYERLINE_TEST_INTERRUPT_SIGNAL=INT or KILL in ansible-playbook's environment, the moment that task
starts (the stdout callback has printed its header; nothing of it has run), it sends SIGINT to
ansible-playbook alone (a Ctrl-C: the run ends its own way) or SIGKILL to its process group (nothing
runs a handler). From inside the run, so the stop lands at that point however loaded the machine is
(a test that reads the output and then signals can land later: the run may have gone on).

Before a Ctrl-C it waits (up to 10 s) for the forks of the tasks before to exit. ansible-playbook
forwards a SIGINT to its forks, which then leave with os._exit: a fork that has sent its result but not
yet released the final queue's lock takes the lock with it, and ansible-playbook's cleanup waits for it
forever (an Ansible race, wider on a busy machine: the stacks of CI runs 62-64 showed it). A user's
Ctrl-C can hit that too; this test is about what the drain leaves, not about Ansible's race.

With LAYERLINE_TEST_STACKS=FILE too, a SIGUSR1 to ansible-playbook writes every thread's stack to FILE
(faulthandler): where a run that does not end after its Ctrl-C waits.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time

import psutil
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: interrupt_at
type: aggregate
short_description: stop the run as a named task starts (layerline's tests)
description: Sends SIGINT to ansible-playbook, or SIGKILL to its process group, as the task named by
  LAYERLINE_TEST_INTERRUPT_AT starts.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "interrupt_at"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        stacks = os.environ.get("LAYERLINE_TEST_STACKS")
        if stacks:
            self._stacks = open(stacks, "w")  # noqa: SIM115 - open while the process lives: faulthandler writes to it
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)

    def v2_playbook_on_task_start(self, task, is_conditional):
        at = os.environ.get("LAYERLINE_TEST_INTERRUPT_AT")
        name = task.get_name()
        if not at or not (name == at or name.endswith(f": {at}")):
            return
        if os.environ.get("LAYERLINE_TEST_INTERRUPT_SIGNAL", "INT") == "KILL":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        _forks_gone()
        os.kill(os.getpid(), signal.SIGINT)


def _forks_gone(timeout: float = 10.0) -> None:
    """Wait until no live child of this process runs ansible-playbook's own command line (its forks)."""
    me = psutil.Process()
    own = me.cmdline()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_runs(kid, own) for kid in me.children()):
        time.sleep(0.05)


def _runs(proc: psutil.Process, cmdline: list[str]) -> bool:
    try:
        return proc.cmdline() == cmdline
    except psutil.Error:   # gone meanwhile, or exited and not yet reaped
        return False
