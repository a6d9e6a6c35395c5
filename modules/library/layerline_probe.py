#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
module: layerline_probe
short_description: Measure a layerline node's hardware and return it as facts
description:
  - Runs C(layerline.probe) on the target and returns its NodeCaps self-report as the
    C(layerline_caps) fact. The planner places transformer layers from these facts.
  - Compute speed (fp32 matmul) and memory bandwidth are measured per device, the read
    speed of the checkpoint's disk is measured with the page cache dropped for the file
    (and O_DIRECT where the filesystem allows it). A speed that was not measured is
    returned as null, never as 0.
  - The probe makes no network traffic; the node's address comes from its interface table.
  - The module changes nothing on the target apart from the optional O(cache_file) and its dir.
version_added: "0.1.0"
author:
  - layerline authors
options:
  checkpoint:
    description:
      - Checkpoint directory on the target (Hugging Face layout), or one file of it.
      - Free disk space is read on its filesystem (the nearest existing parent when the
        directory does not exist yet), and its biggest C(*.safetensors) file is read to
        measure the disk.
      - When omitted, free space is read for the working directory and the disk speed is
        null.
    type: path
  device:
    description:
      - The host's C(layerline_device) (C(cpu), C(cuda), C(cuda:N) or C(cuda+cpu)).
      - A CUDA device the host does not have fails the task with a message saying how to
        fix C(layerline_device). Every visible CUDA device is reported whatever this says.
    type: str
    default: cpu
  addr:
    description:
      - Address other nodes reach this one at.
      - Defaults to the primary non-loopback IPv4 address of the target, else C(127.0.0.1).
    type: str
  budget_s:
    description:
      - Seconds of measuring per device (half matmul, half memory copy) and for the disk
        read. The whole probe takes about two to three times this plus the C(torch) import.
    type: float
    default: 0.5
  measure_disk:
    description:
      - Whether to measure the read speed of the checkpoint's disk.
    type: bool
    default: true
  peers:
    description:
      - Other hosts as C(ADDRESS:PORT) (a port that listens there, e.g. sshd's). The round trip
        of a TCP handshake to each is returned as C(rtt_s), the planner's hop cost; cached with
        the rest, so a second deploy plans the same.
    type: list
    elements: str
    default: []
  cache_file:
    description:
      - File on the target that keeps the last result (written with mode C(0600)); its dir is made, and
        kept, mode C(0700) (the host's state dir).
      - When it holds a result measured with the same options and the same layerline
        version, that result is returned without measuring again, unless O(refresh=true).
      - Not written in check mode.
    type: path
  refresh:
    description:
      - Measure again even when O(cache_file) holds a matching result.
      - Step factors recorded with O(record_step) are kept across new measurements.
    type: bool
    default: false
  measure:
    description:
      - With V(false), measure nothing. Return the cached result when O(cache_file) holds a
        matching one (C(cached=true), with the facts), else C(cached=false) and no facts.
      - Hosts that share a machine's cores probe one at a time; reading their caches needs no such
        turn, so the probe play reads them all at once and measures only where nothing matched.
    type: bool
    default: true
  record_step:
    description:
      - Measure nothing; keep in O(cache_file) what a started worker's step time says about the
        planner's cost model (measured / (predicted / factor)) for the worker's precision and
        compile mode, returned as C(step_factor) and as C(step_factors) of the device in later
        facts, so the next plan predicts that mode from it.
      - Needs O(cache_file) to hold a result already (the probe play writes it); nothing is
        recorded otherwise, or when a time is not a positive number.
    type: dict
    suboptions:
      device:
        description: The device the worker runs on (C(cpu), C(cuda:0), ...).
        type: str
        default: cpu
      precision:
        description: The worker's precision.
        type: str
        required: true
      compile:
        description: The worker's C(--compile) mode.
        type: str
        default: "off"
      measured_s:
        description: The step time the worker measured at warm-up (its ready file's C(step_s)).
        type: raw
      predicted_s:
        description: The plan's C(predicted_s) for the stage.
        type: raw
      factor:
        description: The plan stage's C(step_factor), the factor C(predicted_s) already includes.
        type: float
        default: 1.0
requirements:
  - The target's Python interpreter (C(ansible_python_interpreter)) can import C(layerline)
    and C(torch); the C(layerline_runtime) role installs them.
notes:
  - Facts are returned whether or not check mode is on; check mode only skips writing
    O(cache_file).
  - Supports C(check_mode).
"""

EXAMPLES = r"""
- name: Probe the node against the checkpoint it will load
  layerline_probe:
    checkpoint: "{{ layerline_checkpoint }}"
    device: "{{ layerline_device | default('cpu') }}"
    cache_file: "{{ layerline_state_dir }}/caps.json"

- name: Measure again, ignoring the cached result, with a longer budget
  layerline_probe:
    checkpoint: /srv/models/llama
    budget_s: 2
    cache_file: /var/lib/layerline/caps.json
    refresh: true

- name: Keep a started worker's measured step for the next plan
  layerline_probe:
    cache_file: "{{ layerline_state_dir }}/caps.json"
    record_step:
      precision: int8
      compile: max-autotune
      measured_s: "{{ started.ready.step_s }}"
      predicted_s: 0.0123
      factor: 1.0

- name: Only read the cached result (cached=false when there is none to use)
  layerline_probe:
    checkpoint: /srv/models/llama
    cache_file: /var/lib/layerline/caps.json
    measure: false
  register: probe_cache

- name: Show what each node can do
  ansible.builtin.debug:
    msg: >-
      {{ ansible_facts.layerline_caps.addr }}:
      {{ ansible_facts.layerline_caps.devices | map(attribute='name') | join(', ') }},
      {{ (ansible_facts.layerline_caps.ram_available_bytes / 2**30) | round(1) }} GiB free
"""

RETURN = r"""
cached:
  description: Whether the facts came from O(cache_file) instead of a new measurement.
  returned: always
  type: bool
  sample: false
step_factor:
  description: With O(record_step), the factor kept for the worker's mode, or null when none was kept
    (the cached caps with it are returned as the C(layerline_caps) fact).
  returned: with O(record_step)
  type: float
  sample: 0.412
ansible_facts:
  description: Facts added to the host.
  returned: success
  type: dict
  contains:
    layerline_caps:
      description: The node's NodeCaps self-report.
      returned: success
      type: dict
      contains:
        addr:
          description: Address other nodes reach this one at.
          type: str
          sample: 10.0.0.12
        hostname:
          description: The target's host name.
          type: str
          sample: node1
        machine_id:
          description:
            - The running kernel's boot id, read afresh even when the rest comes from the cache.
            - Hosts that share one machine's cores (namespaces, containers) share it; the plan
              gives their workers a short OpenMP spin so an idle one sleeps.
          type: str
          sample: 980ac8f4-3cab-43aa-a633-5d79979e7fbe
        os:
          description: Operating system name.
          type: str
          sample: Linux
        cores:
          description: CPU cores this process may use (affinity and cgroup quota applied).
          type: int
          sample: 16
        ram_total_bytes:
          description: RAM, capped by a cgroup memory limit.
          type: int
          sample: 68719476736
        ram_available_bytes:
          description: RAM available now (under a cgroup limit, the limit less the cgroup's working set).
          type: int
          sample: 60129542144
        ram_capped:
          description: True when a memory cgroup holds this host below the machine's RAM; the planner
            then counts the cap as this host's own instead of sharing the machine's RAM among its hosts.
          type: bool
          sample: false
        disk_free_bytes:
          description: Free bytes on the checkpoint's filesystem; null when unreadable.
          type: int
          sample: 512110190592
        disk_read_bytes_per_s:
          description: Measured read speed of the checkpoint's biggest safetensors file;
            null when not measured (never 0).
          type: float
          sample: 1754265584.4
        disk_read_cached:
          description: True when the disk read looked served by the page cache (an
            impossible rate, or the file's pages stayed resident); the rate is kept.
          type: bool
          sample: false
        devices:
          description: Compute devices, C(cpu) first, then C(cuda:N).
          type: list
          elements: dict
          contains:
            name:
              description: Device name as the worker's C(--device) takes it.
              type: str
              sample: cuda:0
            kind:
              description: C(cpu) or C(cuda).
              type: str
              sample: cuda
            memory_bytes:
              description: Device memory (RAM for C(cpu)).
              type: int
              sample: 85899345920
            memory_free_bytes:
              description: Device memory free now.
              type: int
              sample: 84825604096
            flops_per_s:
              description: Measured fp32 matmul FLOP/s.
              type: float
              sample: 198132552840.4
            mem_bw_bytes_per_s:
              description:
                - The rate a stage's weight bytes are priced at. On C(cpu), one-token decode's
                  weight-streaming rate through two Llama-shaped layers, less each layer's fixed
                  cost; on C(cuda), a device-memory copy (bytes read plus written per second).
              type: float
              sample: 33741918972.8
            layer_overhead_s:
              description:
                - Fixed seconds each decode layer adds to a step on top of its bytes (its ops,
                  norms, attention), from two small layers; C(cpu) only, null when not measured.
              type: float
              sample: 0.00021
        probe_seconds:
          description: How long the probe took.
          type: float
          sample: 1.7
"""

import json
import os
import sys
import traceback

from ansible.module_utils.basic import AnsibleModule

LAYERLINE_IMPORT_ERROR = None
try:
    import layerline
    from layerline.errors import LayerlineError
    from layerline.files import atomic_write_json, ensure_private_dir
    from layerline.cost import step_factor, step_mode
    from layerline.probe import carry_step_factors, machine_id, measure_rtt, probe, with_step_factor
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()

CACHE_FORMAT = 1


def cache_key(params):
    return {
        "format": CACHE_FORMAT,
        "layerline_version": getattr(layerline, "__version__", None),
        "checkpoint": params["checkpoint"],
        "device": params["device"],
        "addr": params["addr"],
        "budget_s": params["budget_s"],
        "measure_disk": params["measure_disk"],
        "peers": sorted(params["peers"]),
    }


def read_cache_file(path):
    """The cache file's {"key", "caps"} object, or None when there is none to read."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("caps"), dict):
        return None
    return data


def read_cache(path, key):
    """The cached caps when path holds a result for the same key, else None."""
    data = read_cache_file(path)
    return data["caps"] if data is not None and data.get("key") == key else None


def record_step(module, path, step):
    """record_step: the worker's factor into the cached caps (the caps themselves as they were)."""
    data = read_cache_file(path) if path else None
    factor = step_factor(step.get("measured_s"), step.get("predicted_s"), step.get("factor"))
    if data is None or factor is None:
        module.exit_json(changed=False, cached=data is not None, step_factor=None,
                         msg="nothing recorded: " + ("no probe result in cache_file yet" if data is None
                                                     else "measured_s and predicted_s must be positive numbers"))
    caps = with_step_factor(data["caps"], step["device"], step_mode(step["precision"], step["compile"]), factor)
    if not module.check_mode:
        write_cache(module, path, data.get("key"), caps)
    # the facts too, so a plan made later in the same run predicts from it
    caps["machine_id"] = machine_id()
    module.exit_json(changed=False, cached=True, step_factor=factor, ansible_facts={"layerline_caps": caps})


def write_cache(module, path, key, caps):
    """The cache file; its dir main() made private already."""
    try:
        atomic_write_json(path, {"key": key, "caps": caps})  # mode 0600
    except OSError as e:
        module.fail_json(msg=f"cannot write cache_file {path}: {e}; choose a path the remote user can write, "
                             "or leave cache_file out")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            checkpoint=dict(type="path"),
            device=dict(type="str", default="cpu"),
            addr=dict(type="str"),
            budget_s=dict(type="float", default=0.5),
            measure_disk=dict(type="bool", default=True),
            cache_file=dict(type="path"),
            refresh=dict(type="bool", default=False),
            measure=dict(type="bool", default=True),
            peers=dict(type="list", elements="str", default=[]),
            record_step=dict(type="dict", options=dict(
                device=dict(type="str", default="cpu"),
                precision=dict(type="str", required=True),
                compile=dict(type="str", default="off"),
                measured_s=dict(type="raw"),
                predicted_s=dict(type="raw"),
                factor=dict(type="float", default=1.0),
            )),
        ),
        supports_check_mode=True,
    )

    if LAYERLINE_IMPORT_ERROR is not None:
        module.fail_json(
            msg=(f"the Python interpreter on this host ({sys.executable}) cannot import layerline; run the "
                 "layerline_runtime role for this host, or set ansible_python_interpreter to an interpreter "
                 "that has layerline installed"),
            exception=LAYERLINE_IMPORT_ERROR,
        )

    params = module.params
    if params["budget_s"] <= 0:
        module.fail_json(msg=f"budget_s is {params['budget_s']}; give a positive number of seconds, e.g. 0.5")

    key = cache_key(params)
    cache_file = params["cache_file"]
    if cache_file and not module.check_mode:
        # the host's state dir (the cache's dir): made, and kept private, here rather than by a task of its own
        try:
            ensure_private_dir(os.path.dirname(cache_file) or ".")
        except OSError as e:
            module.fail_json(msg=f"cache_file {cache_file}: cannot make its dir private ({e}); choose a path the "
                                 "remote user can write, or leave cache_file out")
    if params["record_step"] is not None:
        step = dict(params["record_step"])
        for k in ("measured_s", "predicted_s"):  # raw: templating may hand over a string or None
            try:
                step[k] = float(step[k]) if step[k] not in (None, "") else None
            except (TypeError, ValueError):
                step[k] = None
        record_step(module, cache_file, step)
    if cache_file and not params["refresh"]:
        caps = read_cache(cache_file, key)
        if caps is not None:
            caps["machine_id"] = machine_id()  # a reboot changes it; the measurements stand
            module.exit_json(changed=False, cached=True, ansible_facts={"layerline_caps": caps})
    if not params["measure"]:
        module.exit_json(changed=False, cached=False)

    try:
        caps = probe(
            checkpoint=params["checkpoint"],
            device=params["device"],
            addr=params["addr"],
            budget_s=params["budget_s"],
            measure_disk=params["measure_disk"],
        )
    except LayerlineError as e:
        module.fail_json(msg=str(e))

    caps["rtt_s"] = measure_rtt(params["peers"])
    if cache_file:
        old = read_cache_file(cache_file)
        caps = carry_step_factors(old and old["caps"], caps)
    if cache_file and not module.check_mode:
        write_cache(module, cache_file, key, caps)

    module.exit_json(changed=False, cached=False, ansible_facts={"layerline_caps": caps})


if __name__ == "__main__":
    main()
