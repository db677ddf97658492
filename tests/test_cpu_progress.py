"""The CPU-time progress source on a real process: a sample taken late (the agent was
starved) dates the work it saw no later than that work can have ended, so a hang right
after it is found from when it began, not from when the agent looked."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from elastic.core.watchdog.beats import CPU_SAMPLE, WorkerProgress

# Computes for about 0.3 s of CPU, says so, then sleeps: a worker that hangs after a step.
BUSY_THEN_ASLEEP = """
import sys, time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("asleep", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_late_sample_dates_the_work_at_the_start_of_its_window() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_THEN_ASLEEP], stdout=subprocess.PIPE, text=True
    )
    try:
        progress = WorkerProgress(local_rank=0, rank=0, pid=proc.pid, started=time.monotonic())
        progress.sample(time.monotonic())  # the first sample: the base
        window_start = time.monotonic()
        assert proc.stdout is not None and proc.stdout.readline() == "asleep\n"
        time.sleep(3.0)  # the agent looks again only now, 3 s after the work ended
        late = time.monotonic()
        progress.sample(late)
        assert progress.source == "cpu", "the 0.3 s of work were not seen"
        # The work ran within the first second of the window (0.3 s of CPU, started at
        # once); dated at the late sample, the hang would look 3 s younger than it is.
        assert progress.last_progress <= window_start + 1.5, (
            f"dated {late - progress.last_progress:.2f}s before the sample"
        )
        assert progress.idle(late) >= 1.5
        wall_lag = time.time() - progress.last_progress_wall
        assert abs(wall_lag - (time.monotonic() - progress.last_progress)) < 0.2
        # Asleep since: the next samples see nothing and date nothing.
        dated = progress.last_progress
        time.sleep(CPU_SAMPLE + 0.1)
        progress.sample(time.monotonic())
        assert progress.last_progress == dated
    finally:
        proc.kill()
        proc.wait()
