#!/usr/bin/python
# -*- coding: utf-8 -*-

from __future__ import annotations

DOCUMENTATION = r"""
---
module: layerline_stage
short_description: Make a host's stage dir hold only what its current stage lists, its stage root only the stages that run
description:
  - Runs on the host around the copy of its stage's files (playbooks/tasks/stage.yml), and once a deploy
    or drain committed to a plan (O(state=swept)).
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
  state:
    description: C(pruned) before the copy, C(complete) after it, C(swept) once a plan committed.
    type: str
    default: pruned
    choices: [pruned, complete, swept]
"""

EXAMPLES = r"""
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
    from layerline.staging import files_to_send, finish_stage, has_manifest, prune_stage, sweep_stages
except ImportError:
    LAYERLINE_IMPORT_ERROR = traceback.format_exc()


def main():
    module = AnsibleModule(argument_spec=dict(path=dict(type="path", required=True),
                                              manifest=dict(type="dict"),
                                              keep=dict(type="list", elements="str", default=[]),
                                              state=dict(type="str", default="pruned",
                                                         choices=["pruned", "complete", "swept"])),
                           required_if=[("state", "pruned", ["manifest"]), ("state", "complete", ["manifest"])],
                           supports_check_mode=True)
    p = module.params
    path = os.path.abspath(p["path"])
    if LAYERLINE_IMPORT_ERROR:
        module.fail_json(msg="layerline_stage: this host's Python interpreter cannot import layerline; run the "
                             "layerline_runtime role for it, or set ansible_python_interpreter to one that can",
                         exception=LAYERLINE_IMPORT_ERROR, path=path)
    changed, removed, send, whole = False, [], {}, False
    try:
        if p["state"] == "swept":
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
        module.fail_json(msg="layerline_stage %s: %s; fix its permissions, or set layerline_stage_dir to a dir "
                             "this user may write" % (path, e.strerror or e), path=path)
    module.exit_json(changed=bool(changed or removed), removed=removed, send=send, whole=whole, path=path)


if __name__ == "__main__":
    main()
