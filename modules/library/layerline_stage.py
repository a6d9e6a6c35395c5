#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
---
module: layerline_stage
short_description: Ship a host its stage's files, keep its stage dir to its current stage and its stage root to the stages that run
description:
  - O(state=shipped) (playbooks/tasks/stage.yml) ships the host its stage from O(src) on the controller, in
    one task - the collection's action plugin of the same name runs the module with O(state=pruned), sends
    each file of RV(send) into Ansible's temporary dir on the host, and runs the module with
    O(state=installed), which checks each file's size and SHA-1 against the manifest, moves it into the
    stage dir (mode 0600; across filesystems through a temporary file there that a failure removes) and
    writes the manifest (as O(state=complete)). Nothing is sent when the dir holds the stage whole; a
    failed or cut-off transfer leaves no partial file under a stage file's name.
  - Runs on the host around the transfer of its stage's files, and once a deploy or drain committed to a
    plan (O(state=swept)).
  - O(state=pruned), before the copy, makes the stage dir (mode 0700) and removes from it everything
    the stage's manifest does not list - the files of a stage it held before, or of another model (a
    Hugging Face stage's config.json and *.safetensors where a GGUF stage's model.gguf now goes), and
    what a failed copy left. The stage manifest (layerline-stage.json) goes too when it is not this
    stage's. It returns the listed files the dir lacks (missing, or of another size or SHA-1) as
    RV(send), what the copy sends, and makes those it holds whole mode 0600.
  - O(state=complete), after the copy, checks that every listed file is there at its size and writes
    the manifest; the checkpoint opener reads the stage's format and files from it, so a dir whose
    staging did not finish is refused, never opened as the model it held before.
  - O(state=swept) takes O(path) as the host's stage root (C(layerline_stage_dir), which holds one dir
    per stage, named by its layers) and removes everything there but the stage dirs named in O(keep) -
    the stages of the slot a committed drain left, a drained host's, what an older layerline kept in the
    root itself (C(layerline.staging.sweep_stages)).
  - The dirs belong to layerline (C(layerline_stage_dir)); nothing else should be kept in them.
  - What is listed and what is removed is decided by C(layerline.staging.prune_stage); the host's
    Python interpreter must import layerline (the layerline_runtime role installs it).
version_added: "0.1.0"
author:
  - layerline contributors
options:
  path:
    description: The host's stage dir; with O(state=swept), its stage root.
    type: path
    required: true
  manifest:
    description:
      - The stage's manifest, as C(layerline stage-checkpoint --json) prints it (its C(files) are kept).
      - Required unless O(state=swept).
    type: dict
  keep:
    description: With O(state=swept), the names of the stage dirs the root keeps (the C(layerline_stages_kept) filter's).
    type: list
    elements: str
    default: []
  src:
    description:
      - With O(state=shipped), the dir on the controller that holds the stage's files (what
        C(layerline stage-checkpoint) wrote).
    type: path
  sent:
    description:
      - With O(state=installed), where each transferred file landed on the host (name -> path); the action
        plugin fills it in.
    type: dict
  state:
    description:
      - C(shipped) ships the stage (through the action plugin); C(pruned) before a transfer, C(installed)
        after it (the action plugin's two module runs); C(complete) marks a stage whole; C(swept) once a
        plan committed.
    type: str
    default: pruned
    choices: [shipped, pruned, installed, complete, swept]
"""

EXAMPLES = r"""
- name: Ship the stage's files the host lacks and mark the stage whole
  layerline_stage:
    path: /tmp/layerline-w2/checkpoint/layers-2-4-of-6
    manifest: "{{ layerline_stage_made.stdout | from_json }}"
    src: /home/me/.layerline/stage/w2
    state: shipped

- name: Make the stage dir hold only this stage's files
  layerline_stage:
    path: /tmp/layerline-w2/checkpoint/layers-2-4-of-6
    manifest: "{{ layerline_stage_made.stdout | from_json }}"

- name: Mark the stage whole once its files are copied
  layerline_stage:
    path: /tmp/layerline-w2/checkpoint/layers-2-4-of-6
    manifest: "{{ layerline_stage_made.stdout | from_json }}"
    state: complete

- name: Keep only the stage the committed plan runs here
  layerline_stage:
    path: /tmp/layerline-w2/checkpoint
    keep: [layers-2-4-of-6]
    state: swept
"""

RETURN = r"""
removed:
  description: What was removed from the dir (in check mode, what would be), by name.
  returned: always
  type: list
  elements: str
  sample: [config.json, model.safetensors]
send:
  description: With O(state=pruned), the listed files the dir lacks (missing, or of another size or SHA-1),
    each with its manifest entry; the copy sends only these (C(layerline.staging.files_to_send)).
  returned: always
  type: dict
  sample: {model.safetensors: {bytes: 1048576, sha1: 3f786850e387550fdab836ed7e6dc881de23001b}}
whole:
  description: With O(state=pruned), whether the dir holds the whole stage already (nothing to send, this
    stage's manifest there), so that O(state=complete) has nothing to do.
  returned: always
  type: bool
  sample: true
shipped:
  description: With O(state=shipped) or O(state=installed), the files moved into the stage dir, by name.
  returned: with O(state=shipped) or O(state=installed)
  type: list
  elements: str
  sample: [model.safetensors]
shipped_bytes:
  description: With O(state=shipped) or O(state=installed), their bytes (0 when the dir held the stage whole).
  returned: with O(state=shipped) or O(state=installed)
  type: int
  sample: 1048576
path:
  description: The stage dir (the stage root, swept).
  returned: always
  type: str
  sample: /tmp/layerline-w2/checkpoint
"""

import os
import traceback

from ansible.module_utils.basic import AnsibleModule

LAYERLINE_IMPORT_ERROR = None
try:
    from layerline.errors import LayerlineError
    from layerline.staging import files_to_send, finish_stage, has_manifest, install_files, prune_stage, sweep_stages
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()


def main():
    module = AnsibleModule(argument_spec=dict(path=dict(type="path", required=True),
                                              manifest=dict(type="dict"),
                                              keep=dict(type="list", elements="str", default=[]),
                                              src=dict(type="path"),
                                              sent=dict(type="dict"),
                                              state=dict(type="str", default="pruned",
                                                         choices=["shipped", "pruned", "installed", "complete",
                                                                  "swept"])),
                           required_if=[("state", "pruned", ["manifest"]), ("state", "complete", ["manifest"]),
                                        ("state", "installed", ["manifest", "sent"])],
                           supports_check_mode=True)
    p = module.params
    path = os.path.abspath(p["path"])
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_stage: this host's Python interpreter cannot import layerline; run the "
                             "layerline_runtime role for it, or set ansible_python_interpreter to one that can",
                         exception=LAYERLINE_IMPORT_ERROR, path=path)
    if p["state"] == "shipped":  # the action plugin runs pruned and installed in its place
        module.fail_json(msg="layerline_stage: state shipped runs through the layerline.layerline collection's "
                             "action plugin of the same name; call it as layerline.layerline.layerline_stage",
                         path=path)
    changed, removed, send, whole, extra = False, [], {}, False, {}
    try:
        if p["state"] == "installed":
            if module.check_mode:
                module.exit_json(changed=bool(p["sent"]), removed=[], path=path, shipped=sorted(p["sent"]),
                                 shipped_bytes=0)
            done = install_files(path, p["manifest"], p["sent"])
            changed = finish_stage(path, p["manifest"]) or bool(p["sent"])
            extra = {"shipped": sorted(p["sent"]), "shipped_bytes": done}
        elif p["state"] == "swept":
            removed = sweep_stages(path, p["keep"], dry_run=module.check_mode)
        elif p["state"] == "complete":
            changed = not has_manifest(path, p["manifest"]) if module.check_mode else finish_stage(path, p["manifest"])
        else:
            changed = not os.path.isdir(path) or os.stat(path).st_mode & 0o777 != 0o700
            if changed and not module.check_mode:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)   # the stage root, made by the first
                os.makedirs(path, mode=0o700, exist_ok=True)
                os.chmod(path, 0o700)
            removed = prune_stage(path, p["manifest"], dry_run=module.check_mode)
            send, modes = files_to_send(path, p["manifest"], dry_run=module.check_mode)
            changed = changed or bool(modes)
            whole = not send and has_manifest(path, p["manifest"])
    except LayerlineError as e:
        module.fail_json(msg="layerline_stage %s: %s" % (path, e), path=path)
    except OSError as e:
        if p["state"] == "installed":   # a full disk, most often: the OS error as it is (staging.copy_failure reads it)
            module.fail_json(msg="layerline_stage %s: cannot take the stage's files ([Errno %s] %s)"
                                 % (path, e.errno, e.strerror or e), path=path)
        module.fail_json(msg="layerline_stage %s: %s; fix its permissions, or set layerline_stage_dir to a dir "
                             "this user may write" % (path, e.strerror or e), path=path)
    module.exit_json(changed=bool(changed or removed), removed=removed, send=send, whole=whole, path=path, **extra)


if __name__ == "__main__":
    main()
