"""The child-process protocol shared by the app's child and the benchmark's workers: progress and a result come
back, a crash or an error becomes one clear error, and a cancelled child leaves no process behind."""

import textwrap
import threading
import time
from pathlib import Path

import pytest

from acstudio.child_process import ChildError, ChildFailed, ChildTimedOut, run_child
from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken


def python(code: str) -> list[str]:
    return ["-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_progress_messages_and_the_result_come_back_through_what_the_child_prints():
    seen, progress = [], []
    result = run_child(python("""
        import json, sys
        from acstudio.child_process import emit, read_task, send_progress, serve

        def work():
            task = read_task()
            print("chatty library output")
            send_progress(1, 2, "half way")
            emit({"note": task["n"]})
            return {"answer": task["n"] * 2}

        sys.exit(serve(work))
        """), task={"n": 21}, progress=lambda *a: progress.append(a), on_message=seen.append)
    assert result == {"answer": 42}
    assert progress == [(1, 2, "half way")] and seen == [{"note": 21}]


def test_a_crash_an_error_and_an_unexpected_exception_each_become_one_error(tmp_path):
    with pytest.raises(ChildFailed) as crash:
        run_child(python("""
            import os, sys
            print("last words", file=sys.stderr, flush=True)
            os._exit(3)
            """), log=tmp_path / "crash.log", what="the test child")
    assert crash.value.exit_code == 3 and crash.value.log_tail == "last words"
    assert str(crash.value) == "the test child ended unexpectedly (exit code 3):\nlast words"
    assert (tmp_path / "crash.log").read_text() == "last words\n"

    with pytest.raises(ACStudioError, match=r"^no such model: foo$") as known:
        run_child(python("""
            import sys
            from acstudio.child_process import serve
            from acstudio.errors import ACStudioError

            def work():
                raise ACStudioError("no such model: foo")

            sys.exit(serve(work))
            """))
    assert not isinstance(known.value, ChildFailed)

    with pytest.raises(ChildError, match="ZeroDivisionError") as unexpected:
        run_child(python("""
            import sys
            from acstudio.child_process import serve
            sys.exit(serve(lambda: 1 / 0))
            """))
    assert "Traceback" in unexpected.value.details


# A child that starts a grandchild in its process group, reports its pid, then sleeps without listening.
SLEEPER = """
    import subprocess, sys, time
    from acstudio.child_process import emit, stdout_for_messages
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with stdout_for_messages():
        emit({"pid": grandchild.pid})
        time.sleep(60)
    """


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_cancelling_or_timing_out_kills_the_child_and_what_it_started():
    cancel, pids = CancelToken(), []

    def started(message):
        pids.append(message["pid"])
        cancel.cancel()

    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        run_child(python(SLEEPER), on_message=started, cancel=cancel)
    assert time.monotonic() - t0 < 20 and pids
    deadline = time.monotonic() + 5
    while alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pids[0])

    with pytest.raises(ChildTimedOut, match=r"timed out after 1\.5 s"):
        run_child(python(SLEEPER), on_message=lambda m: pids.append(m["pid"]), timeout_s=1.5)
    deadline = time.monotonic() + 5
    while alive(pids[-1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2 and not alive(pids[-1])


def test_a_child_that_listens_stops_on_its_own_when_asked():
    cancel = CancelToken()
    threading.Timer(0.5, cancel.cancel).start()
    with pytest.raises(Cancelled, match=r"^cancelled by the user$"):  # the child's answer, not a kill
        run_child(python("""
            import sys, time
            from acstudio.child_process import cancel_on_request, serve
            from acstudio.jobs import CancelToken

            def work():
                token = CancelToken()
                cancel_on_request(token)
                while True:
                    token.raise_if_cancelled()
                    time.sleep(0.01)

            sys.exit(serve(work))
            """), cancel=cancel, cancel_grace_s=30)
