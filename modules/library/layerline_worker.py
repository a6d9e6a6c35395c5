#!/usr/bin/python
# -*- coding: utf-8 -*-
#
# Part of layerline. Manages one layerline worker through `python -m layerline.supervise`.

DOCUMENTATION = r"""
---
module: layerline_worker
short_description: Start, stop or restart one layerline worker under its supervisor
description:
  - Manages one long-running worker process (normally C(python -m layerline.worker ...)) on the
    target host by running C(python -m layerline.supervise start|stop|status --state-dir STATE_DIR)
    there and reading the one JSON object it answers with.
  - The supervisor runs in its own session, appends the worker's output to C(STATE_DIR/worker.log),
    restarts the worker whenever it exits without being told to (backoff 0.5 s doubling to 10 s;
    it gives up after O(max_restarts) exits in a row with under 30 s of uptime each), and records
    what it runs in C(STATE_DIR/supervisor.json).
  - A start is complete only once the worker has written its ready file, a JSON object that
    includes the worker's C(pid).
  - Idempotent on the argv, the environment and the inputs. With O(state=started), a running worker whose
    recorded argv equals O(argv) is left alone unless O(env) or the content of O(inputs) changed since it
    started (recorded in C(STATE_DIR/inputs.json)); any other argv restarts it.
version_added: "0.1.0"
author:
  - layerline contributors
requirements:
  - Linux (C(/proc)).
  - The O(python) interpreter on the target must be able to import C(layerline).
options:
  name:
    description:
      - A name for this worker, used in messages, the log and return values.
    type: str
    required: true
  state:
    description:
      - V(started) makes sure the worker runs with O(argv) and is ready; it restarts a worker
        that runs with another argv.
      - V(stopped) stops the supervisor and the worker and removes the pid and ready files.
      - V(restarted) always stops (if running) and starts again.
    type: str
    choices: [started, stopped, restarted]
    default: started
  argv:
    description:
      - The worker's command line, one list item per argument, as produced by the
        C(layerline_argv) filter. It is run directly, without a shell.
      - Required when O(state) is V(started) or V(restarted).
    type: list
    elements: str
  state_dir:
    description:
      - Directory holding C(supervisor.json), C(worker.pid), C(worker.log) and C(argv.json) for
        this worker. Created with mode C(0700) when missing. Use one directory per worker.
    type: path
    required: true
  ready_file:
    description:
      - File the worker writes, atomically, once it serves; a JSON object with at least C(pid).
        A stale one is removed before each start.
      - Defaults to the C(--ready-file) in O(argv), else C(STATE_DIR/ready.json).
    type: path
  ready_timeout:
    description:
      - Seconds to wait for the ready file after starting (or, with O(state=started), for an
        already running worker that is not ready yet) before failing.
    type: float
    default: 120
  python:
    description:
      - Interpreter that runs C(python -m layerline.supervise) (and so the supervisor). The
        worker's own interpreter is the first item of O(argv).
      - Defaults to the interpreter running this module (C(ansible_python_interpreter)).
    type: str
  env:
    description:
      - Extra environment variables for the supervisor and the worker. Values become strings.
      - A running worker started with other values is restarted.
    type: dict
    default: {}
  inputs:
    description:
      - Files and dirs the process reads when it starts (its keys dir, its API key files). A running
        worker whose inputs' content changed since it started is restarted; nothing else is.
    type: list
    elements: path
    default: []
  max_restarts:
    description:
      - Restarts in a row, each after under 30 s of uptime, before the supervisor gives up.
        V(0) means the first exit is final.
    type: int
    default: 5
  unit_files:
    description:
      - With O(state=stopped), systemd unit files of this worker's (their paths, as the
        C(layerline_worker_unit_files) filter names them) whose presence on the host to report
        as RV(units), so stopping a worker and finding its units is one module run.
    type: list
    elements: path
    default: []
attributes:
  check_mode:
    support: full
    description: Runs C(status) only and predicts the change.
  diff_mode:
    support: none
    description: No diff is returned.
notes:
  - A recorded pid is trusted only while C(/proc) shows a live process with the recorded start
    time, so a reused pid is never signalled.
  - Stopping sends SIGTERM to the supervisor, which forwards it to the worker and kills it after
    10 s; after 15 s the whole process group is killed.
"""

EXAMPLES = r"""
- name: Start the stage worker (restarts it only when its argv changed)
  layerline_worker:
    name: "{{ inventory_hostname }}"
    state: started
    state_dir: "{{ layerline_state_dir }}"
    argv: "{{ layerline_plan | layerline_argv(inventory_hostname) }}"
    ready_timeout: 300
  register: worker

- name: Restart with another environment
  layerline_worker:
    name: stage0
    state: restarted
    state_dir: /var/lib/layerline/stage0
    python: /opt/layerline/venv/bin/python
    argv: "{{ worker_argv }}"
    env:
      OMP_NUM_THREADS: "4"

- name: Stop the worker
  layerline_worker:
    name: stage0
    state: stopped
    state_dir: /var/lib/layerline/stage0
"""

RETURN = r"""
restarted_for:
  description: Why a running worker with the same argv was restarted (its O(inputs) or O(env) changed).
  returned: when that happened
  type: str
  sample: inputs (keys, API keys or environment) changed
name:
  description: The O(name) given.
  returned: always
  type: str
  sample: node1
state:
  description: The O(state) asked for.
  returned: always
  type: str
  sample: started
pid:
  description: The worker's pid, as written in its ready file.
  returned: when the worker is ready
  type: int
  sample: 41822
supervisor_pid:
  description:
    - With O(state=started) or O(state=restarted), the pid of the running supervisor.
    - With O(state=stopped), the pid of the supervisor that was stopped, or null.
  returned: always
  type: int
  sample: 41820
log:
  description: Path of the log the supervisor and the worker append to.
  returned: always
  type: str
  sample: /var/lib/layerline/stage0/worker.log
log_tail:
  description: The last lines of the log from this start (on failure, what went wrong).
  returned: when the supervise command reported them
  type: list
  elements: str
ready:
  description: The ready file's JSON object, as the worker wrote it.
  returned: when the worker is ready
  type: dict
  sample: {"pid": 41822, "bind": "tcp://127.0.0.1:9100"}
ready_file:
  description: Path of the ready file.
  returned: when O(state) is V(started) or V(restarted)
  type: str
  sample: /var/lib/layerline/stage0/ready.json
argv:
  description: The argv the worker runs with (or would run with, in check mode).
  returned: when O(state) is V(started) or V(restarted)
  type: list
  elements: str
  sample: ["/usr/bin/python3", "-m", "layerline.worker", "--layers", "0:8"]
units:
  description: The O(unit_files) the host holds, each as C(name) (the file's name) and C(path).
  returned: when O(state) is V(stopped)
  type: list
  elements: dict
  sample: [{"name": "layerline-worker-w1.service", "path": "/etc/systemd/system/layerline-worker-w1.service"}]
state_dir:
  description: The state directory.
  returned: always
  type: str
  sample: /var/lib/layerline/stage0
msg:
  description: What was done, or in check mode what would be done.
  returned: always
  type: str
  sample: started stage0
"""

import hashlib
import json
import os
import sys

from ansible.module_utils.basic import AnsibleModule


def supervise(module, python, command, state_dir, *extra):
    """Run `python -m layerline.supervise COMMAND --state-dir D ...`; its JSON answer and exit status."""
    p = module.params
    cmd = [python, "-m", "layerline.supervise", command, "--state-dir", state_dir] + list(extra)
    env = dict((str(k), str(v)) for k, v in (p["env"] or {}).items())
    rc, out, err = module.run_command(cmd, environ_update=env)
    for line in reversed(out.splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict):
            return rc, answer
    module.fail_json(
        msg="layerline_worker %s: `%s -m layerline.supervise %s` gave no answer (exit status %d): %s; "
            "set 'python' to an interpreter on this host that can import layerline (the "
            "layerline_runtime role installs it)" % (p["name"], python, command, rc,
                                                      (err or out).strip()[-1500:] or "no output"),
        name=p["name"], state=p["state"], state_dir=state_dir)


INPUTS_FILE = "inputs.json"


def inputs_digest(paths, env):
    """One digest of the environment and the content of every file under the inputs (missing ones count)."""
    h = hashlib.sha256(json.dumps(sorted(env.items())).encode())
    for top in sorted(paths):
        files = [top]
        if os.path.isdir(top):
            files = sorted(os.path.join(d, f) for d, _dirs, names in os.walk(top) for f in names)
        for path in files:
            h.update(path.encode() + b"\0")
            try:
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
            except OSError:
                h.update(b"missing")
    return h.hexdigest()


def recorded_digest(state_dir):
    try:
        with open(os.path.join(state_dir, INPUTS_FILE)) as f:
            return json.load(f).get("digest")
    except (OSError, ValueError, AttributeError):
        return None


def record_digest(state_dir, digest):
    tmp = os.path.join(state_dir, INPUTS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"digest": digest}, f)
    os.chmod(tmp, 0o600)
    os.replace(tmp, os.path.join(state_dir, INPUTS_FILE))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            state=dict(type="str", default="started", choices=["started", "stopped", "restarted"]),
            argv=dict(type="list", elements="str"),
            state_dir=dict(type="path", required=True),
            ready_file=dict(type="path"),
            ready_timeout=dict(type="float", default=120.0),
            python=dict(type="str"),
            env=dict(type="dict", default={}),
            inputs=dict(type="list", elements="path", default=[]),
            max_restarts=dict(type="int", default=5),
            unit_files=dict(type="list", elements="path", default=[]),
        ),
        required_if=[("state", "started", ["argv"]), ("state", "restarted", ["argv"])],
        supports_check_mode=True,
    )
    p = module.params
    name, state = p["name"], p["state"]
    state_dir = os.path.abspath(p["state_dir"])
    python = p["python"] or sys.executable
    if not (os.path.isabs(python) and os.access(python, os.X_OK)) and not module.get_bin_path(python):
        module.fail_json(msg="layerline_worker %s: python %s is not an executable on this host; set 'python' "
                             "to an interpreter that can import layerline" % (name, python))
    result = dict(changed=False, name=name, state=state, state_dir=state_dir, supervisor_pid=None,
                  log=os.path.join(state_dir, "worker.log"))
    if state == "stopped":   # a read, in check mode too: the units the role stops and removes next
        result["units"] = [{"name": os.path.basename(f), "path": f} for f in p["unit_files"] if os.path.exists(f)]
    if state != "stopped":
        if not p["argv"]:
            module.fail_json(msg="layerline_worker %s: argv is empty; give the worker's command line, "
                                 "e.g. the output of the layerline_argv filter" % name, **result)
        if p["ready_timeout"] <= 0:
            module.fail_json(msg="layerline_worker %s: ready_timeout must be more than 0 seconds, got %s"
                                 % (name, p["ready_timeout"]), **result)
        if p["max_restarts"] < 0:
            module.fail_json(msg="layerline_worker %s: max_restarts must be 0 or more, got %d"
                                 % (name, p["max_restarts"]), **result)
        result["argv"] = p["argv"]
    digest = inputs_digest(p["inputs"], dict((str(k), str(v)) for k, v in (p["env"] or {}).items()))
    # a worker that runs with this argv but was started before its keys, API keys or environment changed
    inputs_changed = False
    recorded = recorded_digest(state_dir)
    if state == "started" and recorded is not None and recorded != digest:  # status costs a process: only then
        _, status = supervise(module, python, "status", state_dir)
        inputs_changed = bool(status.get("running")) and status.get("argv") == p["argv"]
        if inputs_changed:
            state = "restarted"
            result["restarted_for"] = "inputs (keys, API keys or environment) changed"

    if module.check_mode:
        _, status = supervise(module, python, "status", state_dir)
        running = bool(status.get("running"))
        result["supervisor_pid"] = status.get("supervisor_pid")
        if state == "stopped":
            result.update(changed=running, msg=("would stop %s" if running else "%s is not running") % name)
        elif state == "restarted" or not running or status.get("argv") != p["argv"]:
            what = ("start" if not running else "restart (its inputs changed)" if inputs_changed
                    else "restart" if state == "restarted" else "restart (argv changed)")
            result.update(changed=True, msg="would %s %s" % (what, name))
        else:
            ready = status.get("ready")
            result.update(msg="%s is running with this argv" % name, ready=ready,
                          pid=(ready or {}).get("pid"))
        module.exit_json(**result)

    if state == "stopped":
        rc, answer = supervise(module, python, "stop", state_dir)
    else:
        extra = ["--name", name, "--ready-timeout", str(p["ready_timeout"]),
                 "--max-restarts", str(p["max_restarts"])]
        if p["ready_file"]:
            extra += ["--ready-file", p["ready_file"]]
        if state == "restarted":
            extra.append("--restart")
        rc, answer = supervise(module, python, "start", state_dir, *(extra + ["--"] + p["argv"]))
        result["ready_file"] = answer.get("ready_file")
        if answer.get("ready") is not None:
            result.update(ready=answer["ready"], pid=answer["ready"].get("pid"))
    result.update(changed=bool(answer.get("changed")), supervisor_pid=answer.get("supervisor_pid"),
                  log=answer.get("log") or result["log"], msg=answer.get("msg", ""))
    if answer.get("log_tail"):
        result["log_tail"] = answer["log_tail"]
    if state != "stopped" and rc == 0 and answer.get("state") != "failed":
        record_digest(state_dir, digest)
    if rc != 0 or answer.get("state") == "failed":
        tail = "\n".join(answer.get("log_tail") or []) or "(nothing)"
        result["msg"] = "layerline_worker %s\nLast lines of %s:\n%s" % (result["msg"], result["log"], tail)
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
