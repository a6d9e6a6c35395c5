"""The one line a deploy stops with when a host cannot take its stage (layerline.staging.copy_failure),
from what the shipping task (layerline_stage, state shipped) registered."""
from __future__ import annotations

from layerline.staging import copy_failure

STAGE_DIR, BYTES = "/var/tmp/stage-h3", 538109600


def test_a_copy_cut_off_says_run_again_and_names_the_host_once():
    # what ansible's ssh connection says when sftp, scp and dd were each killed on the host (rc 255)
    cut = {"unreachable": True, "msg": "Failed to connect to the host via piped: Connection to 10.77.8.13\n"
                                       "closed by remote host.\r\n" + "x" * 400}
    msg = copy_failure("h3", STAGE_DIR, BYTES, cut)
    assert msg.startswith(f"h3: the copy of its stage ({BYTES} bytes) into {STAGE_DIR} was cut off (Failed to "
                          "connect to the host via piped: Connection to 10.77.8.13 closed by remote host.")
    assert "\n" not in msg and "\r" not in msg and msg.count("h3") == 2 and len(msg) < 450, msg
    assert "run deploy.yml again" in msg and "free space" not in msg


def test_a_full_disk_names_the_os_error_and_the_room_the_stage_needs():
    full = {"failed": True, "msg": "layerline_stage /x/stage: [Errno 28] No space left on device: "
                                   "'/x/stage/.model.gguf.part-123'"}
    msg = copy_failure("w2", STAGE_DIR, 12345, full)
    assert msg == (f"w2: could not write its stage to {STAGE_DIR} ([Errno 28] No space left on device); the stage "
                   "needs 12345 bytes there: free space, or set layerline_stage_dir to a disk with room, and run again")


def test_a_failure_without_an_os_error_is_cut_to_one_short_line():
    msg = copy_failure("w2", STAGE_DIR, 1, {"failed": True, "msg": "boom\n" * 100})
    assert msg.startswith(f"w2: could not write its stage to {STAGE_DIR} (boom boom") and "\n" not in msg
    assert "..." in msg and len(msg) < 400


def test_a_cause_with_nothing_after_its_colon_ends_cleanly():
    # what ansible-core 2.19 said in `make test-big` when every copy into h3 was killed
    cut = {"unreachable": True, "msg": 'Task failed: Data could not be sent to remote host "10.77.8.13". '
                                       "Make sure this host can be reached over ssh: "}
    msg = copy_failure("h3", STAGE_DIR, BYTES, cut)
    assert 'over ssh); run deploy.yml again' in msg, msg
