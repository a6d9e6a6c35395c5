#!/usr/bin/python
# -*- coding: utf-8 -*-
#
# Part of layerline. Manages one layerline worker process under layerline.supervise.

DOCUMENTATION = r"""
---
module: layerline_worker
short_description: Start, stop or restart one layerline worker under a small supervisor
description:
  - Manages one long-running worker process (normally C(python -m layerline.worker ...))
    on the target host, under the supervisor C(python -m layerline.supervise).
  - The supervisor is started in its own session, writes its pid to C(STATE_DIR/worker.pid),
    appends the worker's output to C(STATE_DIR/worker.log), restarts the worker when it
    fails (backoff 0.5 s doubling to 10 s, giving up after O(max_restarts) failures in a
    row with under 30 s of uptime each), and stops it on SIGTERM.
  - A start is complete only once the worker has written its ready file, a JSON object
    that includes the worker's C(pid). The worker is expected to write it atomically
    (write a temporary file, then rename it).
  - The module is idempotent on the argv. With O(state=started), a worker whose supervisor
    is alive and whose recorded argv (C(STATE_DIR/argv.json)) equals O(argv) is left
    alone; any other argv restarts it.
  - The supervisor and the worker run with C(STATE_DIR) as their working directory.
version_added: "0.1.0"
author:
  - layerline contributors
requirements:
  - Linux (C(/proc)); C(psutil) is used when importable, but is not required.
  - The O(python) interpreter on the target must be able to import C(layerline).
options:
  name:
    description:
      - A name for this worker, used in messages and return values (for example the
        inventory host name or the stage).
    type: str
    required: true
  state:
    description:
      - V(started) makes sure the worker runs with O(argv) and is ready; it restarts a
        worker that runs with another argv.
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
      - Directory holding C(worker.pid), C(worker.log) and C(argv.json) for this worker
        (and C(ready.json) by default). Created with mode C(0700) when missing.
      - Use one directory per worker.
    type: path
    required: true
  ready_file:
    description:
      - File the worker writes, atomically, once it serves; it must hold a JSON object
        with at least C(pid). A stale one is removed before each start.
      - Defaults to C(STATE_DIR/ready.json).
    type: path
  ready_timeout:
    description:
      - Seconds to wait for the ready file after starting (or, with O(state=started), for
        an already running worker that is not ready yet) before failing.
    type: float
    default: 120
  python:
    description:
      - Interpreter used to run C(python -m layerline.supervise). The supervisor runs
        O(argv) as given, so the worker's own interpreter is the first item of O(argv).
      - Defaults to the interpreter running this module (C(ansible_python_interpreter)).
    type: str
  env:
    description:
      - Extra environment variables for the supervisor and the worker, on top of the
        module's environment. Values are converted to strings.
    type: dict
    default: {}
  max_restarts:
    description:
      - Restarts in a row, each after under 30 s of uptime, before the supervisor gives
        up and exits. V(0) means the first failure is final.
    type: int
    default: 5
attributes:
  check_mode:
    description: Can run in check mode and return a changed status prediction without modifying the target.
    support: full
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check mode), when in diff mode.
    support: none
notes:
  - A pid in C(worker.pid) is trusted only when that process is alive, is not a zombie,
    and its command line runs C(layerline.supervise) with this very pid file, so a
    recycled pid is never signalled.
  - Stopping sends SIGTERM to the supervisor, which forwards it to the worker and kills
    it after 10 s; after 15 s the module kills the whole process group.
  - The environment (O(env)) is not part of the idempotence check; use
    O(state=restarted) after changing only the environment.
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

- name: Start a worker with an explicit interpreter and environment
  layerline_worker:
    name: stage0
    state_dir: /var/lib/layerline/stage0
    python: /opt/layerline/venv/bin/python
    argv:
      - /opt/layerline/venv/bin/python
      - -m
      - layerline.worker
      - --checkpoint
      - /srv/models/demo
      - --layers
      - "0:8"
    env:
      OMP_NUM_THREADS: "4"

- name: Restart after changing only the environment
  layerline_worker:
    name: stage0
    state: restarted
    state_dir: /var/lib/layerline/stage0
    argv: "{{ worker_argv }}"

- name: Stop the worker
  layerline_worker:
    name: stage0
    state: stopped
    state_dir: /var/lib/layerline/stage0
"""

RETURN = r"""
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
  returned: when O(state) is V(started) or V(restarted) and the worker is ready
  type: int
  sample: 41822
supervisor_pid:
  description:
    - With O(state=started) or O(state=restarted), the pid of the running supervisor.
    - With O(state=stopped), the pid of the supervisor that was stopped, or null when
      none was running.
  returned: always
  type: int
  sample: 41820
log:
  description: Path of the log the supervisor and the worker append to.
  returned: always
  type: str
  sample: /var/lib/layerline/stage0/worker.log
ready:
  description: The ready file's JSON object, as the worker wrote it.
  returned: when O(state) is V(started) or V(restarted) and the worker is ready
  type: dict
  sample: {"pid": 41822, "bind": "tcp://127.0.0.1:9100"}
ready_file:
  description: Path of the ready file.
  returned: always
  type: str
  sample: /var/lib/layerline/stage0/ready.json
argv:
  description: The argv the worker runs with (or would run with, in check mode).
  returned: when O(state) is V(started) or V(restarted)
  type: list
  elements: str
  sample: ["/usr/bin/python3", "-m", "layerline.worker", "--layers", "0:8"]
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

import json
import os
import signal
import subprocess
import sys
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

try:
    import psutil
except ImportError:  # /proc is enough on Linux
    psutil = None

SUPERVISOR_MODULE = "layerline.supervise"
STOP_TIMEOUT_S = 15.0
KILL_TIMEOUT_S = 5.0
POLL_S = 0.1
LOG_TAIL_LINES = 20


# -- processes ------------------------------------------------------------------------


def process_exists(pid):
    """True when pid names a live process (a zombie counts as gone)."""
    if not pid or pid <= 0:
        return False
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    # Fields after the command name (which may itself hold spaces or parentheses).
    fields = stat[stat.rfind(b")") + 2:].split()
    return bool(fields) and fields[0] not in (b"Z", b"X")


def process_cmdline(pid):
    """The process's argument list, or None when it cannot be read."""
    if psutil is not None:
        try:
            return psutil.Process(pid).cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return [to_native(arg, errors="surrogate_or_strict") for arg in raw.split(b"\0") if arg]


def process_cwd(pid):
    try:
        if psutil is not None:
            return psutil.Process(pid).cwd()
        return os.readlink("/proc/%d/cwd" % pid)
    except Exception:
        return None


def is_our_supervisor(pid, pidfile):
    """True only when pid is a live layerline.supervise that writes this very pidfile."""
    if not process_exists(pid):
        return False
    cmdline = process_cmdline(pid)
    if not cmdline or not any(SUPERVISOR_MODULE in arg for arg in cmdline):
        return False
    try:
        given = cmdline[cmdline.index("--pidfile") + 1]
    except (ValueError, IndexError):
        return False
    if not os.path.isabs(given):
        cwd = process_cwd(pid)
        if cwd is None:
            return False
        given = os.path.join(cwd, given)
    return os.path.realpath(given) == os.path.realpath(pidfile)


def all_pids():
    if psutil is not None:
        return psutil.pids()
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def group_members(pgid):
    """Live processes in process group pgid (zombies excluded)."""
    members = []
    for pid in all_pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:
            continue
        if process_exists(pid):
            members.append(pid)
    return members


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- files --------------------------------------------------------------------------------


def read_pid(path):
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def read_ready(path):
    data = read_json(path)
    return data if isinstance(data, dict) else None


def remove(path):
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def write_json_atomic(path, data, mode=0o600):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
        fh.write("\n")
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def log_tail(path, offset=0, lines=LOG_TAIL_LINES):
    """The last lines of the log written since offset."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError as exc:
        return "(cannot read %s: %s)" % (path, to_native(exc))
    text = data.decode("utf-8", "replace").rstrip("\n")
    if not text:
        return "(%s has nothing from this start)" % path
    return "\n".join(text.splitlines()[-lines:])


def append_log(path, message):
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    line = "%s layerline_worker: %s\n" % (stamp, message)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    finally:
        os.close(fd)


# -- the worker -------------------------------------------------------------------------


class Worker(object):
    def __init__(self, module):
        self.module = module
        p = module.params
        self.name = p["name"]
        self.state_dir = os.path.abspath(p["state_dir"])
        self.pidfile = os.path.join(self.state_dir, "worker.pid")
        self.log = os.path.join(self.state_dir, "worker.log")
        self.argv_file = os.path.join(self.state_dir, "argv.json")
        self.ready_file = os.path.abspath(p["ready_file"] or os.path.join(self.state_dir, "ready.json"))
        self.argv = p["argv"]
        self.python = p["python"] or sys.executable
        self.result = dict(
            changed=False, name=self.name, state=p["state"], state_dir=self.state_dir,
            log=self.log, ready_file=self.ready_file, supervisor_pid=None,
        )
        if self.argv is not None:
            self.result["argv"] = self.argv

    # what is there now

    def running_supervisor(self):
        pid = read_pid(self.pidfile)
        if pid is not None and is_our_supervisor(pid, self.pidfile):
            return pid
        return None

    def orphans(self):
        """Live leftovers of a supervisor that died without cleaning up.

        A supervisor leads its own session and process group, so its workers keep its pid
        as their group and session id. They are trusted only when the old supervisor pid
        is gone and one of them is the worker named by the ready file or runs the
        recorded argv.
        """
        old = read_pid(self.pidfile)
        if old is None or process_exists(old):
            return []
        members = []
        for pid in group_members(old):
            try:
                if os.getsid(pid) == old:
                    members.append(pid)
            except OSError:
                pass
        if not members:
            return []
        ready = read_ready(self.ready_file) or {}
        recorded = read_json(self.argv_file)
        for pid in members:
            if pid == ready.get("pid") or (recorded and process_cmdline(pid) == recorded):
                return members
        return []

    # actions

    def stop(self, pid, proc=None):
        """Stop the supervisor pid and everything in its process group."""

        def gone():
            if proc is not None:
                return proc.poll() is not None
            return not process_exists(pid)

        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not wait_until(gone, STOP_TIMEOUT_S):
            append_log(self.log, "supervisor pid %d still running %gs after SIGTERM; killing its process group"
                       % (pid, STOP_TIMEOUT_S))
            kill_group(pid, signal.SIGKILL)
            wait_until(gone, KILL_TIMEOUT_S)
        # Anything the worker left behind in the group (its own children).
        if group_members(pid):
            kill_group(pid, signal.SIGKILL)
            wait_until(lambda: not group_members(pid), KILL_TIMEOUT_S)
        if not gone():
            self.module.fail_json(
                msg="layerline_worker %s: could not stop supervisor pid %d even with SIGKILL; "
                    "check the process (ps -o pid,stat,cmd -g %d) and remove %s by hand"
                    % (self.name, pid, pid, self.pidfile), **self.result)

    def stop_existing(self):
        """Stop whatever runs for this worker; True when something was running."""
        pid = self.running_supervisor()
        stopped = False
        if pid is not None:
            self.result["supervisor_pid"] = pid
            self.stop(pid)
            stopped = True
        else:
            leftovers = self.orphans()
            if leftovers:
                old = read_pid(self.pidfile)
                append_log(self.log, "supervisor pid %d is gone; killing its leftover processes %s"
                           % (old, leftovers))
                kill_group(old, signal.SIGKILL)
                wait_until(lambda: not group_members(old), KILL_TIMEOUT_S)
                stopped = True
        remove(self.pidfile)
        remove(self.ready_file)
        return stopped

    def ensure_state_dir(self):
        try:
            if not os.path.isdir(self.state_dir):
                os.makedirs(self.state_dir, 0o700)
                os.chmod(self.state_dir, 0o700)
        except OSError as exc:
            self.module.fail_json(
                msg="layerline_worker %s: cannot create state_dir %s: %s; choose a state_dir "
                    "the remote user may write to" % (self.name, self.state_dir, to_native(exc)),
                **self.result)

    def start(self):
        self.ensure_state_dir()
        remove(self.pidfile)
        remove(self.ready_file)
        env = os.environ.copy()
        env.update((str(k), str(v)) for k, v in (self.module.params["env"] or {}).items())
        cmd = [self.python, "-m", SUPERVISOR_MODULE,
               "--pidfile", self.pidfile, "--log", self.log,
               "--max-restarts", str(self.module.params["max_restarts"]),
               "--ready-file", self.ready_file, "--"] + list(self.argv)
        try:
            log_offset = os.path.getsize(self.log)
        except OSError:
            log_offset = 0
        append_log(self.log, "starting %s" % self.name)
        try:
            log_fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            self.module.fail_json(msg="layerline_worker %s: cannot open log %s: %s"
                                  % (self.name, self.log, to_native(exc)), **self.result)
        try:
            # A new session: the supervisor outlives this module and Ansible's connection.
            # No inherited pipes: Ansible must not wait on them.
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                close_fds=True, start_new_session=True, cwd=self.state_dir, env=env,
            )
        except OSError as exc:
            self.module.fail_json(
                msg="layerline_worker %s: cannot run the supervisor with python %s: %s; set "
                    "'python' to an interpreter on this host that can import layerline"
                    % (self.name, self.python, to_native(exc)), **self.result)
        finally:
            os.close(log_fd)
        self.result["supervisor_pid"] = proc.pid
        write_json_atomic(self.argv_file, list(self.argv))

        ready, reason = self.wait_ready(lambda: proc.poll() is None,
                                        lambda: proc.returncode, log_offset)
        if ready is None:
            self.stop(proc.pid, proc)
            remove(self.pidfile)
            self.fail_not_ready(reason, log_offset)
        self.set_ready(ready)

    def wait_ready(self, alive, returncode, log_offset=None):
        """(ready dict, None) once the ready file holds a JSON object, else (None, reason)."""
        timeout = self.module.params["ready_timeout"]
        deadline = time.monotonic() + timeout
        while True:
            ready = read_ready(self.ready_file)
            if ready is not None:
                return ready, None
            if not alive():
                rc = returncode()
                if rc is None:
                    return None, "its supervisor is gone"
                if rc == 0:
                    return None, "the worker exited with status 0 before writing its ready file %s" % self.ready_file
                if log_offset is not None and " supervise: supervisor pid " not in log_tail(self.log, log_offset, 10 ** 6):
                    return None, ("the supervisor did not come up (status %d); check that python %s "
                                  "can import layerline (set 'python' otherwise)" % (rc, self.python))
                if rc == 127:
                    return None, "the worker command could not be started (supervisor status 127)"
                return None, ("the supervisor gave up with status %d (the worker kept failing "
                              "before writing %s; max_restarts=%d)"
                              % (rc, self.ready_file, self.module.params["max_restarts"]))
            if time.monotonic() >= deadline:
                return None, ("it did not write its ready file %s within %gs; raise ready_timeout "
                              "if the worker needs longer to load" % (self.ready_file, timeout))
            time.sleep(POLL_S)

    def fail_not_ready(self, reason, log_offset):
        self.module.fail_json(
            msg="layerline_worker %s: the worker did not become ready: %s. It has been stopped; "
                "fix the cause shown in the log and run again. Last lines of %s:\n%s"
                % (self.name, reason, self.log, log_tail(self.log, log_offset)),
            **self.result)

    def set_ready(self, ready):
        self.result["ready"] = ready
        self.result["pid"] = ready.get("pid")

    # states

    def started(self):
        pid = self.running_supervisor()
        recorded = read_json(self.argv_file)
        if pid is not None and recorded == self.argv:
            self.result["supervisor_pid"] = pid
            ready = read_ready(self.ready_file)
            if ready is None and not self.module.check_mode:
                try:
                    log_offset = max(0, os.path.getsize(self.log) - 4096)
                except OSError:
                    log_offset = 0
                ready, reason = self.wait_ready(lambda: is_our_supervisor(pid, self.pidfile),
                                                lambda: None)
                if ready is None:
                    self.fail_not_ready_running(reason, log_offset)
            if ready is not None:
                self.set_ready(ready)
            self.result["msg"] = "%s is running with this argv" % self.name
            return
        self.result["changed"] = True
        if pid is None:
            what = "start"
        elif recorded != self.argv:
            what = "restart (argv changed)"
        else:
            what = "restart"
        if self.module.check_mode:
            self.result["msg"] = "would %s %s" % (what, self.name)
            return
        self.stop_existing()
        self.start()
        self.result["msg"] = "%s %s" % ({"start": "started"}.get(what, "restarted"), self.name)

    def fail_not_ready_running(self, reason, log_offset):
        self.module.fail_json(
            msg="layerline_worker %s: the running worker (supervisor pid %s) is not ready: %s. "
                "Look at the log, then use state=restarted. Last lines of %s:\n%s"
                % (self.name, self.result["supervisor_pid"], reason, self.log,
                   log_tail(self.log, log_offset)),
            **self.result)

    def stopped(self):
        pid = self.running_supervisor()
        running = pid is not None or bool(self.orphans())
        self.result["supervisor_pid"] = pid
        if self.module.check_mode:
            self.result["changed"] = running
            self.result["msg"] = ("would stop %s" if running else "%s is not running") % self.name
            return
        self.result["changed"] = self.stop_existing()
        self.result["msg"] = ("stopped %s" if self.result["changed"] else "%s was not running") % self.name

    def restarted(self):
        self.result["changed"] = True
        if self.module.check_mode:
            self.result["msg"] = "would restart %s" % self.name
            return
        self.stop_existing()
        self.start()
        self.result["msg"] = "restarted %s" % self.name


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
            max_restarts=dict(type="int", default=5),
        ),
        required_if=[
            ("state", "started", ["argv"]),
            ("state", "restarted", ["argv"]),
        ],
        supports_check_mode=True,
    )
    p = module.params
    if p["state"] != "stopped" and not p["argv"]:
        module.fail_json(msg="layerline_worker %s: argv is empty; give the worker's command line, "
                             "e.g. the output of the layerline_argv filter" % p["name"])
    if p["ready_timeout"] <= 0:
        module.fail_json(msg="layerline_worker %s: ready_timeout must be more than 0 seconds, got %s"
                             % (p["name"], p["ready_timeout"]))
    if p["max_restarts"] < 0:
        module.fail_json(msg="layerline_worker %s: max_restarts must be 0 or more, got %d"
                             % (p["name"], p["max_restarts"]))

    worker = Worker(module)
    getattr(worker, p["state"])()
    module.exit_json(**worker.result)


if __name__ == "__main__":
    main()
