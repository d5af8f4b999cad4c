"""The output lock is held by the process on the folder itself: deleting a file cannot let a second run in, and a
released lock leaves nothing behind."""

from __future__ import annotations

import os

import pytest

from qwen_edit_core.common.files import LOCK_NAME, OutputDirBusyError, OutputLock


def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    with OutputLock(tmp_path, purpose="training"):
        (tmp_path / LOCK_NAME).unlink()
        with pytest.raises(OutputDirBusyError, match="is in use by another run"):
            OutputLock(tmp_path).acquire()


def test_a_released_lock_leaves_nothing_behind_and_the_holder_is_named_while_held(tmp_path):
    with OutputLock(tmp_path, purpose="training"):
        with pytest.raises(OutputDirBusyError, match=f"PID {os.getpid()} on .*, training started"):
            OutputLock(tmp_path).acquire()
    assert list(tmp_path.iterdir()) == []
    OutputLock(tmp_path).acquire().release()
